"""Single-stream decode: localllm's engine against llama-cpp-python's own high-level
`Llama.create_completion`, same file, same threads, same context, side by side (A B A B ...).

    python benchmarks/decode_vs_llama_cpp_python.py [--rounds 5] [--max-tokens 128] [--threads 2]

Decode tokens/s = (tokens - 1) / (time of last token - time of first token), so prompt
processing is left out on both sides. Both decode greedily, so they produce the same tokens.
"""

from __future__ import annotations

import argparse
import time

from _common import llama_without_amx, machine, median, model_path

from localllm.config import CacheConfig, EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.request import SamplingParams

PROMPT = "# A small library of sorting algorithms in Python\n\ndef quicksort(arr):\n"


def run_llama(llm, max_tokens: int) -> tuple[float, int, list[str]]:
    times, pieces = [], []
    for chunk in llm.create_completion(PROMPT, max_tokens=max_tokens, temperature=0.0, stream=True):
        if chunk["choices"][0]["finish_reason"] is not None and not chunk["choices"][0]["text"]:
            break  # the closing chunk carries no token
        times.append(time.perf_counter())
        pieces.append(chunk["choices"][0]["text"])
    return (len(times) - 1) / (times[-1] - times[0]), len(times), pieces


def run_localllm(engine, max_tokens: int) -> tuple[float, int, str]:
    out = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    return out.metrics.decode_tokens_per_s, len(out.token_ids), out.text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    args = parser.parse_args()
    path = model_path()

    llama_without_amx()
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=args.ctx, n_batch=256, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False)
    engine = LLMEngine(EngineConfig(model_path=path, cache=CacheConfig(n_ctx=args.ctx), n_threads=args.threads))
    run_llama(llm, 8)
    run_localllm(engine, 8)
    ours, theirs = [], []
    for r in range(args.rounds):
        engine.block_manager.reset_prefix_cache()
        tps_l, n_l, _ = run_llama(llm, args.max_tokens)
        tps_o, n_o, _ = run_localllm(engine, args.max_tokens)
        theirs.append(tps_l)
        ours.append(tps_o)
        print(f"round {r + 1}: llama-cpp-python {tps_l:6.1f} tok/s ({n_l} tokens) | localllm {tps_o:6.1f} tok/s ({n_o} tokens)",
              flush=True)
    m_o, m_l = median(ours), median(theirs)
    print(f"\n{machine()}, {args.threads} threads, ctx {args.ctx}, {args.max_tokens} tokens, {args.rounds} rounds")
    print(f"median decode: localllm {m_o:.1f} tok/s, llama-cpp-python {m_l:.1f} tok/s, ratio {m_o / m_l:.3f}")
    engine.close()


if __name__ == "__main__":
    main()
