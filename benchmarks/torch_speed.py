"""The torch runner's speed against llama.cpp's on one file, same run, same threads.

    python benchmarks/torch_speed.py [--model qwen2.5-coder-0.5b | --file F.gguf] [--rounds 3] [--threads 2]

Run it with LOCALLLM_NATIVE_ISA=avx2 and ATEN_CPU_CAPABILITY=avx2, and PYTHONPATH naming an
AVX2-only build of llama-cpp-python (docs/testing.md), to measure an AVX2-only CPU on a faster one.

Engines: llama.cpp, and the torch runner with each weight scheme given (--schemes; default
the default scheme and "gguf-blocks"). Per round, alternating the engines: decode tokens/s at
1 and at 8 concurrent streams (64-token prompts, 32 tokens each, greedy, no drafting: what
`localllm bench --no-spec` measures), and prefill tokens/s of one 512-token prompt (its time
to first token). Medians of the rounds, and each engine's ratio to llama.cpp.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from _common import machine, median, model_path

from localllm import paths
from localllm.commands.bench import run_concurrency
from localllm.config import CacheConfig, EngineConfig, SchedulerConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.request import SamplingParams


def read_bandwidth(threads: int) -> float:
    """The machine's memory read bandwidth in GB/s as torch sums a 1 GiB tensor with ``threads``
    threads (the best of 10; measured before any engine starts, whose idle threads may spin):
    the ceiling for decode, which reads every weight once a step."""
    import time

    import torch

    torch.set_num_threads(threads)
    t = torch.ones(1 << 28)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - start)
    return t.numel() * 4 / min(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--schemes", default="int4-int8-bf16,gguf-blocks")
    parser.add_argument("--file", type=Path, help="a GGUF file instead of --model (e.g. a re-quantized one)")
    args = parser.parse_args()
    path = args.file or model_path(args.model)
    config = EngineConfig(model_path=path, n_threads=args.threads, speculative=False,
                          weights_cache_dir=paths.weights_cache_dir(), cache=CacheConfig(n_ctx=4096),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512))
    from localllm.runners.torch.runner import TorchRunner

    bandwidth = read_bandwidth(args.threads)
    engines = {"llama.cpp": LLMEngine(dataclasses.replace(config, runner="llamacpp"))}
    for scheme in args.schemes.split(","):
        c = dataclasses.replace(config, runner="torch")
        engines[f"torch {scheme}"] = LLMEngine(c, runner=TorchRunner(c, scheme=scheme))
    for engine in engines.values():
        engine.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    figures = {name: {"1": [], "8": [], "prefill": []} for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            one = run_concurrency(engine, 1, 64, 32)["decode_tokens_per_s"]
            eight = run_concurrency(engine, 8, 64, 32)["decode_tokens_per_s"]
            prefill = 512 / run_concurrency(engine, 1, 512, 2)["ttft_p50_s"]
            for key, value in (("1", one), ("8", eight), ("prefill", prefill)):
                figures[name][key].append(value)
            print(f"round {r + 1} {name:26s} decode 1 stream {one:6.1f}, 8 streams {eight:6.1f} tok/s; "
                  f"prefill {prefill:6.1f} tok/s", flush=True)
    import llama_cpp

    from localllm.runners.torch import native

    llama_isa = [f for f in ("AVX2", "AVX_VNNI", "AVX512", "AVX512_VNNI")
                 if f"{f} = 1" in llama_cpp.llama_print_system_info().decode()]
    print(f"\n{machine()}; {args.threads} threads; {path.name}; medians of {args.rounds} rounds")
    print(f"native kernels' tier: {native.isa()}; llama.cpp built with {', '.join(llama_isa)}")
    ceiling = bandwidth * 1e9 / path.stat().st_size  # decode reads about the whole file once a token
    print(f"memory read bandwidth {bandwidth:.1f} GB/s: one stream's decode ceiling {ceiling:.0f} tok/s "
          f"({path.stat().st_size / 1e6:.0f} MB read a token)")
    print("| engine | decode, 1 stream | decode, 8 streams | prefill (512-token prompt) |")
    print("|---|---|---|---|")
    base = {k: median(v) for k, v in figures["llama.cpp"].items()}
    for name, f in figures.items():
        cells = [f"{median(f[k]):.1f} tok/s ({median(f[k]) / base[k]:.2f}x)" for k in ("1", "8", "prefill")]
        print(f"| {name} | " + " | ".join(cells) + " |")
        print(f"  ({name}: one stream at {median(f['1']) / ceiling:.0%} of the bandwidth ceiling)")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
