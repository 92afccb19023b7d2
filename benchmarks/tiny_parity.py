"""How far the torch runner's logits are from llama.cpp's on the tests' tiny random-weight
files, next to how far llama.cpp's own logits move with the batch size.

    python benchmarks/tiny_parity.py

Per family (tests/tiny_gguf.py's qwen2, llama and gemma3, float32 weights, float32 KV): a
97-token text is scored through the runner interface (localllm/evaluation.py) in chunks of 16
positions and one position at a time. Reported: the largest |logit difference| between
llama.cpp in chunks and llama.cpp one at a time, and between the torch runner and llama.cpp
(each way of chunking), with the spread of the logits for scale.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny_gguf import write_tiny_gguf  # noqa: E402

from localllm.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from localllm.evaluation import all_logits  # noqa: E402

TEXT = b"Hello world, the cat is in the hat! def f(x): return 42 a b c d e f g h i j k l m n o p"


def rows(runner, text: list[int], chunk: int) -> np.ndarray:
    return np.concatenate([r.copy() for _, r in all_logits(runner, text, chunk=chunk)])


def main() -> None:
    from localllm.runners.llamacpp import LlamaCppRunner
    from localllm.runners.torch.runner import TorchRunner

    print("| family | llama.cpp: chunks of 16 vs 1 | torch vs llama.cpp, chunks of 16 | torch vs llama.cpp, 1 | logit spread |")
    print("|---|---|---|---|---|")
    for arch in ("qwen2", "llama", "gemma3"):
        path = write_tiny_gguf(Path(tempfile.mkdtemp()) / "m.gguf", arch)
        config = EngineConfig(model_path=path, cache=CacheConfig(n_ctx=512, kv_dtype="f32"), n_threads=1,
                              scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
        ref = LlamaCppRunner(config)
        text = (ref.vocab.tokenize(TEXT, True, False) * 4)[:97]
        a16, a1 = rows(ref, text, 16), rows(ref, text, 1)
        ref.close()
        torch_runner = TorchRunner(config)
        t16, t1 = rows(torch_runner, text, 16), rows(torch_runner, text, 1)
        torch_runner.close()
        print(f"| {arch} | {np.abs(a16 - a1).max():.2e} | {np.abs(t16 - a16).max():.2e} | "
              f"{np.abs(t1 - a1).max():.2e} | {a16.max() - a16.min():.1f} |")


if __name__ == "__main__":
    main()
