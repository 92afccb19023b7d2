"""The on-disk prefix cache's size budget under the real engine: many distinct long prompts.

    python benchmarks/prefix_store_budget.py [--prompts 500] [--tokens 300] [--budget 48MiB]

One engine on the Qwen file with a fresh cache folder and a small --prefix-cache-size; each
prompt is new (so each is stored) and answered with one token. After every prompt the bytes
in the cache folder's entries/ are summed (after the writer has finished) and must never
exceed the budget. At the end: how many entries fit, how many writes and evictions happened,
and that the most recent prompts still load from disk in a new engine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import machine, model_path

from localllm.config import CacheConfig, EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.prefix_store import parse_size
from localllm.engine.request import SamplingParams


def prompt(engine: LLMEngine, k: int, tokens: int) -> list[int]:
    text = "".join(f"record {k}-{i}: value {(k * 7919 + i * 104729) % 1000003}\n" for i in range(tokens // 8))
    return engine.tokenizer.encode(text)[:tokens]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=500)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--budget", default="48MiB")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    budget = parse_size(args.budget)
    print(f"{machine()}, {args.threads} threads, {args.prompts} prompts of {args.tokens} tokens, "
          f"budget {budget / 2**20:.0f} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        store_dir = Path(tmp) / "prefix"
        config = EngineConfig(model_path=model_path(), cache=CacheConfig(n_ctx=1024), n_threads=args.threads,
                              prefix_cache_dir=store_dir, prefix_cache_size=budget)
        engine = LLMEngine(config)
        one = SamplingParams(temperature=0, max_tokens=1)
        peak, start = 0, time.perf_counter()
        for k in range(args.prompts):
            engine.generate([prompt(engine, k, args.tokens)], one)
            engine.prefix_store.flush(60)
            on_disk = sum(p.stat().st_size for p in (store_dir / "entries").iterdir())
            peak = max(peak, on_disk)
            if on_disk > budget:
                raise SystemExit(f"prompt {k}: {on_disk} bytes on disk, over the budget of {budget}")
            if (k + 1) % 50 == 0:
                print(f"{k + 1:4d} prompts: {on_disk / 2**20:5.1f} MiB in "
                      f"{len(engine.prefix_store.index.entries())} entries, "
                      f"{time.perf_counter() - start:.0f} s", flush=True)
        store = engine.prefix_store
        writes, errors, entries = store.num_writes, store.num_write_errors, store.index.entries()
        engine.close()
        engine = LLMEngine(config)  # the newest entries load in a new engine
        loaded = [engine.generate([prompt(engine, k, args.tokens)], one)[0].metrics.num_disk_cached_tokens
                  for k in range(args.prompts - 3, args.prompts)]
        engine.close()
    print(f"writes {writes}, write errors {errors}, entries kept {len(entries)} "
          f"(~{entries[0].size / 2**20:.1f} MiB each), evicted {writes - len(entries)}; "
          f"peak on disk {peak / 2**20:.1f} MiB of {budget / 2**20:.0f} MiB; "
          f"the last 3 prompts in a new engine: {loaded} tokens from disk")


if __name__ == "__main__":
    main()
