"""Argument parsing and the subcommands. Nothing below this module sees argparse."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from localllm import __version__
from localllm.errors import LocalLLMError, UsageError

CTX_HELP = ("tokens of KV cache, shared by all conversations (default: what fits in free memory, "
            "up to the model's trained context)")
THREADS_HELP = ("CPU threads, fixed (default: chosen for each step from the machine's load, "
                "up to the physical cores)")


def _red(text: str) -> str:
    if sys.stderr.isatty() and not os.environ.get("NO_COLOR"):
        return f"\x1b[31m{text}\x1b[0m"
    return text


def _fail(message: str, code: int) -> int:
    print(_red(f"localllm: error: {message}"), file=sys.stderr)
    return code


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one red line (exit 2), not a usage dump."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be {minimum} or more")
        return value

    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must list whole numbers of 1 or more, like 1,4,8")
    return values


def _size(text: str) -> int:
    from localllm.engine.prefix_store import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_prefix_cache(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-cache-size", type=_size, default=None, metavar="SIZE",
                   help="disk space for the KV of long prompts, kept across restarts "
                        "(default 2GiB; 0 turns it off; `localllm cache` shows it)")


def _add_runner(p: argparse.ArgumentParser) -> None:
    from localllm.config import RUNNERS

    p.add_argument("--runner", choices=RUNNERS, default="auto",
                   help="what computes the model: llama.cpp, or localllm's own PyTorch models "
                        "(qwen2, llama, gemma3); auto (default): the torch runner on an NVIDIA GPU, or on an "
                        "x86 CPU with AVX2 when its kernels read the file in place; llama.cpp otherwise "
                        "(`localllm doctor` says which)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a .gguf path, an installed name (`localllm ls`) or a catalog alias you pulled")
    p.add_argument("--ctx", type=_positive_int, default=None, help=CTX_HELP)
    p.add_argument("--threads", type=_nonneg_int, default=0, help=THREADS_HELP)
    p.add_argument("--batch-tokens", type=_positive_int, default=None,
                   help="step token budget: larger lowers a long prompt's TTFT, smaller keeps "
                        "other streams' token gaps short (default 256)")
    p.add_argument("--parallel", type=_positive_int, default=None, help="most sequences run at once (default 16)")
    p.add_argument("--gpu-layers", type=int, default=-1, help="layers to offload to a GPU (-1: all that fit, 0: none)")
    _add_runner(p)
    _add_kv_dtype(p)
    _add_no_spec(p)


def _add_kv_dtype(p: argparse.ArgumentParser) -> None:
    from localllm.config import KV_DTYPES

    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="f16",
                   help="how the KV cache stores keys and values: f16 (default), q8_0 (8-bit: "
                        "about twice the tokens in the same memory) or f32")
    p.add_argument("--memory", type=_size, default=None, metavar="SIZE",
                   help="memory the weights and KV cache may take, e.g. 6GiB (default: what is free "
                        "in RAM, or in VRAM when the model runs on a GPU)")


def _add_no_spec(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-spec", action="store_true", help="turn off prompt-lookup speculative decoding")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="localllm", description="Run open-weights language models on your own machine.")
    parser.add_argument("--version", action="version", version=f"localllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser("run", help="complete one prompt and stream it to stdout")
    _add_engine_args(run)
    run.add_argument("prompt", help="the prompt text, or - to read it from standard input")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--system", default=None, help="system message (with --chat)")
    run.add_argument("--max-tokens", type=_positive_int, default=256)
    run.add_argument("--temperature", type=_number, default=0.8)
    run.add_argument("--top-p", type=_number, default=1.0)
    run.add_argument("--top-k", type=_nonneg_int, default=0)
    run.add_argument("--min-p", type=_number, default=0.0)
    run.add_argument("--repeat-penalty", type=_number, default=1.0)
    run.add_argument("--seed", type=_nonneg_int, default=None)
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    _add_prefix_cache(run)

    serve = sub.add_parser("serve", help="serve an OpenAI-compatible API on 127.0.0.1")
    serve.add_argument("--model", dest="model", action="append", default=[],
                       help="load this model at start and keep it loaded (repeatable): a .gguf path, an installed "
                            "name (`localllm ls`) or a catalog alias you pulled; every installed model is served "
                            "either way, the others loaded on the first request that names them")
    serve.add_argument("--upstream", action="append", default=[], metavar="NAME=URL",
                       help="serve model NAME from another OpenAI-compatible server at URL (e.g. "
                            "big=http://gpu-box:8000/v1; repeatable; more in upstreams.toml of the config folder)")
    serve.add_argument("--keep-alive", default="5m", metavar="DURATION",
                       help="how long a model stays loaded after its last request (default 5m; 0: unload at once; "
                            "-1: never); a request's own keep_alive wins")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=_int_at_least(0), default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health")
    serve.add_argument("--cors-origin", action="append", default=[],
                       help="allow browser calls from ORIGIN (repeatable; default: none, CORS off)")
    serve.add_argument("--read-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="cut off a client that takes longer to send a request's headers, or its body (default 30)")
    serve.add_argument("--max-queue", type=_int_at_least(0), default=64,
                       help="requests that may wait beyond --parallel before new ones get a 503")
    serve.add_argument("--embedding-model", default=None, metavar="MODEL",
                       help="an embedding model (e.g. all-MiniLM-L6-v2 GGUF) served at /v1/embeddings beside --model")
    serve.add_argument("--ctx", type=_positive_int, default=None, help=CTX_HELP)
    serve.add_argument("--threads", type=_nonneg_int, default=0, help=THREADS_HELP)
    serve.add_argument("--batch-tokens", type=_positive_int, default=None, help="step token budget (default 256)")
    serve.add_argument("--parallel", type=_positive_int, default=None, help="most sequences run at once (default 16)")
    serve.add_argument("--gpu-layers", type=int, default=-1, help="layers to offload to a GPU (-1: all, 0: none)")
    _add_runner(serve)
    _add_kv_dtype(serve)
    _add_no_spec(serve)
    _add_prefix_cache(serve)

    for name, text in (("ps", "list the models a running `localllm serve` has loaded"),
                       ("stop", "unload a model from a running `localllm serve`")):
        p = sub.add_parser(name, help=text)
        if name == "stop":
            p.add_argument("name", help="the model's name, as `localllm ps` shows it")
        p.add_argument("--url", default="http://127.0.0.1:8000",
                       help="the server (default http://127.0.0.1:8000; a /v1 at its end is fine)")
        p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
        if name == "ps":
            p.add_argument("--json", action="store_true", help="print the server's JSON")

    chat = sub.add_parser("chat", help="chat in the terminal (a Textual app)",
                          description="Chat in the terminal. Press F1 in the app for every key.")
    chat.add_argument("model", nargs="?", default=None,
                      help="a .gguf path, an installed name or a pulled alias (default: the last "
                           "chat's model); with --endpoint, the server's model name")
    chat.add_argument("--endpoint", default=None,
                      help="talk to this OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1) "
                           "instead of loading the model here")
    chat.add_argument("--api-key", default=None, help="with --endpoint: the server's API key")
    chat.add_argument("--system", default="", help="system prompt for a new chat")
    chat.add_argument("--resume", nargs="?", const="", default=None, metavar="ID",
                      help="continue a saved chat (default: the latest)")
    chat.add_argument("--temperature", type=_number, default=0.8)
    chat.add_argument("--top-p", type=_number, default=0.95)
    chat.add_argument("--max-tokens", type=_positive_int, default=2048)
    chat.add_argument("--ctx", type=_positive_int, default=None, help=CTX_HELP)
    chat.add_argument("--threads", type=_nonneg_int, default=0, help=THREADS_HELP)
    chat.add_argument("--gpu-layers", type=int, default=-1, help="layers to offload to a GPU (-1: all, 0: none)")
    _add_runner(chat)
    _add_kv_dtype(chat)
    _add_no_spec(chat)
    _add_prefix_cache(chat)

    pull = sub.add_parser("pull", help="download a model (alias, hf.co/OWNER/REPO[:QUANT], OWNER/REPO/FILE.gguf) "
                                       "or import a local .gguf")
    pull.add_argument("name", nargs="?", default=None, help="e.g. qwen2.5-coder:0.5b or hf.co/unsloth/Qwen3-4B-GGUF:Q8_0")
    pull.add_argument("--list", action="store_true", help="show the catalog's aliases")
    pull.add_argument("--quiet", action="store_true", help="no progress bar")
    ls = sub.add_parser("ls", help="list installed models")
    ls.add_argument("--json", action="store_true")
    rm = sub.add_parser("rm", help="remove an installed model")
    rm.add_argument("name")
    rm.add_argument("-y", "--yes", action="store_true", help="do not ask")
    show = sub.add_parser("show", help="a model's metadata, chat template and license")
    show.add_argument("name", help="an installed name, a pulled alias or a .gguf path")
    show.add_argument("--json", action="store_true")
    show.add_argument("--template", action="store_true", help="print the chat template")

    bench = sub.add_parser("bench", help="measure the engine, or any OpenAI-compatible server, at several concurrencies")
    _add_engine_args(bench)
    bench.add_argument("--url", default=None,
                       help="benchmark this OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1) instead; "
                            "MODEL is then the model name to request, or - for the server's first")
    bench.add_argument("--api-key", default=None, help="with --url: the server's API key")
    bench.add_argument("--concurrency", type=_int_list, default=[1, 4, 8], help="e.g. 1,4,8")
    bench.add_argument("--prompt-tokens", type=_positive_int, default=128)
    bench.add_argument("--max-tokens", type=_positive_int, default=128)
    bench.add_argument("--json", action="store_true", help="print the results as JSON")

    ev = sub.add_parser("eval", help="what a runner and KV dtype cost on a text: perplexity, top-1 agreement "
                                     "and KL against llama.cpp with its default f16 KV cache")
    ev.add_argument("model", help="a .gguf path, an installed name (`localllm ls`) or a catalog alias you pulled")
    _add_runner(ev)
    _add_kv_dtype(ev)
    ev.add_argument("--text", type=Path, default=None, metavar="FILE",
                    help="a UTF-8 text file to score, 16 to 16,384 tokens (default: a built-in "
                         "public-domain passage of about 3,400 tokens)")
    ev.add_argument("--threads", type=_nonneg_int, default=0, help="CPU threads (default: physical cores)")
    ev.add_argument("--gpu-layers", type=int, default=-1, help="layers to offload to a GPU (-1: all, 0: none)")
    ev.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    cache = sub.add_parser("cache", help="the on-disk prefix cache: ls, stats, clear")
    cache_sub = cache.add_subparsers(dest="cache_command", metavar="ACTION", parser_class=_Parser)
    cache_ls = cache_sub.add_parser("ls", help="list stored prompts, most recently used first")
    cache_ls.add_argument("--json", action="store_true")
    cache_stats = cache_sub.add_parser("stats", help="entries, tokens and bytes, per model")
    cache_stats.add_argument("--json", action="store_true")
    cache_clear = cache_sub.add_parser("clear", help="remove every entry")
    cache_clear.add_argument("-y", "--yes", action="store_true", help="do not ask")

    doctor = sub.add_parser("doctor", help="what this machine and install can run (CPU, RAM, GPUs, llama.cpp, models)")
    doctor.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return parser


def _engine_config(args, model_path: Path | None = None):
    from localllm.config import DEFAULT_BATCH_TOKENS, CacheConfig, EngineConfig, SchedulerConfig

    sched_kwargs = {}
    if args.batch_tokens is not None:
        sched_kwargs["max_num_batched_tokens"] = args.batch_tokens
    elif args.ctx is not None and args.ctx < DEFAULT_BATCH_TOKENS:
        sched_kwargs["max_num_batched_tokens"] = args.ctx  # a small context gets a budget that fits
    if args.parallel is not None:
        sched_kwargs["max_num_seqs"] = args.parallel
    from localllm import paths

    cache_kwargs = {"weights_cache_dir": paths.weights_cache_dir()}
    size = getattr(args, "prefix_cache_size", None)
    if getattr(args, "command", None) != "bench" and size != 0:  # bench measures computing, not the disk
        cache_kwargs["prefix_cache_dir"] = paths.prefix_cache_dir()
        if size is not None:
            cache_kwargs["prefix_cache_size"] = size
    return EngineConfig(
        model_path=model_path if model_path is not None else _model_path(args.model),
        cache=CacheConfig(n_ctx=args.ctx, kv_dtype=args.kv_dtype),
        scheduler=SchedulerConfig(**sched_kwargs),
        n_threads=args.threads,
        n_gpu_layers=args.gpu_layers,
        speculative=not args.no_spec,
        runner=args.runner,
        memory_limit=args.memory,
        **cache_kwargs,
    )


def _catalog():
    from localllm.catalog import Catalog

    # LOCALLLM_CATALOG: a models.toml of one's own instead of the built-in one (tests, mirrors).
    path = os.environ.get("LOCALLLM_CATALOG")
    return Catalog.load(Path(path) if path else None)


def _model_path(name: str) -> Path:
    from localllm.commands.models import open_store, resolve

    return resolve(name, open_store(), _catalog())


def cmd_pull(args) -> int:
    from localllm.commands.models import list_catalog, pull

    if args.list:
        return list_catalog(_catalog())
    if not args.name:
        raise UsageError("name a model to pull, e.g. `localllm pull qwen2.5-coder:0.5b` (--list shows the catalog)")
    return pull(args.name, _catalog(), quiet=args.quiet)


def cmd_ls(args) -> int:
    from localllm.commands.models import ls

    return ls(as_json=args.json)


def cmd_rm(args) -> int:
    from localllm.commands.models import rm

    return rm(args.name, yes=args.yes)


def cmd_show(args) -> int:
    from localllm.commands.models import show

    return show(args.name, _catalog(), as_json=args.json, template=args.template)


def _read_stdin() -> str:
    """Standard input as UTF-8 whatever the locale says; bad bytes are a usage error."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # stdin replaced by a text stream (tests, embedding)
        return sys.stdin.read()
    data = stream.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"standard input is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "send the prompt as UTF-8"
        ) from None


