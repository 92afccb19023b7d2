"""What a draft of k tokens costs through the engine: the time of a step of one greedy sequence
that checks k draft tokens (k + 1 rows, every row's logits), k by k, at one context length.

    python benchmarks/draft_step_cost.py [--runner torch] [--threads 2] [--ks 0,1,2,3,4,7,8,15,16] [--rounds 5]

verify_cost.py measures llama.cpp's own calls; this goes through LLMEngine.step(), whichever
runner, with the Drafter's plan replaced by one that drafts exactly k tokens (the last token
repeated: what is accepted does not change what the step computes). The sizes alternate
within each round (k = 0, 1, 2, ..., then again), each timed step after an untimed one of
its size, so the host's drifts fall on every size alike. The Drafter learns the same curve
from the steps it happens to run (spec_decode.py prints it); this is the curve measured on
purpose, median of the rounds.
"""

from __future__ import annotations

import argparse
import time

from _common import machine, median, model_path

from localllm.config import CacheConfig, EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.request import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runner", default="torch", choices=("llamacpp", "torch"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ks", default="0,1,2,3,4,5,6,7,8,11,12,15,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, default=2500, help="prompt tokens, about")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    engine = LLMEngine(EngineConfig(model_path=model_path(), cache=CacheConfig(n_ctx=8192),
                                    n_threads=args.threads, runner=args.runner))
    draft = {"k": 0}
    engine.drafter.plan = lambda eligible, *_: {
        seq_id: [int(ids[-1])] * draft["k"] for seq_id, ids, _, _ in eligible if draft["k"]}
    engine.drafter.on_verified = lambda *_: None
    lines = [f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(args.context // 12)]
    seq = engine.add_request("Here is a file:\n" + "\n".join(lines),
                             SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True))
    while seq.num_computed_tokens < seq.num_prompt_tokens:  # the prompt, chunk by chunk
        engine.step()
    for _ in range(4):  # a few plain steps
        engine.step()
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(args.rounds):
        for k in ks:
            draft["k"] = k
            engine.step()
            start = time.perf_counter()
            engine.step()
            times[k].append(time.perf_counter() - start)
    one = median(times[0]) if 0 in times else None
    print(f"# {machine()}; {args.runner} runner, {args.threads} threads, context {seq.num_computed_tokens} "
          f"tokens; medians of {args.rounds}\n")
    print("| draft tokens | rows | ms a step | ms a row | ceiling (all accepted) |")
    print("|---|---|---|---|---|")
    for k in ks:
        t = median(times[k])
        ceiling = f"{(k + 1) * one / t:.2f}x" if one else "-"
        print(f"| {k} | {k + 1} | {t * 1e3:.1f} | {t * 1e3 / (k + 1):.1f} | {ceiling} |")
    engine.close()


if __name__ == "__main__":
    main()
