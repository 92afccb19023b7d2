"""What it costs to serve several models from one port (server/models.py, localllm/manager.py).

1. The swap cost, through a real `localllm serve` with both test models installed and no
   --model: time to first token (streamed completions, 1 token)
   - of a short prompt (~20 tokens) to a model not loaded (its load + the prefill) and to the
     model loaded (the prefill alone): what a swap costs;
   - of a ~1,700-token prompt to a model not loaded, and to the model after `localllm stop`
     (an unload) repeating that prompt: its load + the prompt from the on-disk prefix cache.
   Median of --rounds rounds, each with prompts of its own.

2. Two models at once: both pinned, one stream to each (128 tokens, greedy), alone and then both
   together; each one's decode tokens/s, their engines stepping freely (each with its
   ThreadChooser). The same in-process: stepping freely against steps taking turns under one
   lock (A B, alternating the order each round).

3. Load/unload cycles in-process, through the server's own Loader and a ModelManager: each
   cycle leases the model with keep_alive 0 (a load, one token, an unload); RSS (after
   malloc_trim), open file descriptors and threads after the first cycle and after the last.

    python benchmarks/model_swap.py [--rounds 3] [--cycles 200] [--threads 2] [--skip-swap] [--skip-pair]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import httpx  # noqa: E402
from _common import machine, median, model_path  # noqa: E402

MODELS = ("qwen2.5-coder-0.5b", "gemma3-270m")
CTX = 4096


def prompt_text(tag: str) -> str:
    """About 1,500 tokens of code that begins with ``tag``: no prompt shares a prefix with another."""
    return f"# {tag}\n" + "".join(f"def scale_{tag}_{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(75))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(home: Path, threads: int, *args: str) -> tuple[subprocess.Popen, httpx.Client]:
    """`localllm serve` over the models installed in ``home`` (its log in home/serve.log), once
    it answers /health."""
    port = free_port()
    with open(home / "serve.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "localllm.cli", "serve", "--port", str(port), "--ctx",
                                   str(CTX), *args, *(["--threads", str(threads)] if threads else [])],
                                  env=os.environ | {"LOCALLLM_HOME": str(home)}, stdout=log, stderr=subprocess.STDOUT)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    for _ in range(240):
        try:
            if http.get("/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.25)
    return server, http


def ttft(http: httpx.Client, model: str, prompt: str) -> float:
    start = time.perf_counter()
    with http.stream("POST", "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                      "temperature": 0, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                break
    return time.perf_counter() - start


def swap_cost(rounds: int, threads: int) -> None:
    home = Path(tempfile.mkdtemp(prefix="localllm-swap-"))
    env = os.environ | {"LOCALLLM_HOME": str(home)}
    names = []
    for name in MODELS:
        path = model_path(name)
        subprocess.run([sys.executable, "-m", "localllm.cli", "pull", str(path)], env=env, check=True,
                       capture_output=True)
        names.append(path.stem)
    server, http = start_serve(home, threads, "--keep-alive", "-1")
    try:
        arms = ("short, not loaded", "short, loaded", "long, not loaded", "long, after an unload")
        figures = {name: {arm: [] for arm in arms} for name in names}

        def unload_all():
            for other in names:
                http.post("/api/stop", json={"model": other})

        for r in range(rounds):
            for name in names:
                f = figures[name]
                unload_all()
                f["short, not loaded"].append(ttft(http, name, f"# round {r}a\ndef add(a, b):"))
                f["short, loaded"].append(ttft(http, name, f"# round {r}b\ndef add(a, b):"))
                unload_all()
                long = prompt_text(f"{r}")
                f["long, not loaded"].append(ttft(http, name, long))
                time.sleep(0.5)  # the prefix cache writes its entries after the request
                unload_all()
                f["long, after an unload"].append(ttft(http, name, long))
        for name in names:
            f = {k: median(v) for k, v in figures[name].items()}
            print(f"{name}: TTFT of a short prompt — not loaded {f['short, not loaded']:.2f} s, loaded "
                  f"{f['short, loaded']:.2f} s (a swap costs {f['short, not loaded'] - f['short, loaded']:.2f} s); "
                  f"of a ~1,700-token prompt — not loaded {f['long, not loaded']:.2f} s, after an unload with the "
                  f"prefix cache warm {f['long, after an unload']:.2f} s "
                  f"({f['long, not loaded'] / f['long, after an unload']:.1f}x; medians of {rounds})")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


def decode_rate(http: httpx.Client, model: str, tag: str) -> float:
    """Tokens/s after the first token of one greedy 128-token stream."""
    first = None
    tokens = 0
    with http.stream("POST", "/v1/completions", json={"model": model, "prompt": f"# {tag}\n1, 2, 3, 4,",
                                                      "max_tokens": 128, "temperature": 0, "stream": True,
                                                      "speculative": False}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                tokens += 1
                first = first or time.perf_counter()
    return (tokens - 1) / (time.perf_counter() - first)


def pair(rounds: int, threads: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    paths = [model_path(name) for name in MODELS]
    home = Path(tempfile.mkdtemp(prefix="localllm-pair-"))
    server, http = start_serve(home, threads, *(a for p in paths for a in ("--model", str(p))))
    try:
        names = [p.stem for p in paths]
        alone = {name: [] for name in names}
        together = {name: [] for name in names}
        for r in range(rounds):
            for name in names:
                alone[name].append(decode_rate(http, name, f"alone {r}"))
            with ThreadPoolExecutor(2) as pool:
                rates = list(pool.map(lambda n: decode_rate(http, n, f"pair {r}"), names))
            for name, rate in zip(names, rates):
                together[name].append(rate)
        for name in names:
            a, t = median(alone[name]), median(together[name])
            print(f"{name}: decode alone {a:.1f} tokens/s, beside the other model's stream {t:.1f} tokens/s "
                  f"({t / a:.2f}x; medians of {rounds})")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


class TurnLock:
    """A lock handed over in the order it was asked for (a threading.Lock lets the thread that
    released it take it again at once): two engines' steps under it alternate."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: collections.deque = collections.deque()
        self._held = False

    def __enter__(self) -> "TurnLock":
        me = object()
        with self._cond:
            self._waiting.append(me)
            while self._held or self._waiting[0] is not me:
                self._cond.wait()
            self._waiting.popleft()
            self._held = True
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()


