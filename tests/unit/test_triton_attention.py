"""The Triton decode kernel (runners/torch/triton_attention.py) against the reference
``attention.paged_attention`` over the same pool: float16, bfloat16, float32 and q8_0 pools,
grouped-query heads, head dims that are and are not powers of two, sequences sharing blocks,
tables whose unused entries are garbage, and a sliding window. On a machine without CUDA the
kernel runs in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors."""

from __future__ import annotations

import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Triton reads this when triton.language is imported (its own @jit library: zeros, sum, max)
    # and when our kernel is wrapped in triton.jit (its first launch), so it must come first.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set: run this module with "
                    "TRITON_INTERPRET=1 in the environment", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from localllm.runners.torch import triton_attention  # noqa: E402
from localllm.runners.torch.attention import AttnBatch, KVPool, block_slots, paged_attention  # noqa: E402

GARBAGE = (1 << 30, -7)  # written into the tables past each sequence's used blocks


def make_decode_step(pool_dtype, n_head, n_kv, hd, block_size, ctx_lens, shared_blocks=0, seed=0):
    """A one-layer pool holding the contexts of len(ctx_lens) sequences in scattered blocks, and
    one query per sequence. With shared_blocks, every sequence's table starts with the first
    sequence's first shared_blocks block ids (a shared prefix: the same K/V, written once).
    Every position no sequence wrote holds NaN (a q8_0 pool: NaN scales), so that a read past
    a context shows. Returns the pool, the block tables (lists, used entries only), the
    (B, max_blocks) int32 tables with garbage past the used entries, and q (B, n_head, hd)."""
    g = torch.Generator().manual_seed(seed)
    used = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(used) + 3
    ids = torch.randperm(num_blocks, generator=g).tolist()
    pool = KVPool(1, num_blocks, block_size, n_kv, hd, dtype=pool_dtype, device=DEVICE)
    for t in pool.k + pool.v + pool.k_scales + pool.v_scales:
        if t.is_floating_point():
            t.fill_(float("nan"))
    tables = []
    for n, num_used in zip(ctx_lens, used):
        shared = tables[0][:shared_blocks] if tables else []
        own = [ids.pop() for _ in range(num_used - len(shared))]
        table = shared + own
        first_new = len(shared) * block_size  # the shared blocks' K/V are already in the pool
        k = torch.randn(n - first_new, n_kv, hd, generator=g)
        v = torch.randn(n - first_new, n_kv, hd, generator=g)
        slots = block_slots(table, n, block_size)[first_new:].to(DEVICE)
        pool.write(0, slots, k.to(DEVICE), v.to(DEVICE))
        tables.append(table)
    width = max(used) + 2
    padded = torch.tensor([t + [GARBAGE[i % 2] for i in range(width - len(t))] for t in tables],
                          dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(ctx_lens), n_head, hd, generator=g).to(DEVICE)
    return pool, tables, padded, q


def reference(q, pool, tables, ctx_lens, block_size, scale, n_swa):
    batch = AttnBatch.build([(t, n - 1, 1, True) for t, n in zip(tables, ctx_lens)], block_size, DEVICE)
    return paged_attention(q, pool, 0, batch, scale, n_swa)


def kernel(q, pool, padded, ctx_lens, scale, n_swa, out=None):
    scales = (pool.k_scales[0], pool.v_scales[0]) if pool.is_quantized else (None, None)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    return triton_attention.paged_decode_attention(q, pool.k[0], pool.v[0], padded, lens, scale, n_swa,
                                                   k_scales=scales[0], v_scales=scales[1], out=out)


CASES = [
    # pool dtype, n_head, n_kv, hd, block_size, ctx_lens, n_swa, shared_blocks
    pytest.param(torch.float16, 14, 2, 64, 16, [1, 16, 17, 100], 0, 0, id="f16-group7-hd64-bs16"),
    pytest.param(torch.float32, 2, 2, 80, 32, [70, 97], 0, 2, id="f32-group1-hd80-bs32-shared"),
    pytest.param(torch.int8, 8, 2, 256, 16, [3, 45], 0, 0, id="q8-group4-hd256-bs16"),
    pytest.param(torch.bfloat16, 4, 1, 64, 16, [5, 20, 21, 60, 99], 20, 0, id="bf16-group4-hd64-bs16-swa"),
    pytest.param(torch.int8, 14, 2, 80, 32, [64, 90], 40, 2, id="q8-group7-hd80-bs32-swa-shared"),
]


@pytest.mark.parametrize("pool_dtype, n_head, n_kv, hd, block_size, ctx_lens, n_swa, shared_blocks", CASES)
def test_decode_kernel_equals_the_reference_bit_for_bit(pool_dtype, n_head, n_kv, hd, block_size, ctx_lens,
                                                        n_swa, shared_blocks):
    pool, tables, padded, q = make_decode_step(pool_dtype, n_head, n_kv, hd, block_size, ctx_lens, shared_blocks)
    scale = 1 / math.sqrt(hd)
    want = reference(q, pool, tables, ctx_lens, block_size, scale, n_swa)
    got = kernel(q, pool, padded, ctx_lens, scale, n_swa)
    # Both compute in float64 and round once to float32; they sum in other orders (online softmax,
    # a tree reduction), which moves the float64 result by ~1e-16 relative, a billionth of a
    # float32 ulp, so the rounded results agree: equality, not a tolerance, is the contract the
    # engine needs (a decoded position and the same position checked among drafts).
    assert got.dtype == torch.float32
    assert torch.equal(got, want), f"max abs diff {(got - want).abs().max().item():.3g}"


def test_the_window_hides_what_lies_before_it():
    """The same step with and without a window differs exactly where the window cuts: a context
    no longer than the window is unchanged."""
    pool, tables, padded, q = make_decode_step(torch.float16, 4, 2, 64, 16, [10, 50], seed=1)
    full = kernel(q, pool, padded, [10, 50], 0.125, 0)
    windowed = kernel(q, pool, padded, [10, 50], 0.125, 10)
    assert torch.equal(windowed[0], full[0])
    assert not torch.equal(windowed[1], full[1])


def test_out_is_written_in_place_and_returned():
    pool, tables, padded, q = make_decode_step(torch.float16, 4, 2, 64, 16, [7, 33], seed=2)
    want = reference(q, pool, tables, [7, 33], 16, 0.125, 0)
    buffer = torch.full((4, 2, 64), float("nan"), device=DEVICE)  # (n_head, B, hd)
    out = buffer.transpose(0, 1)  # (B, n_head, hd), not contiguous: the kernel follows the strides
    got = kernel(q, pool, padded, [7, 33], 0.125, 0, out=out)
    assert got is out
    assert torch.equal(buffer.transpose(0, 1), want)
