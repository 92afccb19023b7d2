"""The on-disk prefix cache across a full process restart: TTFT of a ~2,000-token prompt.

    python benchmarks/prefix_store_ttft.py [--rounds 3] [--lines 120] [--threads 2]

Per round a new prompt (a Python module of --lines functions and a question) and a fresh
LOCALLLM_HOME; three `localllm run --json` processes, one after another:

  off   --prefix-cache-size 0: nothing is stored (the plain cold figure)
  cold  the cache on and empty: computes the prompt and stores it
  warm  a new process on the same cache: loads the prompt from disk, computes its last token

TTFT is each process's own (request arrival to first token; model loading is not in it).
The greedy answers (64 tokens) of the three must be identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import machine, median, model_path


def prompt_text(round_no: int, lines: int) -> str:
    body = "".join(f"def scale_{round_no}_{i}(x):\n    return x * {i} + {i * i + round_no}\n\n"
                   for i in range(lines))
    return body + "# Write a function that applies every scale above in turn:\n"


def run(model: Path, home: Path, text: str, threads: int, *extra: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "localllm.cli", "run", str(model), "-", "--json", "--temperature", "0",
         "--max-tokens", "64", "--threads", str(threads), *extra],
        input=text, capture_output=True, text=True, env={**os.environ, "LOCALLLM_HOME": str(home)}, timeout=600)
    if r.returncode != 0:
        sys.exit(f"localllm run failed ({r.returncode}):\n{r.stderr}")
    return json.loads(r.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lines", type=int, default=89)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = model_path()
    print(f"{machine()}, {args.threads} threads, {model.name}")
    offs, colds, warms = [], [], []
    for r in range(args.rounds):
        text = prompt_text(r, args.lines)
        with tempfile.TemporaryDirectory() as tmp:
            off = run(model, Path(tmp) / "off", text, args.threads, "--prefix-cache-size", "0")
            cold = run(model, Path(tmp) / "on", text, args.threads)
            warm = run(model, Path(tmp) / "on", text, args.threads)
            entries = list((Path(tmp) / "on" / "cache" / "prefix" / "entries").glob("*.kv"))
            size = sum(p.stat().st_size for p in entries)
        same = off["text"] == cold["text"] == warm["text"]
        t_off, t_cold, t_warm = (x["timings"]["ttft_s"] for x in (off, cold, warm))
        offs.append(t_off)
        colds.append(t_cold)
        warms.append(t_warm)
        print(f"round {r + 1}: prompt {cold['prompt_tokens']} tokens | TTFT off {t_off * 1000:7.1f} ms, "
              f"cold {t_cold * 1000:7.1f} ms, warm {t_warm * 1000:6.1f} ms "
              f"({warm['cached_tokens']} cached, {warm['disk_cached_tokens']} from disk; "
              f"entry {size / 1e6:.1f} MB) | cold/warm {t_cold / t_warm:6.1f}x | answers identical: {same}",
              flush=True)
        if not same:
            print(f"  off:  {off['text']!r}\n  cold: {cold['text']!r}\n  warm: {warm['text']!r}")
    print(f"median TTFT: off {median(offs) * 1000:.0f} ms, cold {median(colds) * 1000:.0f} ms, "
          f"warm {median(warms) * 1000:.1f} ms; cold / warm {median(colds) / median(warms):.0f}x, "
          f"off / warm {median(offs) / median(warms):.0f}x")


if __name__ == "__main__":
    main()
