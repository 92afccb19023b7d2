"""Paged attention for decode steps on CUDA: a Triton kernel that reads the KV pool in place
through block tables (see attention.py for the pool and table layout).

One program per (sequence, query head): it walks the sequence's blocks one pool block at a
time, from the block holding its first visible position to the block holding ctx_len - 1, and
keeps an online softmax. Everything is float64 (scores, exp, the weighted sum of V), rounded
to q's dtype once at the end, as ``paged_attention`` computes exact spans: its float32 output
is the reference's. Loop bounds come from ``ctx_lens`` inside the kernel, so a launch does no
host sync and can be captured in a CUDA graph.

Worked example: block_size 16, ctx_len 40, n_swa 20: the query (position 39) sees positions
20..39, so the program reads table entries 1 and 2 (positions 16..31 masked to 20..31, then
32..39 of 32..47); entry 0 and entries 3.. are never read, and may hold anything.

Triton is imported here only, and not at import: at the kernel's first launch (or by
available()). Triton decides whether to interpret (TRITON_INTERPRET=1: its CPU interpreter, which
the tests use where there is no GPU) when triton.language is first imported, for its own
library, and again when a kernel is wrapped in ``triton.jit``, so the setting must be in the
environment before either.
"""

from __future__ import annotations

import functools

import torch

# triton.language, bound by _kernel() at the first launch: the kernel below names it as a
# module global, as Triton (its interpreter included) requires, and importing it here would
# fix the interpreter choice before a caller could make it.
tl = None

NO_WINDOW = 1 << 30  # n_swa 0: a window longer than any context


def available() -> bool:
    """Triton can be imported and a kernel can run: a CUDA device, or TRITON_INTERPRET=1.
    Imports triton."""
    try:
        import triton
    except ImportError:
        return False
    if torch.cuda.is_available():
        return True
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4 reads its settings through knobs
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _decode_kernel(
    q_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, tables_ptr, ctx_lens_ptr, scale_ptr, out_ptr,
    window, group,
    stride_qb, stride_qh, stride_qd,
    stride_kn, stride_kr, stride_kh, stride_kd,
    stride_vn, stride_vr, stride_vh, stride_vd,
    stride_ksn, stride_ksr, stride_ksh,
    stride_vsn, stride_vsr, stride_vsh,
    stride_tb, stride_ti,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_Q8: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    ctx_len = tl.load(ctx_lens_ptr + seq)
    lo = tl.maximum(ctx_len - window, 0)  # first visible position
    scale = tl.load(scale_ptr)  # float64: a Python float argument would arrive as float32

    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    rows = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + dims * stride_qd, mask=dim_ok, other=0.0)
    q = q.to(tl.float32).to(tl.float64)  # (HEAD_DIM_PAD,)

    m = tl.full([1], float("-inf"), tl.float64)  # running max of the scores
    denom = tl.zeros([1], tl.float64)  # running sum of exp(score - m)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float64)  # running sum of exp(score - m) * v
    for i in range(lo // BLOCK_SIZE, (ctx_len - 1) // BLOCK_SIZE + 1):
        # Every block in this range holds at least one visible position, so m is finite after
        # the first one and exp(m - m_new) never sees -inf - -inf.
        block = tl.load(tables_ptr + seq * stride_tb + i * stride_ti).to(tl.int64)
        pos = i * BLOCK_SIZE + rows
        row_ok = (pos >= lo) & (pos < ctx_len)  # (BLOCK_SIZE,)
        tile_ok = row_ok[:, None] & dim_ok[None, :]  # (BLOCK_SIZE, HEAD_DIM_PAD)
        k_rows = k_ptr + block * stride_kn + rows[:, None] * stride_kr + kv_head * stride_kh
        v_rows = v_ptr + block * stride_vn + rows[:, None] * stride_vr + kv_head * stride_vh
        # Masked rows load as 0, so stale non-finite values never reach 0 * v.
        k = tl.load(k_rows + dims[None, :] * stride_kd, mask=tile_ok, other=0)
        v = tl.load(v_rows + dims[None, :] * stride_vd, mask=tile_ok, other=0)
        # Through float32 first: exact for every pool dtype (and Triton widens 16-bit floats so).
        k = k.to(tl.float32).to(tl.float64)
        v = v.to(tl.float32).to(tl.float64)
        if IS_Q8:  # value = int8 * float16 scale, exact in float32 and so in float64
            k_scale = tl.load(k_scales_ptr + block * stride_ksn + rows * stride_ksr + kv_head * stride_ksh,
                              mask=row_ok, other=0)
            v_scale = tl.load(v_scales_ptr + block * stride_vsn + rows * stride_vsr + kv_head * stride_vsh,
                              mask=row_ok, other=0)
            k = k * k_scale.to(tl.float32).to(tl.float64)[:, None]
            v = v * v_scale.to(tl.float32).to(tl.float64)[:, None]

        scores = tl.sum(k * q[None, :], axis=1) * scale  # (BLOCK_SIZE,)
        scores = tl.where(row_ok, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))  # (1,)
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)  # (BLOCK_SIZE,), 0 where masked
        denom = denom * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new

    o = acc / denom
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=dim_ok)


