"""How closely the torch runner's next-token distributions follow llama.cpp's on a real file.

    python benchmarks/torch_fidelity.py [--model qwen2.5-coder-0.5b] [--tokens 2048] [--threads 2] [--scheme S]

A fixed text (the first --tokens tokens of this repository's README.md) is run through both
runners in chunks of 256 positions, asking each for the logits of every position (through the
runner interface: a chunk is sent as one known token followed by "draft" tokens, so every
row comes back). Reported: top-1 agreement (the same most likely next token), the mean
KL(llama.cpp || torch) of the next-token distributions, and each runner's perplexity on the
text. Both keep K and V in float32 (llama.cpp without flash attention), so the difference is
the weights and the arithmetic.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from _common import machine, model_path

from localllm.config import CacheConfig, EngineConfig, SchedulerConfig
from localllm.engine.request import SamplingParams, Sequence
from localllm.engine.scheduler import ScheduledSeq, SchedulerOutput

CHUNK = 256


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def all_logits(runner, text: list[int]):
    """Yield (first position, logits rows) chunk by chunk; rows[i] predicts text[pos + i + 1]."""
    seq = Sequence(prompt_token_ids=text[:1], params=SamplingParams())
    seq.block_table = list(range(-(-len(text) // 16)))
    runner.attach(seq, 0)
    for start in range(0, len(text) - 1, CHUNK):
        k = min(CHUNK, len(text) - 1 - start)
        seq.prompt_token_ids = text[:start + 1]
        seq.num_computed_tokens = start
        seq.draft_token_ids = text[start + 1:start + k]
        rows = runner.execute(SchedulerOutput([ScheduledSeq(seq, k, k - 1)]))
        yield start, np.array(rows, dtype=np.float32, copy=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--against", choices=("torch", "llamacpp-f16"), default="torch",
                        help="llamacpp-f16: llama.cpp itself with its default float16 KV cache and flash "
                             "attention, to see how far llama.cpp's own settings move it")
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
    else:
        import dataclasses

        torch_runner = LlamaCppRunner(dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, kv_dtype="f16")))
    t_torch = time.perf_counter() - t
    print(f"{machine()}, {args.threads} threads, {path.name}, {len(text) - 1} positions of README.md; "
          f"load: llama.cpp {t_ref:.1f} s, {args.against} {t_torch:.1f} s")
    agree = n = 0
    kl_sum = nll_ref = nll_torch = 0.0
    for (start, a), (_, b) in zip(all_logits(ref, text), all_logits(torch_runner, text)):
        la, lb = log_softmax(a), log_softmax(b)
        targets = np.array(text[start + 1:start + 1 + len(a)])
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        kl_sum += float((np.exp(la) * (la - lb)).sum())
        nll_ref -= float(la[np.arange(len(a)), targets].sum())
        nll_torch -= float(lb[np.arange(len(b)), targets].sum())
        n += len(a)
    print(f"top-1 agreement {agree / n:.4f} ({agree} of {n}), mean KL(llama.cpp || {args.against}) "
          f"{kl_sum / n:.5f}, perplexity llama.cpp {np.exp(nll_ref / n):.3f}, {args.against} "
          f"{np.exp(nll_torch / n):.3f}")
    ref.close()
    torch_runner.close()


if __name__ == "__main__":
    main()
