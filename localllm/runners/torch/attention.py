"""The paged KV pool and attention that reads it through block tables.

Each layer's keys and values live in ``[num_blocks, block_size, n_kv_heads, head_dim]``
tensors; block ``b`` is the BlockManager's block ``b``. A sequence's position ``p`` lives in
block ``block_table[p // block_size]``, row ``p % block_size``: viewed flat, at *slot*
``block_table[p // block_size] * block_size + p % block_size``. Sharing a prefix is sharing
block ids, so nothing is copied, and nothing is ever dropped from the pool by a window:
rolling back drafts or reusing a prefix of a sliding-window model is exact.

A q8_0 pool (``dtype=torch.int8``, CacheConfig's "q8_0") keeps K and V as int8 of the same
shape plus float16 scales ``[num_blocks, block_size, n_kv_heads]``: one scale per token and
KV head, symmetric (scale = absmax / 127, q = round(x / scale) in [-127, 127]; a zero row has
scale 0). That is 2 * head_dim + 4 bytes per token, head and layer against 4 * head_dim for
float16 (Qwen2.5-0.5B, head_dim 64: 128 / 66 = 1.94 times fewer). Readers dequantize q *
scale in float32, where it is exact (8 bits times 11 fit in float32's 24), so every reader
sees the very same K/V values.

For the on-disk prefix cache the pool writes the K/V of a list of slots as flat bytes and
reads them back (``export_slots`` / ``import_slots``): a header ``KV_HEADER`` (magic,
version, dtype code, n_layer, n_kv_heads, head_dim, num_tokens; little-endian u32s), then per
layer K then V, each ``(num_tokens, n_kv_heads, head_dim)`` in the pool's dtype, positions in
order. Worked example: 2 layers, 2 KV heads of 4, f16, 3 positions: 32 header bytes, then
4 arrays of 3 * 2 * 4 halves (48 bytes each), 224 bytes in all. A q8_0 pool (dtype code 4)
writes its scales first, per layer K then V, each ``(num_tokens, n_kv_heads)`` float16, then
the int8 K/V as above (every part then starts at a multiple of its element size): the same
example takes 32 + 4 * 3 * 2 * 2 + 4 * 3 * 2 * 4 = 176 bytes.

A step's batch is flattened: the new tokens of every scheduled sequence one after another
(no padding). ``AttnBatch`` says where each sequence's queries start, how many there are,
how long its context is, and the slots of its whole context.

``AttnBatch.attend`` runs the native kernel (native/attention.c: reads the blocks in place,
one call per layer for the whole batch) where it was built and the pool is on the CPU, and
the pure-torch reference ``paged_attention`` otherwise; the tests hold the two together.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

KV_HEADER = struct.Struct("<8s6I")  # magic, version, dtype code, n_layer, n_kv_heads, head_dim, num_tokens
KV_MAGIC = b"LLMTORKV"
KV_VERSION = 1
KV_DTYPE_CODES = {torch.float16: 1, torch.float32: 2, torch.bfloat16: 3, torch.int8: 4}  # int8: q8_0
Q8_MAX = 127


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., hd) -> int8 q (..., hd) and float16 scales (...): one symmetric scale per row,
    absmax / 127 rounded to float16, q = round(x / scale) (to nearest, ties to even) with that
    rounded scale, clamped to [-127, 127]. A zero row gets scale 0 and q 0. Rows with NaN or
    inf are not representable: they come back as NaN or 0."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / Q8_MAX).to(torch.float16)
    s = scale.float()[..., None]
    q = torch.where(s > 0, xf / s, 0.0).round_().clamp_(-Q8_MAX, Q8_MAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 q (..., hd) and its scales (...) -> float32 q * scale (exact in float32)."""
    return q.to(torch.float32) * scale.to(torch.float32)[..., None]


