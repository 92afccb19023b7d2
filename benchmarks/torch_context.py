"""Decode speed against context length: does attention read the paged KV in place?

    python benchmarks/torch_context.py [--contexts 100,1000,2000,4000] [--rounds 2] [--threads 2]

One engine each — llama.cpp, the torch runner with the native attention kernel
(native/attention.c) and the torch runner with its pure-torch reference attention — decodes
32 tokens (greedy, no drafting) after a prompt of each length, in rounds that alternate the
engines. Reported: median decode tokens/s per context and its ratio to the shortest context
(issue 8 asks for >= 0.85 at 4,000 tokens).
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--contexts", default="100,1000,2000,4000")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", default="llamacpp,torch-native,torch-reference")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    path = model_path(args.model)
    config = EngineConfig(model_path=path, n_threads=args.threads, speculative=False,
                          weights_cache_dir=paths.weights_cache_dir(),
                          cache=CacheConfig(n_ctx=max(contexts) + 256),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512))
    engines = {}
    for name in args.engines.split(","):
        if name == "llamacpp":
            engines[name] = LLMEngine(dataclasses.replace(config, runner="llamacpp"))
        else:
            from localllm.runners.torch.runner import TorchRunner

            c = dataclasses.replace(config, runner="torch")
            engines[name] = LLMEngine(c, runner=TorchRunner(c, native=name == "torch-native"))
        engines[name].generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    speeds = {(name, ctx): [] for name in engines for ctx in contexts}
    for r in range(args.rounds):
        for ctx in contexts:
            for name, engine in engines.items():
                res = run_concurrency(engine, 1, ctx, 32)
                speeds[name, ctx].append(res["decode_tokens_per_s"])
                print(f"round {r + 1} ctx {ctx:5d} {name:16s} {res['decode_tokens_per_s']:7.1f} tok/s", flush=True)
    print(f"\n{machine()}; {args.threads} threads; {path.name}; 32 tokens decoded after each prompt, "
          f"median of {args.rounds} rounds")
    print("| context | " + " | ".join(engines) + " |")
    print("|---|" + "---|" * len(engines))
    for ctx in contexts:
        cells = []
        for name in engines:
            s, base = median(speeds[name, ctx]), median(speeds[name, contexts[0]])
            cells.append(f"{s:.1f} ({s / base:.2f}x)")
        print(f"| {ctx} | " + " | ".join(cells) + " |")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
