"""`localllm bench`: the in-process engine at several concurrencies.

For each concurrency c, c requests with distinct prompts of ``prompt_tokens`` tokens arrive
together and each generates exactly ``max_tokens`` tokens (greedy, EOS ignored). Reported:
aggregate output tokens/s over the whole run, aggregate decode tokens/s over the steps that
only decoded, and TTFT / TPOT percentiles.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from localllm.config import EngineConfig
from localllm.engine.request import SamplingParams

_FILLER = (
    "The quick brown fox jumps over the lazy dog while the engineers measure how fast a "
    "language model can read and write text on a small laptop with two cores. "
)


def bench_prompts(tokenizer, n: int, num_tokens: int) -> list[list[int]]:
    """n prompts of exactly num_tokens tokens that share no prefix block."""
    body = tokenizer.encode(_FILLER * (num_tokens // 8 + 4), add_special=False)
    prompts = []
    for i in range(n):
        head = tokenizer.encode(f"Request {i}: ", add_special=True)
        prompts.append((head + body)[:num_tokens])
    return prompts


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def run_concurrency(engine, concurrency: int, prompt_tokens: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.block_manager.reset_prefix_cache()
    prompts = bench_prompts(engine.tokenizer, concurrency, prompt_tokens)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    metrics, decode_time, decode_tokens = [], 0.0, 0
    while engine.has_unfinished:
        t = time.perf_counter()
        outputs = engine.step()
        out = engine.last_step
        if all(s.num_new_tokens == 1 for s in out.scheduled) and len(out.scheduled) == concurrency:
            decode_time += time.perf_counter() - t
            decode_tokens += len(out.scheduled)
        metrics += [o.metrics for o in outputs if o.finished]
    wall = time.perf_counter() - t0
    ttfts = [m.ttft for m in metrics]
    tpots = [m.tpot for m in metrics if m.tpot is not None]
    generated = sum(m.num_generated_tokens for m in metrics)
    return {
        "concurrency": concurrency,
        "requests": len(metrics),
        "output_tokens": generated,
        "wall_s": wall,
        "output_tokens_per_s": generated / wall,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time else None,
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p95_s": _pct(ttfts, 95),
        "tpot_p50_s": _pct(tpots, 50),
        "tpot_p95_s": _pct(tpots, 95),
        "preemptions": engine.scheduler.num_preemptions,
    }


def bench(config: EngineConfig, concurrencies: list[int], prompt_tokens: int, max_tokens: int,
          as_json: bool = False) -> int:
    from localllm.engine.engine import LLMEngine

    engine = LLMEngine(config)
    try:
        engine.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
        results = []
        for c in concurrencies:
            r = run_concurrency(engine, c, prompt_tokens, max_tokens)
            results.append(r)
            if not as_json:
                print(
                    f"concurrency {c:>3}: {r['output_tokens_per_s']:7.1f} output tok/s, "
                    f"{r['decode_tokens_per_s'] or 0:7.1f} decode tok/s | "
                    f"TTFT p50 {r['ttft_p50_s'] * 1000:7.0f} ms p95 {r['ttft_p95_s'] * 1000:7.0f} ms | "
                    f"TPOT p50 {(r['tpot_p50_s'] or 0) * 1000:6.1f} ms p95 {(r['tpot_p95_s'] or 0) * 1000:6.1f} ms",
                    flush=True,
                )
        if as_json:
            json.dump({"model": str(config.model_path), "threads": config.threads,
                       "batch_tokens": config.scheduler.max_num_batched_tokens, "results": results},
                      sys.stdout, indent=2)
            sys.stdout.write("\n")
        return 0
    finally:
        engine.close()
