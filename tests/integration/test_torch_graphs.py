"""Decode steps through DecodeGraphs (static tensors; CUDA graphs on a GPU) compute what the
eager path computes: on each family's tiny random-weight file, from the same pool, the same
logits for batches of every size (bucket-sized and padded), with f16 and q8_0 pools, shared
prefix blocks and a sliding window; the spare rows of a bucket touch only the scratch block;
and through the engine, greedy output with drafting equals greedy output without.

Where torch sees no CUDA device the static path runs eagerly on the CPU with the reference
attention (nothing is captured): the bookkeeping (buckets, staging, spare rows, the scratch
block) is what it checks there. On CUDA with Triton the steps are captured and replayed, the
attention is the Triton kernel, and the same assertions hold within GPU_TOLERANCE.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from localllm.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from localllm.engine.engine import LLMEngine  # noqa: E402
from localllm.engine.request import SamplingParams  # noqa: E402
from localllm.runners.torch.graphs import buckets  # noqa: E402
from localllm.runners.torch.runner import TorchRunner  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiny_gguf import write_tiny_gguf  # noqa: E402

ON_GPU = torch.cuda.is_available()
# On the CPU both paths run the same kernels on the same rows (the reference attention in
# float64 for decoded positions): the same bits where the bucket holds as many rows as the
# step. A padded bucket multiplies more rows than the eager step, and a BLAS may pick another
# kernel for another shape: cuBLAS on CUDA, and MKL's float32 GEMM on an Intel Xeon (5 rows
# and the same 5 among 8 differed in their last bits there, by up to 3e-4 in Gemma 3's logits
# after its layers; on AMD EPYCs they agreed). Such steps are held to the GPU's tolerance; a
# wrong slot, table or row would be off by far more.
GPU_TOLERANCE = 1e-3
BLOCK = 16


def make_runner(path: Path, kv_dtype: str, graphs: bool, max_seqs: int = 8) -> TorchRunner:
    config = EngineConfig(model_path=path, runner="torch", n_threads=1, speculative=False,
                          cache=CacheConfig(n_ctx=512, block_size=BLOCK, kv_dtype=kv_dtype),
                          scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64))
    return TorchRunner(config, native=False, graphs=graphs)


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(32) == [1, 2, 4, 8, 16, 24, 32]


def assert_same(a: np.ndarray, b: np.ndarray, padded: bool = False) -> None:
    if ON_GPU or padded:
        np.testing.assert_allclose(a, b, atol=GPU_TOLERANCE, rtol=0)
    else:
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("arch, kv_dtype, kernel", [("qwen2", "f16", False), ("llama", "q8_0", False),
                                                    ("gemma3", "f16", False), ("gemma3", "q8_0", True)])
def test_static_decode_equals_eager_decode(tmp_path, arch, kv_dtype, kernel):
    """Five sequences (two sharing their first two blocks; gemma3's contexts pass its sliding
    window) are prefilled eagerly, then decoded eight steps in batches of 5, 4, 1 and 2
    sequences; each step runs eagerly and then through DecodeGraphs from the same pool (a
    decode step writes its K/V where the other wrote the same), and the logits agree."""
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch)
    runner = make_runner(path, kv_dtype, graphs=True)
    assert runner.graphs is not None and runner.graphs.capture == ON_GPU
    if kernel and not ON_GPU:  # the Triton kernel in the static path, in Triton's interpreter (conftest)
        from localllm.runners.torch import triton_attention

        if not triton_attention.available():
            pytest.skip("Triton is not installed here")
        runner.graphs.kernel = True
    scratch = runner.graphs.scratch_block
    assert runner.pool.k[0].shape[0] == scratch + 1
    g = torch.Generator().manual_seed(3)
    lengths = [70, 33, 5, 40, 100]
    tables = [[0, 1, 2, 3, 4, 5], [6, 7, 8], [9], [0, 1, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19]]
    tokens = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
    tokens[3][:32] = tokens[0][:32]  # seq 3 shares seq 0's first two blocks
    with torch.inference_mode():
        for i, (toks, table) in enumerate(zip(tokens, tables)):
            start = 32 if i == 3 else 0
            runner._forward(toks[start:], list(range(start, len(toks))), [(table, start, len(toks) - start, False)], [])
        schedule = [[0, 1, 2, 3, 4], [0, 1, 2, 3], [4], [1, 3], [0, 1, 2, 3, 4], [2, 4], [0], [0, 1, 2, 3]]
        if kernel and not ON_GPU:
            schedule = schedule[:1]  # interpreted: seconds a step (five sequences, a padded bucket of eight)
        for batch in schedule:
            new = [int(torch.randint(3, 200, (1,), generator=g)) for _ in batch]
            positions = [lengths[i] for i in batch]
            eager = runner._forward(new, positions, [(tables[i], lengths[i], 1, True) for i in batch],
                                    list(range(len(batch))))
            static = runner.graphs.run([(t, p, tables[i]) for t, p, i in zip(new, positions, batch)]).cpu().numpy()
            assert static.shape == eager.shape == (len(batch), runner.vocab.n_vocab)
            assert_same(static, eager, padded=runner.graphs.bucket(len(batch)) > len(batch))
            for i in batch:
                lengths[i] += 1
    assert set(runner.graphs.graphs) == ({1, 2, 4, 8} if ON_GPU else set())  # buckets(8); 5 rows take 8
    runner.close()


def test_spare_rows_write_only_the_scratch_block(tmp_path):
    """Three sequences in a bucket of four: every pool block but theirs and the scratch block
    keeps its bytes."""
    path = write_tiny_gguf(tmp_path / "qwen2.gguf", "qwen2")
    runner = make_runner(path, "f16", graphs=True)
    for t in runner.pool.k + runner.pool.v:
        t.fill_(0.5)
    before = [t.clone() for t in runner.pool.k]
    with torch.inference_mode():
        runner.graphs.run([(5, 0, [3]), (6, 0, [4]), (7, 0, [5])])
    scratch = runner.graphs.scratch_block
    for layer, t in enumerate(runner.pool.k):
        changed = {b for b in range(t.shape[0]) if not torch.equal(t[b], before[layer][b])}
        assert changed == {3, 4, 5, scratch}
    runner.close()


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_drafting_through_graphs_keeps_greedy_output(tmp_path, arch):
    """The engine on the static decode path: greedy tokens with prompt-lookup drafting forced on
    (its verify steps run eagerly) equal greedy tokens without, for three concurrent prompts,
    and drafts were accepted."""
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch)
    prompts = ["a b c d e f a b c d e f a b c", "one two three one two three one two", "x = [1, 2, 3, 1, 2, 3, 1, 2"]
    config = EngineConfig(model_path=path, runner="torch", n_threads=1,
                          cache=CacheConfig(n_ctx=512, block_size=BLOCK),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    engine = LLMEngine(config, runner=TorchRunner(config, native=False, graphs=True))
    outs, accepted = {}, 0
    try:
        for speculative in (False, True):
            params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, speculative=speculative)
            seqs = [engine.add_request(engine.tokenizer.encode(p), params) for p in prompts]
            while engine.has_unfinished:
                engine.step()
            outs[speculative] = [s.output_token_ids for s in seqs]
            accepted += sum(s.num_draft_accepted for s in seqs) if speculative else 0
    finally:
        engine.close()
    assert outs[True] == outs[False]
    assert accepted > 0
