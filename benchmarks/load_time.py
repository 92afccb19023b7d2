"""How long a model takes to load, per runner: the first load of a file (no weight cache of
localllm's own, the file's pages dropped from the page cache where the machine lets us) and a
later one, each in a fresh process, and `localllm run` to its first 8 tokens end to end.

    python benchmarks/load_time.py [--models qwen2.5-coder-0.5b,gemma3-270m] [--rounds 5] [--threads 2]

Each figure is a new Python process that imports localllm and builds an LLMEngine (the runner,
its vocabulary, the KV pool): what `localllm serve` or `chat` waits for before its first request.
Runners alternate within each round. `--runner auto` is whichever of the two choose_runner
gives on this CPU (printed). Medians of the rounds, and each runner's ratio to llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, median, model_path

LOAD = """
import json, sys, time
t0 = time.perf_counter()
from localllm.config import CacheConfig, EngineConfig
from localllm.engine.engine import LLMEngine
e = LLMEngine(EngineConfig(model_path=sys.argv[1], runner=sys.argv[2], n_threads=int(sys.argv[3]),
                           cache=CacheConfig(n_ctx=4096)))
t1 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "runner": e.runner.name,
                  "in_place": getattr(e.runner, "weights_in_place", None)}))
e.close()
"""


def drop_page_cache(path: Path) -> bool:
    """Ask the kernel to forget the file's pages (posix_fadvise DONTNEED); True where it could."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)


def load_once(path: Path, runner: str, threads: int, home: Path) -> dict:
    env = {**os.environ, "LOCALLLM_HOME": str(home)}
    out = subprocess.run([sys.executable, "-c", LOAD, str(path), runner, str(threads)],
                         capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_once(path: Path, runner: str, threads: int, home: Path) -> float:
    env = {**os.environ, "LOCALLLM_HOME": str(home)}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "localllm.cli", "run", str(path), "Say hi.", "--runner", runner,
                          "--max-tokens", "8", "--threads", str(threads), "--ctx", "4096"],
                         capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen2.5-coder-0.5b,gemma3-270m")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"# {machine()}; {args.threads} threads; medians of {args.rounds} rounds")
    for name in args.models.split(","):
        path = model_path(name)
        auto = load_once(path, "auto", args.threads, Path(tempfile.mkdtemp()))
        print(f"\n## {name} ({path.stat().st_size / 1e6:.0f} MB): --runner auto gives {auto['runner']}")
        figures: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for runner in ("llamacpp", "torch"):
                home = Path(tempfile.mkdtemp())  # no weight cache, no prefix cache
                dropped = drop_page_cache(path)
                first = load_once(path, runner, args.threads, home)
                later = load_once(path, runner, args.threads, home)
                figures.setdefault((runner, "first"), []).append(first["load_s"])
                figures.setdefault((runner, "later"), []).append(later["load_s"])
                figures.setdefault((runner, "run"), []).append(run_once(path, runner, args.threads, home))
                figures.setdefault((runner, "dropped"), []).append(float(dropped))
                if runner == "torch":
                    figures.setdefault((runner, "in_place"), []).append(float(bool(first["in_place"])))
        print("| runner | first load | later load | `localllm run`, 8 tokens |")
        print("|---|---|---|---|")
        base = {k: median(figures[("llamacpp", k)]) for k in ("first", "later", "run")}
        for runner in ("llamacpp", "torch"):
            cells = []
            for kind in ("first", "later", "run"):
                m = median(figures[(runner, kind)])
                cells.append(f"{m:.2f} s" + ("" if runner == "llamacpp" else f" ({m / base[kind]:.2f}x)"))
            print(f"| {runner} | " + " | ".join(cells) + " |")
        print(f"(page cache dropped before first loads: {all(figures[('llamacpp', 'dropped')])}; "
              f"torch read every weight in place: {all(figures.get(('torch', 'in_place'), [0]))})")


if __name__ == "__main__":
    main()
