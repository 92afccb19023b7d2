"""Decode and prefill on a busy machine: localllm's default (threads chosen per step) against
fixed counts and llama-cpp-python, with 0, 1, 2 and 3 busy processes beside it.

    python benchmarks/busy_machine.py [--rounds 2] [--loads 0,1,2,3] [--runners llamacpp,torch]
    python benchmarks/busy_machine.py --serve [--rounds 2] [--loads 0,2]

Each busy process is a Python loop that ends by itself after the load level's time (and is
killed when the level ends). At each level every contestant first runs one unmeasured round
(the default's chooser meets the new load there, as it would the first seconds of a load
that comes), then ``--rounds`` measured rounds, contestants alternating (A B C ... A B C).

- decode tokens/s: a greedy continuation of a fixed prompt, for --decode-tokens tokens or
  --decode-seconds, whichever comes first, timed from the first token to the last;
- prefill tokens/s: a prompt of --prompt-tokens tokens with a fresh head each time (no prefix
  cache hit), one token generated: prompt tokens / time to that token.

Contestants: localllm (each runner) at its default and at every fixed count 1..physical cores;
llama-cpp-python's high-level API at the physical cores (llama-server's and Ollama's default)
and at its own default (half the logical CPUs for decode, all of them for prefill). localllm runs with drafting off, so that what
is measured is the threads alone.

--serve: `localllm serve` processes (default and fixed counts), 4 streaming clients at once
(`localllm bench --url`'s scenario): aggregate output tokens/s and TPOT p95.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time

from _common import llama_without_amx, machine, median, model_path

from localllm.config import CacheConfig, EngineConfig, physical_cores
from localllm.engine.engine import LLMEngine
from localllm.engine.request import SamplingParams

DECODE_PROMPT = "# A small library of sorting algorithms in Python\n\ndef quicksort(arr):\n"
FILLER = ("the engine schedules requests in steps and each step computes a batch of tokens for the "
          "sequences that are running while the cache keeps their keys and values in blocks ").split()


def busy(seconds: float) -> subprocess.Popen:
    """A process that keeps one CPU busy for ``seconds``, then ends by itself."""
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


class Load:
    def __init__(self, n: int, seconds: float):
        self.procs = [busy(seconds) for _ in range(n)]

    def __enter__(self):
        time.sleep(0.5 if self.procs else 0)  # let the scheduler spread them
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def prefill_prompt(i: int, n: int) -> str:
    return f"Request {time.time_ns() % 1_000_000_007}-{i}: " + " ".join(FILLER[j % len(FILLER)] for j in range(n))


class Localllm:
    def __init__(self, path, runner: str, threads: int):
        self.name = f"localllm {runner} " + (f"--threads {threads}" if threads else "default")
        self.engine = LLMEngine(EngineConfig(model_path=path, cache=CacheConfig(n_ctx=4096), n_threads=threads,
                                             runner=runner, speculative=False))

    def decode(self, max_tokens: int, seconds: float) -> float:
        e = self.engine
        seq = e.add_request(DECODE_PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        times = []
        deadline = None
        while e.has_unfinished:
            for o in e.step():
                if o.request_id == seq.request_id and o.token_ids:
                    times.append(time.perf_counter())
                    deadline = deadline or times[0] + seconds
            if deadline and times[-1] > deadline:
                e.abort(seq.request_id)
        e.block_manager.reset_prefix_cache()
        return (len(times) - 1) / (times[-1] - times[0])

    def prefill(self, prompt: str) -> tuple[float, int]:
        e = self.engine
        ids = e.tokenizer.encode(prompt)
        t0 = time.perf_counter()
        e.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))
        return len(ids) / (time.perf_counter() - t0), len(ids)

    def threads(self) -> str:
        """decode/prefill counts in use now, and the chooser's probes and moves so far."""
        s, chooser = self.engine.stats(), self.engine.threads
        if not s.threads_max:
            return "-"
        (dp, dm), (pp, pm) = chooser.counters("decode"), chooser.counters("prefill")
        return f"{s.threads_decode}/{s.threads_prefill} (probes {dp}/{pp}, moves {dm}/{pm})"


class LlamaCppPython:
    def __init__(self, path, threads: int | None):
        llama_without_amx()
        from llama_cpp import Llama

        # Its defaults: half the logical CPUs for decode, all of them for batches (prefill).
        self.name = ("llama-cpp-python " + (f"n_threads={threads}" if threads else
                     f"default ({max(os.cpu_count() // 2, 1)}, batch {os.cpu_count()})"))
        kw = {"n_threads": threads, "n_threads_batch": threads} if threads else {}
        self.llm = Llama(model_path=str(path), n_ctx=4096, n_batch=256, verbose=False, **kw)

    def decode(self, max_tokens: int, seconds: float) -> float:
        times = []
        for chunk in self.llm.create_completion(DECODE_PROMPT, max_tokens=max_tokens, temperature=0.0, stream=True):
            if chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
                if times[-1] - times[0] > seconds:
                    break
        self.llm.reset()
        return (len(times) - 1) / (times[-1] - times[0])

    def prefill(self, prompt: str) -> tuple[float, int]:
        n = len(self.llm.tokenize(prompt.encode()))
        t0 = time.perf_counter()
        self.llm.create_completion(prompt, max_tokens=1, temperature=0.0)
        return n / (time.perf_counter() - t0), n

    def threads(self) -> str:
        return "-"


def engines(args, cores: int) -> list:
    path = model_path()
    out = []
    for runner in args.runners.split(","):
        out.append(Localllm(path, runner, 0))
        out += [Localllm(path, runner, n) for n in range(1, cores + 1)]
    out.append(LlamaCppPython(path, cores))
    out.append(LlamaCppPython(path, None))
    return out


