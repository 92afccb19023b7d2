"""The torch runner's models on CUDA compute what they compute on the CPU: each family's tiny
random-weight file (F32, tests/tiny_gguf.py) through a prompt in two chunks and eight decoded
tokens, the hidden states compared step by step. It needs no llama.cpp (the parity tests
compare with llama.cpp where both are installed), so it runs on a GPU machine with torch and
the gguf package alone; it is skipped where torch sees no CUDA device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from localllm.runners.torch import models  # noqa: E402
from localllm.runners.torch.attention import AttnBatch, KVPool  # noqa: E402
from localllm.runners.torch.layers import LayerSource  # noqa: E402
from localllm.runners.torch.weights import GGUFWeights  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiny_gguf import write_tiny_gguf  # noqa: E402

BLOCK = 16


def run_steps(path: Path, device: str, steps: list[list[int]]) -> list[torch.Tensor]:
    """The final hidden states of each step's tokens, one sequence in blocks 0, 1, 2, ..."""
    weights = GGUFWeights(path)
    config = weights.config()
    model = models.build(config, LayerSource(weights, torch.float32, device), torch.float32, device)
    pool = KVPool(config.n_layer, 8, BLOCK, config.n_head_kv, config.head_dim, torch.float32, device)
    table, start, out = list(range(8)), 0, []
    with torch.inference_mode():
        for tokens in steps:
            batch = AttnBatch.build([(table, start, len(tokens), len(tokens) == 1)], BLOCK, device)
            positions = torch.arange(start, start + len(tokens), device=device)
            hidden = model.forward(torch.tensor(tokens, device=device), positions, batch, pool)
            out.append(model.logits(hidden).cpu())
            start += len(tokens)
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3"])
def test_a_model_on_cuda_computes_what_it_computes_on_the_cpu(tmp_path, arch):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 200, (37,), generator=g).tolist()
    steps = [prompt[:20], prompt[20:]] + [[int(t)] for t in torch.randint(3, 200, (8,), generator=g)]
    cpu, cuda = run_steps(path, "cpu", steps), run_steps(path, "cuda", steps)
    for i, (a, b) in enumerate(zip(cpu, cuda)):
        torch.testing.assert_close(b, a, atol=3e-3, rtol=1e-4, msg=lambda m: f"step {i}: {m}")
        assert torch.equal(b.argmax(-1), a.argmax(-1)), i
