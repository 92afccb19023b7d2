"""What checking drafts costs on this machine: llama.cpp's time for one step of n tokens of
one sequence (every position's logits, as a verify step asks for), at a few context lengths.

    python benchmarks/verify_cost.py [--threads 2]

This is the ceiling of prompt-lookup decoding: with every draft accepted, a step of n tokens
yields n tokens, so the speed-up over plain decoding can be at most
n * t(1) / t(n). The engine's Drafter learns the same curve from its own steps.
"""

from __future__ import annotations

import argparse
import time

import llama_cpp as L
import numpy as np
from _common import machine, median, model_path

from localllm.runners.llamacpp import _init_backend

SIZES = (1, 2, 9, 17, 33, 65, 129)
CONTEXTS = (500, 2000, 4000)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    _init_backend()
    model = L.llama_model_load_from_file(str(model_path()).encode(), L.llama_model_default_params())
    cparams = L.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 8192, 256, 256
    cparams.n_threads = cparams.n_threads_batch = args.threads
    ctx = L.llama_init_from_model(model, cparams)
    memory = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(256, 0, 1)
    tokens = np.random.default_rng(0).integers(100, 20000, max(CONTEXTS) + max(SIZES)).astype(np.int32)

    def decode(start: int, n: int, num_logits: int) -> None:
        batch.n_tokens = n
        for i in range(n):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(tokens[start + i]), start + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, i >= n - num_logits
        assert L.llama_decode(ctx, batch) == 0

    print(f"# {machine()}; llama.cpp, {args.threads} threads; Qwen2.5-Coder-0.5B Q4_K_M")
    print("| context | " + " | ".join(f"n={n}" for n in SIZES) + " | best n * t(1) / t(n) |")
    print("|---" * (len(SIZES) + 2) + "|")
    for context in CONTEXTS:
        L.llama_memory_seq_rm(memory, 0, 0, -1)
        for start in range(0, context, 256):
            decode(start, min(256, context - start), 1)
        times = {}
        for n in SIZES:
            samples = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                decode(context, n, n)
                samples.append(time.perf_counter() - t)
                L.llama_memory_seq_rm(memory, 0, context, -1)
            times[n] = median(samples)
        ceiling = max(n * times[1] / times[n] for n in SIZES)
        print(f"| {context} | " + " | ".join(f"{1000 * times[n]:.0f} ms" for n in SIZES) + f" | {ceiling:.2f}x |",
              flush=True)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
