"""Does the chat app cost the engine anything? The same greedy answer streamed (A) by the bare
AsyncEngine and (B) through the Textual app rendering it as Markdown, alternated A B A B.

    .venv/bin/python benchmarks/chat_streaming.py [--rounds 3] [--max-tokens 256]

Prints decode tokens/s and TTFT for each, medians, and the ratio B/A. Also the time from
start-up to the first painted screen and to "model loaded" (headless, under Textual's pilot).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "tui"))
from _common import machine, median, model_path  # noqa: E402
from tui_helpers import send, wait_ready  # noqa: E402

from localllm.config import CacheConfig, EngineConfig  # noqa: E402
from localllm.engine.engine import AsyncEngine, LLMEngine  # noqa: E402
from localllm.engine.request import SamplingParams  # noqa: E402
from localllm.tui.app import ChatApp  # noqa: E402
from localllm.tui.backend import GenerationSettings, LocalBackend  # noqa: E402
from localllm.tui.conversations import ConversationStore  # noqa: E402

PROMPT = ("Write a Python module with a function that parses a CSV file of sales records "
          "(date, region, amount), sums the amounts per region and month, and prints a table. "
          "Include docstrings and a main block.")


async def bare(config: EngineConfig, max_tokens: int) -> tuple[float, float, int]:
    engine = AsyncEngine(LLMEngine(config))
    try:
        ids = engine.engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        start, first, n = time.perf_counter(), None, 0
        async for out in engine.generate(ids, params):
            if out.token_ids:
                n += len(out.token_ids)
                if first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
        return (n - 1) / (end - first), first - start, n
    finally:
        engine.shutdown()
        engine.engine.close()


async def in_app(config: EngineConfig, max_tokens: int) -> tuple[float, float, int, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        store = ConversationStore(Path(tmp) / "c.db")
        t0 = time.perf_counter()
        app = ChatApp(lambda m: LocalBackend(dataclasses.replace(config, model_path=Path(m))),
                      str(config.model_path), store,
                      settings=GenerationSettings(temperature=0, max_tokens=max_tokens))
        async with app.run_test(size=(120, 40)) as pilot:
            painted = time.perf_counter() - t0
            await wait_ready(pilot)
            loaded = time.perf_counter() - t0
            await send(pilot, PROMPT)
            stats = app.conversation.messages[-1].stats
        store.close()
        return stats["tokens_per_s"], stats["ttft"], stats["tokens"], painted, loaded


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    config = EngineConfig(model_path=model_path(), cache=CacheConfig(n_ctx=2048))
    print(f"machine: {machine()}; threads {config.threads}; Qwen2.5-Coder-0.5B; "
          f"{args.max_tokens} tokens max, greedy")
    a_speed, b_speed, a_ttft, b_ttft, painted, loaded = [], [], [], [], [], []
    for r in range(args.rounds):
        speed, ttft, n = await bare(config, args.max_tokens)
        a_speed.append(speed)
        a_ttft.append(ttft)
        print(f"round {r + 1} A engine: {speed:6.1f} tok/s  TTFT {ttft * 1000:5.0f} ms  ({n} tokens)")
        speed, ttft, n, p, ld = await in_app(config, args.max_tokens)
        b_speed.append(speed)
        b_ttft.append(ttft)
        painted.append(p)
        loaded.append(ld)
        print(f"round {r + 1} B app:    {speed:6.1f} tok/s  TTFT {ttft * 1000:5.0f} ms  ({n} tokens)  "
              f"screen {p:.2f} s, model loaded {ld:.2f} s")
    print(f"median: engine {median(a_speed):.1f} tok/s, app {median(b_speed):.1f} tok/s, "
          f"ratio app/engine {median(b_speed) / median(a_speed):.3f}; TTFT engine "
          f"{median(a_ttft) * 1000:.0f} ms, app {median(b_ttft) * 1000:.0f} ms; "
          f"screen up {median(painted):.2f} s, model loaded {median(loaded):.2f} s")


if __name__ == "__main__":
    asyncio.run(main())
