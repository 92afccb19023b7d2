"""The 8-bit KV cache against f16, same run, same threads: memory per token and decode speed.

    python benchmarks/kv_dtype.py [--model qwen2.5-coder-0.5b] [--rounds 3] [--threads 2] [--runners llamacpp,torch]

For each runner, an f16 and a q8_0 engine with the same pool of 4,096 tokens. Memory: the
bytes each runner really allocated for its pool (llama.cpp's own report; the torch runner's
tensors), and so the tokens each would hold in the same memory. Speed, per round, alternating
the engines: decode tokens/s of one stream at a short context (64-token prompt, 64 tokens) and
at about 2,000 tokens of context, and of 8 streams (64-token prompts, 32 tokens each); greedy,
no drafting. Medians of the rounds, and each q8_0 engine's ratio to its runner's f16 one.
Perplexity is `localllm eval MODEL --kv-dtype q8_0` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses

from _common import machine, median, model_path

from localllm import paths
from localllm.commands.bench import run_concurrency
from localllm.config import CacheConfig, EngineConfig, SchedulerConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.request import SamplingParams

KV_DTYPES = ("f16", "q8_0")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runners", default="llamacpp", help="comma-separated: llamacpp, torch")
    args = parser.parse_args()
    path = model_path(args.model)
    base = EngineConfig(model_path=path, n_threads=args.threads, speculative=False,
                        weights_cache_dir=paths.weights_cache_dir(),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512))
    engines = {}
    for runner in args.runners.split(","):
        for kv_dtype in KV_DTYPES:
            config = dataclasses.replace(base, runner=runner, cache=CacheConfig(n_ctx=4096, kv_dtype=kv_dtype))
            engines[(runner, kv_dtype)] = LLMEngine(config)
    for engine in engines.values():
        engine.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    keys = ("short", "2k", "8")
    figures = {name: {k: [] for k in keys} for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            short = run_concurrency(engine, 1, 64, 64)["decode_tokens_per_s"]
            long = run_concurrency(engine, 1, 2000, 32)["decode_tokens_per_s"]
            eight = run_concurrency(engine, 8, 64, 32)["decode_tokens_per_s"]
            for key, value in zip(keys, (short, long, eight)):
                figures[name][key].append(value)
            print(f"round {r + 1} {name[0]:8s} {name[1]:4s} decode: short {short:6.1f}, 2k context {long:6.1f}, "
                  f"8 streams {eight:6.1f} tok/s", flush=True)
    print(f"\n{machine()}; {args.threads} threads; {path.name}; pools of 4,096 tokens; medians of {args.rounds} rounds")
    print("| runner | KV | pool bytes (measured) | bytes / token | tokens in the same memory | "
          "decode, short context | decode, 2k context | decode, 8 streams |")
    print("|---|---|---|---|---|---|---|---|")
    for (runner, kv_dtype), engine in engines.items():
        ref = engines[(runner, "f16")]
        pool, ref_pool = engine.runner.kv_bytes, ref.runner.kv_bytes
        per_token = pool / engine.max_model_len
        cells = []
        for k in keys:
            value, ref_value = median(figures[(runner, kv_dtype)][k]), median(figures[(runner, "f16")][k])
            cells.append(f"{value:.1f} tok/s ({value / ref_value:.2f}x)")
        print(f"| {runner} | {kv_dtype} | {pool:,} | {per_token:,.0f} | {ref_pool / pool:.3f}x | " + " | ".join(cells) + " |")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