def block_slots(block_table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """(num_tokens,) the slots of positions 0..num_tokens-1 of a sequence with this block table."""
    blocks = torch.tensor(block_table[:-(-num_tokens // block_size)], dtype=torch.long)
    return (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:num_tokens]


class KVPool:
    """Per layer K and V ``[num_blocks, block_size, n_kv_heads, head_dim]`` in ``dtype``:
    float16, float32 or bfloat16, or torch.int8 for q8_0 (then also ``k_scales`` / ``v_scales``
    ``[num_blocks, block_size, n_kv_heads]`` float16; empty lists for a float pool)."""

    def __init__(self, n_layer: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu"):
        if dtype not in KV_DTYPE_CODES:
            raise ValueError(f"a KV pool holds float16, float32, bfloat16 or int8 (q8_0), not {dtype}")
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.dtype = dtype
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        num_scaled = n_layer if self.is_quantized else 0
        self.k_scales = [torch.zeros(shape[:3], dtype=torch.float16, device=device) for _ in range(num_scaled)]
        self.v_scales = [torch.zeros(shape[:3], dtype=torch.float16, device=device) for _ in range(num_scaled)]
        self.k_smooth: list[torch.Tensor] | None = None  # see set_key_smoothing

    def set_key_smoothing(self, smooth: list[torch.Tensor]) -> None:
        """Per layer (n_kv, hd) positive factors s: a q8_0 pool stores K / s, and attention
        multiplies the queries by s, so q . k is unchanged (smoothing, as SmoothQuant does
        for activations). A few channels of K are several times larger than the rest in every
        token (biases, norm weights); one 8-bit scale per token and head would leave the
        others a few levels. Dividing them out first gives every channel the same share of
        the 8 bits. Set once, before anything is written: the stored bytes depend on s."""
        if not self.is_quantized:
            raise ValueError("only a q8_0 pool smooths its keys")
        self.k_smooth = [x.to(device=self.k[0].device, dtype=torch.float32) for x in smooth]

    def smooth_queries(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """q (N, n_head, hd) times the layer's key smoothing (each query head takes its KV
        head's factors); q itself where there is none."""
        if self.k_smooth is None:
            return q
        s = self.k_smooth[layer]
        return (q.float() * s.repeat_interleave(q.shape[1] // s.shape[0], dim=0)).to(q.dtype)

    @property
    def is_quantized(self) -> bool:
        return self.dtype == torch.int8

    def zero_(self) -> None:
        """Every position back to zeros, as allocated (key smoothing stays: it is the model's)."""
        for t in self.k + self.v + self.k_scales + self.v_scales:
            t.zero_()

    @property
    def nbytes(self) -> int:
        """The bytes the pool's tensors take (K, V and any scales), measured from their storage."""
        return sum(t.untyped_storage().nbytes() for t in self.k + self.v + self.k_scales + self.v_scales)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one position across every layer, K and V and any scales."""
        return self.nbytes // self.num_slots

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' keys and values (N, n_kv, hd) at their slots (N,); a q8_0 pool
        quantizes them (quantize_rows)."""
        n_kv, hd = k.shape[1], k.shape[2]
        if self.is_quantized:
            if self.k_smooth is not None:
                k = k.float() / self.k_smooth[layer]
            for pool, scales, x in ((self.k[layer], self.k_scales[layer], k),
                                    (self.v[layer], self.v_scales[layer], v)):
                q, scale = quantize_rows(x)  # (N, n_kv, hd), (N, n_kv)
                pool.view(-1, n_kv, hd).index_copy_(0, slots, q)
                scales.view(-1, n_kv).index_copy_(0, slots, scale)
            return
        self.k[layer].view(-1, n_kv, hd).index_copy_(0, slots, k.to(self.k[layer].dtype))
        self.v[layer].view(-1, n_kv, hd).index_copy_(0, slots, v.to(self.v[layer].dtype))

    def gather(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at ``slots`` (L,), each (L, n_kv, hd) in ``dtype``; a q8_0 pool
        dequantizes them (in float32, exactly, then to ``dtype``): its keys as stored, divided
        by any smoothing (the queries carry it, see set_key_smoothing)."""
        _, _, n_kv, hd = self.k[layer].shape
        k = self.k[layer].view(-1, n_kv, hd).index_select(0, slots)
        v = self.v[layer].view(-1, n_kv, hd).index_select(0, slots)
        if self.is_quantized:
            k = dequantize_rows(k, self.k_scales[layer].view(-1, n_kv).index_select(0, slots))
            v = dequantize_rows(v, self.v_scales[layer].view(-1, n_kv).index_select(0, slots))
        return k.to(dtype), v.to(dtype)

    def _header(self, num_tokens: int) -> tuple:
        _, _, n_kv, hd = self.k[0].shape
        return KV_MAGIC, KV_VERSION, KV_DTYPE_CODES[self.dtype], len(self.k), n_kv, hd, num_tokens

    def _parts(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """The (K, V) tensor lists in the order the bytes hold them: scales first, if any."""
        return ([(self.k_scales, self.v_scales)] if self.is_quantized else []) + [(self.k, self.v)]

    @staticmethod
    def _part_size(ks: list[torch.Tensor], num_tokens: int) -> int:
        return 2 * len(ks) * num_tokens * math.prod(ks[0].shape[2:]) * ks[0].element_size()

    def _payload_size(self, num_tokens: int) -> int:
        return KV_HEADER.size + sum(self._part_size(ks, num_tokens) for ks, _ in self._parts())

    def _views(self, data: torch.Tensor, num_tokens: int) -> list[torch.Tensor]:
        """data (uint8 payload) -> per part a (n_layer, 2, num_tokens, *row) view of it."""
        views, offset = [], KV_HEADER.size
        for ks, _ in self._parts():
            row, size = ks[0].shape[2:], self._part_size(ks, num_tokens)
            views.append(data[offset:offset + size].view(ks[0].dtype).view(len(ks), 2, num_tokens, *row))
            offset += size
        return views

    def export_slots(self, slots: torch.Tensor) -> memoryview:
        """The K/V at ``slots`` (N,) as bytes in the layout above (on the CPU; one gather per
        layer and per K/V, written straight into the returned buffer on a CPU pool)."""
        n = len(slots)
        slots = slots.to(self.k[0].device)
        buf = torch.empty(self._payload_size(n), dtype=torch.uint8)
        buf[:KV_HEADER.size] = torch.frombuffer(bytearray(KV_HEADER.pack(*self._header(n))), dtype=torch.uint8)
        for (ks, vs), out in zip(self._parts(), self._views(buf, n)):
            for layer in range(len(ks)):
                for i, pool in enumerate((ks[layer], vs[layer])):
                    flat = pool.view(-1, *pool.shape[2:])
                    if flat.device.type == "cpu":
                        torch.index_select(flat, 0, slots, out=out[layer, i])
                    else:
                        out[layer, i].copy_(flat.index_select(0, slots))
        return memoryview(buf.numpy())

    def import_slots(self, slots: torch.Tensor, payload) -> bool:
        """Write the first N positions of ``export_slots`` bytes at ``slots`` (N,). False, and
        nothing written, when the bytes are not of this pool's layout (magic, version, dtype
        (an f16 payload is never read into a q8_0 pool, nor the other way), layers, heads) or
        hold fewer than N positions."""
        view = memoryview(payload).cast("B")
        if view.nbytes < KV_HEADER.size:
            return False
        header = KV_HEADER.unpack_from(view)
        n = header[-1]
        if header[:-1] != self._header(n)[:-1] or n < len(slots) or view.nbytes != self._payload_size(n):
            return False
        if view.readonly:  # torch.frombuffer wants a writable buffer, though it only reads it here
            view = memoryview(bytearray(view))
        data = torch.frombuffer(view, dtype=torch.uint8)
        slots = slots.to(self.k[0].device)
        for (ks, vs), part in zip(self._parts(), self._views(data, n)):
            for layer in range(len(ks)):
                for i, pool in enumerate((ks[layer], vs[layer])):
                    pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, part[layer, i, :len(slots)].to(pool.device))
        return True


@dataclass
class SeqSpan:
    """One sequence's part of a step."""

    q_start: int  # its first query's row in the flattened batch
    q_len: int  # its new tokens this step
    ctx_len: int  # positions with KV after this step (its queries are the last q_len of them)
    ctx_slots: torch.Tensor  # (ctx_len,) the slots of positions 0..ctx_len-1
    exact: bool  # decoded (or drafted) positions: attention in float64, see paged_attention


@dataclass
class AttnBatch:
    slots: torch.Tensor  # (N,) where each new token's K/V is written
    spans: list[SeqSpan]
    # For the native kernel (None: the reference runs): int32 CPU tensors q_start, q_len,
    # ctx_len (per sequence), tables (every sequence's block ids, one after another) and
    # table_start (where each sequence's ids begin in tables).
    native_meta: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int, int, bool]], block_size: int, device,
              native: bool = False) -> AttnBatch:
        """seqs: (block_table, first new position, number of new tokens, exact) per sequence;
        native: attend with the native kernel (only for a pool on the CPU; it computes each
        query alike whatever the batch, so ``exact`` asks nothing more of it)."""
        spans, new_slots, row = [], [], 0
        tables, meta = [], []
        for table, start, num, exact in seqs:
            ctx_len = start + num
            used = table[:-(-ctx_len // block_size)]
            slots = block_slots(table, ctx_len, block_size).to(device)
            spans.append(SeqSpan(row, num, ctx_len, slots, exact))
            new_slots.append(slots[start:])
            meta.append((row, num, ctx_len, len(tables)))
            tables += used
            row += num
        native_meta = None
        if native:
            m = torch.tensor(meta, dtype=torch.int32).reshape(-1, 4).t().contiguous()
            native_meta = (m[0], m[1], m[2], torch.tensor(tables, dtype=torch.int32), m[3])
        slots = torch.cat(new_slots) if new_slots else torch.empty(0, dtype=torch.long, device=device)
        return cls(slots, spans, native_meta)

    def attend(self, q: torch.Tensor, pool: KVPool, layer: int, scale: float, n_swa: int = 0) -> torch.Tensor:
        """Attention of the batch's queries q (N, n_head, hd) over the pool's layer."""
        q = pool.smooth_queries(q, layer)
        if self.native_meta is not None and q.dtype == torch.float32:
            from localllm.runners.torch import native

            scales = (pool.k_scales[layer], pool.v_scales[layer]) if pool.is_quantized else (None, None)
            return native.paged_attention(q, pool.k[layer], pool.v[layer], self.native_meta, scale, n_swa,
                                          k_scales=scales[0], v_scales=scales[1])
        return paged_attention(q, pool, layer, self, scale, n_swa)


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, n_swa: int) -> torch.Tensor:
    """(q, k) True where a query at q_pos sees a key at k_pos: causal, and within the window
    (a key ``n_swa`` or more positions back is not seen), as llama.cpp's standard SWA."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if n_swa:
        visible &= (q_pos[:, None] - k_pos[None, :]) < n_swa
    return visible


def paged_attention(q: torch.Tensor, pool: KVPool, layer: int, batch: AttnBatch, scale: float,
                    n_swa: int = 0) -> torch.Tensor:
    """The reference: per sequence, gather its context's K/V through its slots and attend, all
    query heads that share a KV head in one matmul. q: (N, n_head, hd) -> (N, n_head, hd), in
    q's dtype.

    Exact spans (decoding, and checking drafts) are computed in float64. The CPU's float32
    matmuls sum in an order that depends on the matrices' shapes, so a position decoded alone
    and the same position checked among drafts would differ in their last bits, and the
    bfloat16 activations downstream can turn that into another greedy token; in float64 both
    round to the same float32, so drafting never changes greedy output. A q8_0 pool's K/V are
    dequantized as they are gathered (KVPool.gather)."""
    out = torch.empty_like(q)
    _, _, n_kv, hd = pool.k[layer].shape
    group = q.shape[1] // n_kv
    for span in batch.spans:
        n, dt = span.q_len, torch.float64 if span.exact else q.dtype
        qs = q[span.q_start:span.q_start + n].to(dt).view(n, n_kv, group, hd)
        qs = qs.permute(1, 2, 0, 3).reshape(n_kv, group * n, hd)  # (n_kv, g*q, hd), head = kv*g + g'
        k, v = pool.gather(layer, span.ctx_slots, dt)  # (L, n_kv, hd) each
        k, v = k.permute(1, 2, 0), v.transpose(0, 1)  # (n_kv, hd, L), (n_kv, L, hd)
        q_pos = torch.arange(span.ctx_len - n, span.ctx_len, device=q.device)
        k_pos = torch.arange(span.ctx_len, device=q.device)
        mask = _mask(q_pos, k_pos, n_swa)  # (q, L)
        scores = torch.matmul(qs, k).view(n_kv, group, n, span.ctx_len) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(dt, torch.float32)).to(dt)
        o = torch.matmul(probs.view(n_kv, group * n, span.ctx_len), v)  # (n_kv, g*q, hd)
        out[span.q_start:span.q_start + n] = o.view(n_kv, group, n, hd).permute(2, 0, 1, 3).reshape(n, -1, hd)
    return out