def cmd_run(args) -> int:
    from localllm.commands.run import run
    from localllm.engine.request import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repeat_penalty,
        seed=args.seed, stop=tuple(args.stop),
    )
    prompt = _read_stdin() if args.prompt == "-" else args.prompt
    return run(_engine_config(args), prompt, params, chat=args.chat, system=args.system, as_json=args.json)


def cmd_bench(args) -> int:
    from localllm.commands.bench import bench

    if args.url:
        from localllm.commands.bench import bench_url

        model = None if args.model == "-" else args.model
        return bench_url(args.url, model, args.concurrency, args.prompt_tokens, args.max_tokens,
                         api_key=args.api_key, as_json=args.json)
    return bench(_engine_config(args), args.concurrency, args.prompt_tokens, args.max_tokens, as_json=args.json)


def cmd_eval(args) -> int:
    from localllm.commands.eval import context_for, evaluate, read_text, tokenize
    from localllm.evaluation import CHUNK

    text_name, text = read_text(args.text)
    model_path = _model_path(args.model)
    token_ids = tokenize(model_path, text, text_name)
    # One sequence holding the whole text, one chunk per step, nothing read from or written
    # to the on-disk prefix cache; no drafting (the runners are driven directly).
    args.ctx, args.batch_tokens, args.parallel = context_for(len(token_ids)), CHUNK, 1
    args.prefix_cache_size, args.no_spec = 0, True
    return evaluate(_engine_config(args, model_path), token_ids, text_name, as_json=args.json)


