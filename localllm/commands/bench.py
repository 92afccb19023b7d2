"""`localllm bench`: the in-process engine at several concurrencies.

For each concurrency c, c requests with distinct prompts of ``prompt_tokens`` tokens arrive
together and each generates exactly ``max_tokens`` tokens (greedy, EOS ignored). Reported:
aggregate output tokens/s over the whole run, aggregate decode tokens/s over the steps that
only decoded (a step that checks drafts decodes too), TTFT / TPOT percentiles, the CPU
threads decode and prefill steps ran on at the end (the engine chooses them from the load
unless --threads fixes them; the header's ``threads`` is the most), and the prompt-lookup
draft tokens proposed and accepted (0 with --no-spec).
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
        if len(out.scheduled) == concurrency and all(s.num_new_tokens == 1 + s.num_draft_tokens
                                                     for s in out.scheduled):
            decode_time += time.perf_counter() - t
            decode_tokens += sum(len(o.token_ids) for o in outputs)  # accepted drafts and the next token
        metrics += [o.metrics for o in outputs if o.finished]
    wall = time.perf_counter() - t0
    ttfts = [m.ttft for m in metrics]
    tpots = [m.tpot for m in metrics if m.tpot is not None]
    generated = sum(m.num_generated_tokens for m in metrics)
    stats = engine.stats()
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
        "draft_proposed": sum(m.num_draft_proposed for m in metrics),
        "draft_accepted": sum(m.num_draft_accepted for m in metrics),
        # The CPU threads each kind of step ran on at the run's end (0: a GPU computed them).
        "threads_decode": stats.threads_decode,
        "threads_prefill": stats.threads_prefill,
    }


def bench(config: EngineConfig, concurrencies: list[int], prompt_tokens: int, max_tokens: int,
          as_json: bool = False) -> int:
    from localllm.engine.engine import LLMEngine

    engine = LLMEngine(config)
    try:
        engine.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
        results = [run_concurrency(engine, c, prompt_tokens, max_tokens) for c in concurrencies]
        _report(results, {"model": str(config.model_path), "threads": config.threads,
                          "threads_adaptive": engine.stats().threads_adaptive,
                          "batch_tokens": engine.config.scheduler.max_num_batched_tokens,
                          "speculative": config.speculative}, as_json)
        return 0
    finally:
        engine.close()


async def _stream_one(client, url: str, model: str, prompt: str, max_tokens: int, headers: dict) -> dict:
    """One streamed completion: when each chunk with text arrived, and how many tokens came.
    A chunk can carry several tokens (a step that accepted drafts), so the count is the
    server's own ``usage`` (asked for with stream_options) where it gives one, and the number
    of chunks otherwise."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    usage_tokens = None
    async with client.stream("POST", f"{url}/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode("utf-8", "replace")[:300]
            raise RuntimeError(f"{url} answered {resp.status_code}: {text}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            choices = data.get("choices") or []
            if choices and choices[0].get("text"):
                times.append(time.perf_counter())
            usage = data.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                usage_tokens = usage["completion_tokens"]
    n = usage_tokens if usage_tokens is not None and times else len(times)
    return {
        "tokens": n,
        "ttft": times[0] - t0 if times else None,
        "tpot": (times[-1] - times[0]) / (n - 1) if n > 1 and len(times) > 1 else None,
        "times": times,
    }


def bench_url(url: str, model: str | None, concurrencies: list[int], prompt_tokens: int, max_tokens: int,
              api_key: str | None = None, as_json: bool = False) -> int:
    """The same scenario as the in-process bench, against any OpenAI-compatible server:
    c streaming completions at once, each of about prompt_tokens words, greedy."""
    import asyncio

    import httpx

    from localllm.errors import LocalLLMError

    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def main() -> list[dict]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            name = model
            if name is None:
                resp = await client.get(f"{url}/models", headers=headers)
                resp.raise_for_status()
                name = resp.json()["data"][0]["id"]
            words = _FILLER.split()
            results = []
            await _stream_one(client, url, name, "warm up", 4, headers)
            for c in concurrencies:
                # A fresh head each run, so no server answers from a prefix cache of an earlier run.
                nonce = time.time_ns() % 1_000_000_007
                prompts = [f"Request {nonce}-{i}: " + " ".join(words[j % len(words)] for j in range(prompt_tokens))
                           for i in range(c)]
                t0 = time.perf_counter()
                runs = await asyncio.gather(*[_stream_one(client, url, name, p, max_tokens, headers) for p in prompts])
                wall = time.perf_counter() - t0
                # Decode throughput: tokens arriving while every stream has started and none has ended.
                start = max(r["times"][0] for r in runs if r["times"])
                end = min(r["times"][-1] for r in runs if r["times"])
                # Each chunk counted as its run's tokens per chunk (several where drafts were accepted).
                in_window = sum(r["tokens"] / len(r["times"]) for r in runs if r["times"]
                                for t in r["times"] if start < t <= end)
                generated = sum(r["tokens"] for r in runs)
                ttfts = [r["ttft"] for r in runs if r["ttft"] is not None]
                tpots = [r["tpot"] for r in runs if r["tpot"] is not None]
                results.append({
                    "concurrency": c, "requests": len(runs), "output_tokens": generated, "wall_s": wall,
                    "output_tokens_per_s": generated / wall,
                    "decode_tokens_per_s": in_window / (end - start) if end > start else None,
                    "ttft_p50_s": _pct(ttfts, 50), "ttft_p95_s": _pct(ttfts, 95),
                    "tpot_p50_s": _pct(tpots, 50), "tpot_p95_s": _pct(tpots, 95),
                })
            return results

    try:
        results = asyncio.run(main())
    except (httpx.HTTPError, RuntimeError, KeyError, IndexError) as e:
        raise LocalLLMError(f"benchmarking {url} failed: {e}; check the URL (it ends in /v1) and the server") from None
    _report(results, {"url": url, "model": model}, as_json)
    return 0


def _report(results: list[dict], header: dict, as_json: bool) -> None:
    if as_json:
        json.dump(header | {"results": results}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    for r in results:
        print(
            f"concurrency {r['concurrency']:>3}: {r['output_tokens_per_s']:7.1f} output tok/s, "
            f"{r['decode_tokens_per_s'] or 0:7.1f} decode tok/s | "
            f"TTFT p50 {(r['ttft_p50_s'] or 0) * 1000:7.0f} ms p95 {(r['ttft_p95_s'] or 0) * 1000:7.0f} ms | "
            f"TPOT p50 {(r['tpot_p50_s'] or 0) * 1000:6.1f} ms p95 {(r['tpot_p95_s'] or 0) * 1000:6.1f} ms"
            + threads_text(r.get("threads_decode"), r.get("threads_prefill"))
            + draft_text(r.get("draft_proposed"), r.get("draft_accepted")),
            flush=True,
        )


def draft_text(num_proposed: int | None, num_accepted: int | None) -> str:
    """' | draft 412/430 (96%)': accepted of proposed; '' when nothing was proposed (or a
    server was measured, which does not say)."""
    if not num_proposed:
        return ""
    return f" | draft {num_accepted}/{num_proposed} ({100 * num_accepted / num_proposed:.0f}%)"


def threads_text(decode: int | None, prefill: int | None) -> str:
    """' | threads 2 decode, 4 prefill': the CPU threads the engine ran each kind of step on
    at the end of a run; '' where it chose none (a GPU) or a server was measured."""
    if not decode:
        return ""
    return f" | threads {decode} decode, {prefill} prefill"
