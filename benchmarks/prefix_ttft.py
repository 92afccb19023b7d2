"""Prefix sharing: a second request that shares a 1,500-token prefix with a finished one.

    python benchmarks/prefix_ttft.py [--prefix-tokens 1500] [--rounds 3]

Per round a new prefix: TTFT of the first request (computes everything) and of the second
(same prefix, a different last line: computes only its new tokens), and the ratio.
"""

from __future__ import annotations

import argparse

from _common import machine, median, model_path

from localllm.config import CacheConfig, EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.request import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model_path=model_path(), cache=CacheConfig(n_ctx=4096), n_threads=args.threads))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    tok = engine.tokenizer
    firsts, seconds = [], []
    print(f"{machine()}, {args.threads} threads, prefix {args.prefix_tokens} tokens")
    for r in range(args.rounds):
        prefix = tok.encode("".join(f"item_{r}_{i} = {3 * i}\n" for i in range(args.prefix_tokens)),
                            add_special=False)[:args.prefix_tokens]
        a = engine.generate([prefix + tok.encode("# first question\n", add_special=False)], params)[0]
        b = engine.generate([prefix + tok.encode("# second question\n", add_special=False)], params)[0]
        firsts.append(a.metrics.ttft)
        seconds.append(b.metrics.ttft)
        print(f"round {r + 1}: first TTFT {a.metrics.ttft * 1000:7.1f} ms ({a.metrics.num_cached_tokens} cached of "
              f"{a.metrics.num_prompt_tokens}) | second TTFT {b.metrics.ttft * 1000:6.1f} ms "
              f"({b.metrics.num_cached_tokens} cached of {b.metrics.num_prompt_tokens})", flush=True)
    print(f"median TTFT: first {median(firsts) * 1000:.0f} ms, second {median(seconds) * 1000:.1f} ms, "
          f"ratio {median(firsts) / median(seconds):.1f}x")
    engine.close()


if __name__ == "__main__":
    main()
