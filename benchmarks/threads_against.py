"""The torch runner at fixed thread counts, this checkout against another one (its own built
kernels: a `git worktree` of an earlier commit with `setup.py build_ext --inplace` run there),
with 0 to 3 busy processes beside it: what a change to the kernels' threads does under load,
the thread chooser aside.

Each contestant is its own process (two checkouts cannot share one), run in turn under the same
load: decode tokens/s and prefill tokens/s as busy_machine.py measures them (Qwen2.5-Coder-0.5B,
drafting off), medians of --rounds after an unmeasured one; each pair of processes --repeats
times.

    python benchmarks/threads_against.py --against /tmp/old-checkout [--loads 0,1,2,3] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _common import machine, median
from busy_machine import Load

HERE = Path(__file__).resolve().parent

CHILD = """
import json, sys
sys.path[:0] = [{root!r}, {root!r} + "/benchmarks"]
from busy_machine import Localllm, prefill_prompt
from _common import model_path
out = {{}}
contestants = [Localllm(model_path(), "torch", n) for n in {counts!r}]
for r in range({rounds} + 1):
    for n, c in zip({counts!r}, contestants):
        d = c.decode(48, 3.0)
        p, _ = c.prefill(prefill_prompt(r, 128))
        if r:
            out.setdefault(n, []).append((d, p))
print("RESULT " + json.dumps(out))
"""


def run(root: str, counts: list[int], rounds: int) -> dict[int, list[tuple[float, float]]]:
    code = CHILD.format(root=root, counts=counts, rounds=rounds)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{root}: the run failed:\n{done.stderr[-2000:]}")
    return {int(n): runs for n, runs in json.loads(lines[-1][7:]).items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--against", required=True, help="another checkout, its kernels built in place")
    parser.add_argument("--loads", default="0,1,2,3")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    trees = {"this": str(HERE.parent), "against": str(Path(args.against).resolve())}
    table: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    for load in [int(x) for x in args.loads.split(",")]:
        with Load(load, 3600):
            for _ in range(args.repeats):
                for name, root in trees.items():
                    for n, runs in run(root, counts, args.rounds).items():
                        table.setdefault((load, name, n), []).extend(runs)
                        print(f"load {load}: {name:7s} --threads {n}: decode "
                              f"{[round(d, 1) for d, _ in runs]} prefill {[round(p) for _, p in runs]}", flush=True)
    print(f"\n{machine()}; torch runner, drafting off; this {trees['this']} against {trees['against']}; "
          f"medians of {args.rounds} rounds x {args.repeats}\n")
    print("| busy processes | threads | decode tok/s: against -> this | prefill tok/s: against -> this |")
    print("|---|---|---|---|")
    for load in [int(x) for x in args.loads.split(",")]:
        for n in counts:
            a, t = table[(load, "against", n)], table[(load, "this", n)]
            da, dt = median([d for d, _ in a]), median([d for d, _ in t])
            pa, pt = median([p for _, p in a]), median([p for _, p in t])
            print(f"| {load} | {n} | {da:.1f} -> {dt:.1f} ({dt / da:.2f}x) | {pa:.0f} -> {pt:.0f} ({pt / pa:.2f}x) |")


if __name__ == "__main__":
    main()