def in_process(args) -> None:
    cores = physical_cores()
    contestants = engines(args, cores)
    loads = [int(x) for x in args.loads.split(",")]
    per_round = len(contestants) * (args.decode_seconds + 6)
    table = {}
    for load in loads:
        with Load(load, per_round * (args.rounds + 1) + 60):
            for r in range(args.rounds + 1):
                for c in contestants:
                    d = c.decode(args.decode_tokens, args.decode_seconds)
                    p, n = c.prefill(prefill_prompt(r, args.prompt_tokens))
                    if r == 0:
                        continue  # the unmeasured round
                    table.setdefault((load, c.name), []).append((d, p))
                    print(f"load {load} round {r}: {c.name:40s} decode {d:6.1f} tok/s  prefill {p:7.1f} tok/s "
                          f"({n} tokens)  threads now {c.threads()}", flush=True)
    print(f"\n{machine()}; {cores} physical cores; localllm drafting off; decode up to {args.decode_tokens} "
          f"tokens or {args.decode_seconds} s, prefill {args.prompt_tokens} words; medians of {args.rounds} rounds\n")
    print("| busy processes | contestant | decode tok/s | prefill tok/s |")
    print("|---|---|---|---|")
    for (load, name), runs in table.items():
        print(f"| {load} | {name} | {median([d for d, _ in runs]):.1f} | {median([p for _, p in runs]):.0f} |")
    print()
    for runner in args.runners.split(","):
        for load in loads:
            def med(name, i):
                return median([x[i] for x in table[(load, name)]])
            ours = f"localllm {runner} default"
            fixed = [f"localllm {runner} --threads {n}" for n in range(1, cores + 1)]
            lcp_cores = f"llama-cpp-python n_threads={cores}"
            lcp_default = [n for (ld, n) in table if ld == load and n.startswith("llama-cpp-python default")][0]
            for i, what in ((0, "decode"), (1, "prefill")):
                best = max(fixed, key=lambda n: med(n, i))
                # The same ratio round by round (the two ran seconds apart, under the host's
                # load of that moment), its median: the host's slow drifts cancel.
                paired = median([a[i] / b[i] for a, b in zip(table[(load, ours)], table[(load, best)])])
                print(f"{runner} load {load} {what}: default/best fixed ({best.split()[-1]}) "
                      f"{med(ours, i) / med(best, i):.2f}x (paired by round {paired:.2f}x), "
                      f"default/fixed {cores} (today's) "
                      f"{med(ours, i) / med(fixed[-1], i):.2f}x, default/llama.cpp at {cores} "
                      f"{med(ours, i) / med(lcp_cores, i):.2f}x, default/llama-cpp-python's default "
                      f"{med(ours, i) / med(lcp_default, i):.2f}x")


def serve(args) -> None:
    from localllm.commands.bench import bench_url

    cores = physical_cores()
    path = str(model_path())
    servers = {}

    from serve_vs_llama_cpp_server import free_port, start

    for threads in [0] + list(range(1, cores + 1)):
        port = free_port()
        servers[threads] = (port, start([sys.executable, "-m", "localllm.cli", "serve", "--model", path,
                                         "--port", str(port), "--threads", str(threads), "--ctx", "4096",
                                         "--no-spec", "--prefix-cache-size", "0",
                                         "--runner", args.runners.split(",")[0]], port))

    def run(p: int) -> dict:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            bench_url(f"http://127.0.0.1:{p}/v1", None, [4], args.prompt_tokens, args.serve_tokens, as_json=True)
        return json.loads(buf.getvalue())["results"][0]

    table = {}
    try:
        for load in [int(x) for x in args.loads.split(",")]:
            with Load(load, 3600):
                for r in range(args.rounds + 1):
                    for threads, (p, _) in servers.items():
                        x = run(p)
                        if r == 0:
                            continue
                        table.setdefault((load, threads), []).append(x)
                        print(f"load {load} round {r}: --threads {threads or 'default'}: "
                              f"{x['output_tokens_per_s']:6.1f} tok/s, TPOT p95 {x['tpot_p95_s'] * 1000:6.1f} ms",
                              flush=True)
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    print(f"\n{machine()}; {cores} physical cores; localllm serve --no-spec, runner "
          f"{args.runners.split(',')[0]}; 4 streaming clients, {args.prompt_tokens}-word prompts, "
          f"{args.serve_tokens} tokens each; medians of {args.rounds} rounds\n")
    print("| busy processes | localllm serve | aggregate output tok/s | TPOT p95 ms |")
    print("|---|---|---|---|")
    for (load, threads), runs in table.items():
        print(f"| {load} | {'default' if not threads else f'--threads {threads}'} | "
              f"{median([x['output_tokens_per_s'] for x in runs]):.1f} | "
              f"{median([x['tpot_p95_s'] for x in runs]) * 1000:.0f} |")
    print()
    for load in sorted({load for load, _ in table}):
        def rate(threads):
            return [x["output_tokens_per_s"] for x in table[(load, threads)]]
        best = max(range(1, cores + 1), key=lambda n: median(rate(n)))
        paired = median([a / b for a, b in zip(rate(0), rate(best))])
        print(f"load {load}: default/best fixed ({best}) {median(rate(0)) / median(rate(best)):.2f}x "
              f"(paired by round {paired:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--loads", default="0,1,2,3", help="busy processes at each level")
    parser.add_argument("--runners", default="llamacpp,torch")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--decode-seconds", type=float, default=5.0)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--serve", action="store_true", help="through localllm serve, 4 streaming clients")
    parser.add_argument("--serve-tokens", type=int, default=48)
    args = parser.parse_args()
    if args.serve:
        serve(args)
    else:
        in_process(args)


if __name__ == "__main__":
    main()
