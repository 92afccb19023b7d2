"""The native layers (fused.py, native/layer.c) against the torch runner's own forward on the
real files: the same hidden states and the same KV pool, bit for bit, for each model, pool
dtype and batch shape; built only where they can compute the model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from localllm.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from localllm.runners.torch import native  # noqa: E402
from localllm.runners.torch.attention import AttnBatch  # noqa: E402
from localllm.runners.torch.runner import TorchRunner  # noqa: E402

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not native.vector_loops(), reason="the native kernels' vector loops are not here")]


def runner_for(path, kv_dtype: str) -> TorchRunner:
    return TorchRunner(EngineConfig(model_path=path, n_threads=2, runner="torch", speculative=False,
                                    cache=CacheConfig(n_ctx=1024, kv_dtype=kv_dtype),
                                    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)))


def forward(runner: TorchRunner, fused: bool, steps) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Hidden states of each step (spans: (block table, start, count)), and the pool after."""
    model = runner.model
    model.fused.on = fused
    runner.pool.zero_()
    hidden = []
    gen = torch.Generator().manual_seed(0)
    for spans in steps:
        n = sum(count for _, _, count in spans)
        tokens = torch.randint(0, min(1000, runner.vocab.n_vocab), (n,), generator=gen)
        positions = torch.cat([torch.arange(start, start + count) for _, start, count in spans])
        batch = AttnBatch.build([(table, start, count, True) for table, start, count in spans], runner.block_size,
                                "cpu", native=True)
        hidden.append(model.forward(tokens, positions, batch, runner.pool))
    return hidden, [t.clone() for t in runner.pool.k + runner.pool.v + runner.pool.k_scales + runner.pool.v_scales]


# Two sequences: prefilled in chunks (one 40 tokens into its second block), then decoded
# together, then one checks 4 drafted positions while the other decodes one.
STEPS = [[([0, 1, 2], 0, 40)], [([3, 4], 0, 21), ([0, 1, 2], 40, 3)],
         [([0, 1, 2], 43, 1), ([3, 4], 21, 1)], [([0, 1, 2], 44, 4), ([3, 4], 22, 1)]]


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("model", ["qwen", "gemma"])
def test_native_layers_give_the_torch_paths_bits(model, kv_dtype, qwen_path, gemma_path):
    runner = runner_for(qwen_path if model == "qwen" else gemma_path, kv_dtype)
    try:
        fused_hidden, fused_pool = forward(runner, True, STEPS)
        assert runner.model.fused.held[1] is not None  # every matrix of the file is in blocks read in place
        torch_hidden, torch_pool = forward(runner, False, STEPS)
        assert all(torch.equal(a, b) for a, b in zip(fused_hidden, torch_hidden))
        assert all(torch.equal(a, b) for a, b in zip(fused_pool, torch_pool))
        # a position decoded alone equals the same position among drafts
        alone, _ = forward(runner, True, STEPS[:2] + [[([0, 1, 2], 43, 1)]])
        assert torch.equal(alone[2][0], fused_hidden[2][0])
    finally:
        runner.close()


def test_native_layers_are_not_built_for_a_model_they_cannot_compute(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tiny_gguf import write_tiny_gguf

    runner = runner_for(write_tiny_gguf(tmp_path / "m.gguf", "qwen2"), "f16")  # float32 matrices
    try:
        forward(runner, True, STEPS[:1])
        assert runner.model.fused.held == (runner.pool, None)
    finally:
        runner.close()
