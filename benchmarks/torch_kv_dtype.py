"""The torch runner's KV dtypes side by side: the pool's bytes and single-stream decode speed.

    python benchmarks/torch_kv_dtype.py [--model qwen2.5-coder-0.5b | --file F.gguf] [--dtypes f16,q8_0]
        [--ctx 4096] [--prompt-tokens 64] [--rounds 3] [--threads 2]

One engine per dtype (same file, context, threads, weights); per round, alternating them:
decode tokens/s of one stream (a --prompt-tokens prompt, 32 tokens, greedy, no drafting).
Prints each pool's measured bytes (KVPool.nbytes), and the medians of the rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from _common import machine, median, model_path

from localllm import paths
from localllm.commands.bench import run_concurrency
from localllm.config import CacheConfig, EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.request import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--file", type=Path, help="a GGUF file instead of --model")
    parser.add_argument("--dtypes", default="f16,q8_0")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = args.file or model_path(args.model)
    base = EngineConfig(model_path=path, n_threads=args.threads, speculative=False, runner="torch",
                        weights_cache_dir=paths.weights_cache_dir(), prefix_cache_dir=None)
    engines = {kv: LLMEngine(dataclasses.replace(base, cache=CacheConfig(n_ctx=args.ctx, kv_dtype=kv)))
               for kv in args.dtypes.split(",")}
    for engine in engines.values():
        engine.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    speeds = {kv: [] for kv in engines}
    for r in range(args.rounds):
        for kv, engine in engines.items():
            speeds[kv].append(run_concurrency(engine, 1, args.prompt_tokens, 32)["decode_tokens_per_s"])
            print(f"round {r + 1} {kv:5s} decode 1 stream {speeds[kv][-1]:6.1f} tok/s", flush=True)
    print(f"\n{machine()}; {args.threads} threads; {path.name}; n_ctx {args.ctx}; "
          f"{args.prompt_tokens}-token prompt; medians of {args.rounds} rounds")
    print("| KV dtype | pool bytes | bytes per token | decode, 1 stream (tok/s) |")
    print("|---|---|---|---|")
    for kv, engine in engines.items():
        pool = engine.runner.pool
        print(f"| {kv} | {pool.nbytes:,} | {pool.bytes_per_token:,} | {median(speeds[kv]):.1f} |")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