@functools.cache
def _scale_tensor(scale: float, device: torch.device) -> torch.Tensor:
    """``scale`` as a one-element float64 tensor on ``device``, made once (a CUDA graph then
    reads it rather than filling a new one in every layer of every step)."""
    return torch.full((1,), scale, dtype=torch.float64, device=device)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def _kernel():
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_decode_kernel)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           ctx_lens: torch.Tensor, scale: float, n_swa: int = 0,
                           k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per sequence over its context in one layer's pool.

    q: (B, n_head, hd) float32, the query at position ctx_lens[b] - 1 of sequence b (already
    multiplied by any key smoothing, as KVPool.smooth_queries does). k_pool / v_pool:
    (num_blocks, block_size, n_kv, hd) float16, bfloat16, float32, or int8 for q8_0 with
    k_scales / v_scales (num_blocks, block_size, n_kv) float16. tables: (B, max_blocks) int32
    block ids (entries past a sequence's used blocks are never read); ctx_lens: (B,) int32,
    each >= 1. n_swa: sliding window (0: none), as attention._mask. Returns (B, n_head, hd) in
    q's dtype, written into ``out`` when given (nothing is allocated then; ``scale`` becomes a
    one-element float64 tensor once per value and device; no host sync, so a CUDA graph can
    capture it once the kernel has run)."""
    num_seqs, n_head, hd = q.shape
    _, block_size, n_kv, pool_hd = k_pool.shape
    if pool_hd != hd or v_pool.shape != k_pool.shape or n_head % n_kv:
        raise ValueError(f"queries {tuple(q.shape)} do not fit pools {tuple(k_pool.shape)} / {tuple(v_pool.shape)}: "
                         "the head dims must match and n_head be a multiple of n_kv")
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton decode kernel reads whole pool blocks: block_size {block_size} "
                         "must be a power of two (use the reference paged_attention otherwise)")
    is_q8 = k_pool.dtype == torch.int8
    if is_q8 and (k_scales is None or v_scales is None):
        raise ValueError("an int8 (q8_0) pool needs its k_scales and v_scales")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape:
        raise ValueError(f"out is {tuple(out.shape)}, the queries {tuple(q.shape)}: they must match")
    scale_strides = (*k_scales.stride(), *v_scales.stride()) if is_q8 else (0,) * 6
    if not is_q8:  # placeholders: the kernel reads no scales then
        k_scales = v_scales = k_pool
    hd_pad = _next_power_of_2(hd)
    scale_t = _scale_tensor(scale, q.device)
    _kernel()[(num_seqs, n_head)](
        q, k_pool, v_pool, k_scales, v_scales, tables, ctx_lens, scale_t, out,
        n_swa if n_swa > 0 else NO_WINDOW, n_head // n_kv,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *scale_strides,
        *tables.stride(), *out.stride(),
        HEAD_DIM=hd, HEAD_DIM_PAD=hd_pad, BLOCK_SIZE=block_size, IS_Q8=is_q8,
        num_warps=4 if block_size * hd_pad <= 2048 else 8,  # (BLOCK_SIZE, hd_pad) float64 tiles
    )
    return out