def pair_locks(rounds: int, threads: int) -> None:
    """Two models streaming at once in-process: each engine stepping whenever it likes, as
    `serve` runs them, against their steps taking turns under one TurnLock (both with the
    machine's threads and their ThreadChoosers)."""
    from localllm.config import CacheConfig, EngineConfig
    from localllm.engine.engine import AsyncEngine, LLMEngine
    from localllm.engine.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=128, speculative=False)
    names = [model_path(name).stem for name in MODELS]
    engines = [LLMEngine(EngineConfig(model_path=model_path(name), cache=CacheConfig(n_ctx=1024), n_threads=threads))
               for name in MODELS]

    async def rate(engine: AsyncEngine, tag: str) -> float:
        first, tokens = None, 0
        async for out in engine.generate(f"# {tag}\n1, 2, 3, 4,", params):
            tokens += len(out.token_ids)
            first = first or time.perf_counter()
        return (tokens - 1) / (time.perf_counter() - first)

    async def arm(lock, tag: str, which=(0, 1)) -> list[float]:
        wrapped = [AsyncEngine(engines[i], step_lock=lock) for i in which]
        try:
            return list(await asyncio.gather(*(rate(e, tag) for e in wrapped)))
        finally:
            for e in wrapped:
                e.shutdown()

    figures = {arm_name: {name: [] for name in names} for arm_name in ("alone", "turns", "free")}
    for r in range(rounds):
        for i, name in enumerate(names):
            figures["alone"][name] += asyncio.run(arm(None, f"alone {r}", (i,)))
        order = ("turns", "free") if r % 2 == 0 else ("free", "turns")
        for arm_name in order:
            rates = asyncio.run(arm(TurnLock() if arm_name == "turns" else None, f"{arm_name} {r}"))
            for name, value in zip(names, rates):
                figures[arm_name][name].append(value)
    for name in names:
        f = {k: median(v[name]) for k, v in figures.items()}
        print(f"{name} in-process: alone {f['alone']:.1f} tokens/s; beside the other's stream, steps taking turns "
              f"{f['turns']:.1f}, stepping freely {f['free']:.1f} (medians of {rounds})")
    total = {k: sum(median(v[name]) for name in names) for k, v in figures.items() if k != "alone"}
    print(f"both streams together: turns {total['turns']:.1f} tokens/s, free {total['free']:.1f} tokens/s")
    for engine in engines:
        engine.close()


def trimmed_rss() -> int:
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cycles(n: int, threads: int) -> None:
    from localllm.config import CacheConfig, EngineConfig, ServerConfig
    from localllm.engine.request import SamplingParams
    from localllm.manager import ModelEntry, ModelManager
    from localllm.server.metrics import ServerMetrics
    from localllm.server.models import Loader

    path = model_path(MODELS[0])
    entry = ModelEntry(path.stem, path)
    loader = Loader(EngineConfig(model_path=path, cache=CacheConfig(n_ctx=1024), n_threads=threads),
                    ServerConfig(), ServerMetrics())

    async def main():
        manager = ModelManager([entry], loader.load, loader.need_bytes, loader.free_bytes)
        loader.manager = manager
        marks = {}
        start = time.perf_counter()
        for cycle in range(n):
            async with manager.lease(entry.name, keep_alive=0) as model:
                async for _ in model.server.engine.generate("def f(x):", SamplingParams(temperature=0, max_tokens=1)):
                    pass
            if cycle in (0, n - 1):
                marks[cycle] = (trimmed_rss(), len(os.listdir("/proc/self/fd")),
                                sorted(t.name for t in threading.enumerate() if not t.name.startswith("asyncio")))
        await manager.close()
        return marks, time.perf_counter() - start, manager.status()[0]

    marks, seconds, status = asyncio.run(main())
    (rss0, fd0, th0), (rss1, fd1, th1) = marks[0], marks[n - 1]
    print(f"{n} load/unload cycles of {entry.name} ({seconds / n:.2f} s each, {status.num_loads} loads, "
          f"{status.num_unloads} unloads): RSS after the first {rss0 / 2**20:.0f} MiB, after the last "
          f"{rss1 / 2**20:.0f} MiB ({(rss1 - rss0) / rss0 * 100:+.1f} %); open files {fd0} -> {fd1}; "
          f"threads {len(th0)} -> {len(th1)}{'' if th0 == th1 else f' ({th0} -> {th1})'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--threads", type=int, default=0, help="0: the machine's (the default)")
    parser.add_argument("--skip-swap", action="store_true")
    parser.add_argument("--skip-pair", action="store_true")
    args = parser.parse_args()
    print(machine())
    if not args.skip_swap:
        swap_cost(args.rounds, args.threads)
    if not args.skip_pair:
        pair(args.rounds, args.threads)
        pair_locks(args.rounds, args.threads)
    if args.cycles:
        cycles(args.cycles, args.threads)


if __name__ == "__main__":
    main()