def cmd_chat(args) -> int:
    from localllm.commands.chat import chat
    from localllm.tui.backend import GenerationSettings

    settings = GenerationSettings(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    engine_config = None
    if args.endpoint is None:
        args.batch_tokens = args.parallel = None
        engine_config = _engine_config(args, model_path=Path("-"))  # the chat command picks the model
    return chat(engine_config, args.model, endpoint=args.endpoint, api_key=args.api_key, system=args.system,
                resume=args.resume, settings=settings, catalog=_catalog())


def cmd_serve(args) -> int:
    from localllm.commands.serve import serve
    from localllm.config import ServerConfig
    from localllm.manager import parse_keep_alive

    parse_keep_alive(args.keep_alive)  # a bad one is a usage error now, not at the first request
    server_config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                                 cors_origins=tuple(args.cors_origin), max_queue=args.max_queue,
                                 read_timeout_s=args.read_timeout,
                                 embedding_model=_model_path(args.embedding_model) if args.embedding_model else None)
    from localllm import paths
    from localllm.server.upstream import load_upstreams, parse_upstream

    pinned = [_model_path(name) for name in args.model]
    upstreams = {u.name: u for u in load_upstreams(paths.config_dir() / "upstreams.toml")}
    upstreams |= {u.name: u for u in map(parse_upstream, args.upstream)}  # the command line wins
    config = _engine_config(args, pinned[0] if pinned else Path("."))
    return serve(config, server_config, pinned, args.keep_alive, list(upstreams.values()))


