"""The Sampler's cost per token on a Qwen-sized vocabulary (151,936 logits), greedy and sampled
(temperature 0.8, top_p 0.95), plain and with a logit_bias of 10 tokens, in microseconds per
call (the median of --rounds rounds of 500 calls). Run it from two checkouts to compare them:

    python benchmarks/sampler.py [--rounds 7]

A tree without logit_bias (before e4b33fc) prints its plain arms and "-" for the biased ones.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numpy as np  # noqa: E402
from _common import machine, median  # noqa: E402

from localllm.engine.request import SamplingParams, Sequence  # noqa: E402
from localllm.engine.sampler import Sampler  # noqa: E402

VOCAB = 151_936
CALLS = 500


def arm(params: SamplingParams, logits: np.ndarray, rounds: int) -> float:
    sampler, times = Sampler(), []
    seq = Sequence(prompt_token_ids=[1, 2, 3], params=params)
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(CALLS):
            sampler.sample(seq, logits)
        times.append((time.perf_counter() - start) / CALLS * 1e6)
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    logits = np.random.default_rng(0).normal(0, 3, VOCAB).astype(np.float32)
    bias = {str(i): -100.0 for i in range(1000, 1010)}
    print(machine())
    for name, kwargs in (("greedy", dict(temperature=0.0)), ("sampled", dict(temperature=0.8, top_p=0.95, seed=1))):
        plain = arm(SamplingParams(**kwargs), logits, args.rounds)
        try:
            biased = f"{arm(SamplingParams(logit_bias=bias, **kwargs), logits, args.rounds):.1f}"
        except TypeError:  # a tree from before logit_bias
            biased = "-"
        print(f"{name}: plain {plain:.1f} us/token, with a 10-token logit_bias {biased} us/token")


if __name__ == "__main__":
    main()
