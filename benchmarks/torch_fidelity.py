"""How closely the torch runner's next-token distributions follow llama.cpp's on a real file.

    python benchmarks/torch_fidelity.py [--model qwen2.5-coder-0.5b] [--tokens 2048] [--threads 2] [--scheme S]

A fixed text (the first --tokens tokens of this repository's README.md) is run through both
runners in chunks of 256 positions, asking each for the logits of every position (through the
runner interface: a chunk is sent as one known token followed by "draft" tokens, so every
row comes back: localllm/evaluation.py, as `localllm eval` does). Reported: top-1 agreement
(the same most likely next token), the mean KL(llama.cpp || torch) of the next-token
distributions, and each runner's perplexity on the text. Both keep K and V in float32
(llama.cpp without flash attention), so the difference is the weights and the arithmetic.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _common import machine, model_path

from localllm.config import CacheConfig, EngineConfig, SchedulerConfig
from localllm.evaluation import CHUNK, Tally, all_logits, compare


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--against", choices=("torch", "llamacpp-f16", "llamacpp-decode"), default="torch",
                        help="llamacpp-f16: llama.cpp itself with its default float16 KV cache and flash "
                             "attention, to see how far llama.cpp's own settings move it; llamacpp-decode: "
                             "llama.cpp with the reference's very settings, one position at a time (as it "
                             "decodes) instead of chunks of 256, to see how far its batch size moves it")
    parser.add_argument("--scheme", default=None, help="the torch runner's weight scheme (quant.SCHEMES)")
    args = parser.parse_args()
    path = model_path(args.model)
    config = EngineConfig(model_path=path, cache=CacheConfig(n_ctx=args.tokens + 256, kv_dtype="f32"),
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=CHUNK),
                          n_threads=args.threads, prefix_cache_dir=None)
    from localllm.runners.llamacpp import LlamaCppRunner
    from localllm.runners.torch.runner import TorchRunner

    t = time.perf_counter()
    ref = LlamaCppRunner(config)
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    text = ref.vocab.tokenize(readme.encode(), True, False)[:args.tokens + 1]
    t_ref = time.perf_counter() - t
    t = time.perf_counter()
    if args.against == "torch":
        torch_runner = TorchRunner(config, scheme=args.scheme)
    elif args.against == "llamacpp-f16":
        import dataclasses

        torch_runner = LlamaCppRunner(dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, kv_dtype="f16")))
    else:
        torch_runner = LlamaCppRunner(config)
    t_torch = time.perf_counter() - t
    print(f"{machine()}, {args.threads} threads, {path.name}, {len(text) - 1} positions of README.md; "
          f"load: llama.cpp {t_ref:.1f} s, {args.against} {t_torch:.1f} s")
    if args.against == "llamacpp-decode":
        tally = compare_decoded(ref, torch_runner, text)
    else:
        tally = compare(ref, torch_runner, text)
    print(f"top-1 agreement {tally.num_agreeing / tally.num_predictions:.4f} ({tally.num_agreeing} of "
          f"{tally.num_predictions}), mean KL(llama.cpp || {args.against}) {tally.mean_kl:.5f}, perplexity "
          f"llama.cpp {tally.perplexity_reference:.3f}, {args.against} {tally.perplexity_candidate:.3f}")
    ref.close()
    torch_runner.close()


def compare_decoded(reference, candidate, text: list[int]) -> Tally:
    """The reference in chunks of CHUNK positions against the candidate one position at a time."""
    import numpy as np

    rows = np.concatenate([r.copy() for _, r in all_logits(candidate, text, chunk=1)])
    targets = np.asarray(text, dtype=np.intp)
    tally = Tally()
    for first, a in all_logits(reference, text):
        tally.add(a, rows[first:first + len(a)], targets[first + 1:first + 1 + len(a)])
    return tally


if __name__ == "__main__":
    main()
