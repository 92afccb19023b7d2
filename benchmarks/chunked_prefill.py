"""Chunked prefill: a stream that is decoding while a 3,000-token prompt arrives.

    python benchmarks/chunked_prefill.py [--budgets 128,256,512] [--prompt-tokens 3000]

For each step token budget: the decoding stream's longest gap between two tokens during the
long prompt's prefill, that prefill's whole time (the long request's TTFT), and the ratio.
Smaller budgets keep the gap short (TPOT of running streams); larger ones prefill faster (TTFT).
"""

from __future__ import annotations

import argparse
import time

from _common import machine, median, model_path

from localllm.config import CacheConfig, EngineConfig, SchedulerConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.request import SamplingParams


def long_prompt(tokenizer, n: int) -> list[int]:
    text = "".join(f"value_{i} = {7 * i}\n" for i in range(n))
    return tokenizer.encode(text, add_special=False)[:n]


def one_run(engine, n: int) -> tuple[float, float]:
    stream = engine.add_request(engine.tokenizer.encode("def quicksort(arr):"),
                                SamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True))
    for _ in range(4):
        engine.step()
    long = engine.add_request(long_prompt(engine.tokenizer, n), SamplingParams(temperature=0.0, max_tokens=1))
    t_arrive = time.perf_counter()
    last, gaps, count = t_arrive, [], stream.num_output_tokens
    while long.first_token_time is None:
        engine.step()
        now = time.perf_counter()
        if stream.num_output_tokens > count:
            gaps.append(now - last)
            last, count = now, stream.num_output_tokens
    prefill = long.first_token_time - t_arrive
    engine.abort(stream.request_id)
    while engine.has_unfinished:
        engine.step()
    engine.block_manager.reset_prefix_cache()
    return max(gaps), prefill


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budgets", default="128,256,512")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = model_path()
    print(f"{machine()}, {args.threads} threads, prompt {args.prompt_tokens} tokens, {args.rounds} rounds")
    print("budget | longest gap (ms) | prefill (ms) | gap / prefill")
    for budget in [int(b) for b in args.budgets.split(",")]:
        engine = LLMEngine(EngineConfig(model_path=path, cache=CacheConfig(n_ctx=4096),
                                        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                                        n_threads=args.threads))
        runs = [one_run(engine, args.prompt_tokens) for _ in range(args.rounds)]
        gap, prefill = median([r[0] for r in runs]), median([r[1] for r in runs])
        print(f"{budget:6d} | {gap * 1000:16.0f} | {prefill * 1000:12.0f} | {gap / prefill:.3f}", flush=True)
        engine.close()


if __name__ == "__main__":
    main()