def cmd_ps(args) -> int:
    from localllm.commands.running import ps

    return ps(args.url, args.api_key, as_json=args.json)


def cmd_stop(args) -> int:
    from localllm.commands.running import stop

    return stop(args.url, args.api_key, args.name)


def cmd_cache(args) -> int:
    from localllm.commands import cache

    if args.cache_command is None:
        raise UsageError("say what to do with the prefix cache: `localllm cache ls`, `stats` or `clear`")
    if args.cache_command == "clear":
        return cache.clear(yes=args.yes)
    return {"ls": cache.ls, "stats": cache.stats}[args.cache_command](as_json=args.json)


def cmd_doctor(args) -> int:
    from localllm.commands.doctor import doctor

    return doctor(as_json=args.json)


LOG_LEVELS = ("debug", "info", "warning", "error")


def _log_to_stderr() -> None:
    """Warnings and notes from below the CLI (a dropped prefix-cache entry, a full disk, a
    runner falling back) as one line each; ``LOCALLLM_LOG=debug`` adds why the engine did
    what it did (each move of the thread count, engine/threads.py)."""
    import logging

    logger = logging.getLogger("localllm")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("localllm: %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        level = os.environ.get("LOCALLLM_LOG", "info").strip().lower() or "info"
        logger.setLevel(level.upper() if level in LOG_LEVELS else logging.INFO)
        if level not in LOG_LEVELS:
            logger.warning("LOCALLLM_LOG=%s is not one of %s; logging at info", level, ", ".join(LOG_LEVELS))


def main(argv: list[str] | None = None) -> int:
    # Model text may hold characters the terminal's encoding lacks: print "?" for them
    # rather than die with UnicodeEncodeError halfway through a completion.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    _log_to_stderr()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        handler = {"run": cmd_run, "bench": cmd_bench, "serve": cmd_serve, "chat": cmd_chat,
                   "pull": cmd_pull, "ls": cmd_ls, "rm": cmd_rm, "show": cmd_show,
                   "cache": cmd_cache, "doctor": cmd_doctor, "eval": cmd_eval,
                   "ps": cmd_ps, "stop": cmd_stop}[args.command]
        return handler(args)
    except LocalLLMError as e:
        return _fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
