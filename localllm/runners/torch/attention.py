"""The paged KV pool and attention that reads it through block tables.

Each layer's keys and values live in ``[num_blocks, block_size, n_kv_heads, head_dim]``
tensors; block ``b`` is the BlockManager's block ``b``. A sequence's position ``p`` lives in
block ``block_table[p // block_size]``, row ``p % block_size``: viewed flat, at *slot*
``block_table[p // block_size] * block_size + p % block_size``. Sharing a prefix is sharing
block ids, so nothing is copied, and nothing is ever dropped from the pool by a window:
rolling back drafts or reusing a prefix of a sliding-window model is exact.

A step's batch is flattened: the new tokens of every scheduled sequence one after another
(no padding). ``AttnBatch`` says where each sequence's queries start, how many there are,
how long its context is, and the slots of its whole context.

``AttnBatch.attend`` runs the native kernel (native/attention.c: reads the blocks in place,
one call per layer for the whole batch) where it was built and the pool is on the CPU, and
the pure-torch reference ``paged_attention`` otherwise; the tests hold the two together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVPool:
    def __init__(self, n_layer: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu"):
        self.block_size = block_size
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]

    @property
    def bytes_per_token(self) -> int:
        k = self.k[0]
        return 2 * len(self.k) * k.shape[2] * k.shape[3] * k.element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' keys and values (N, n_kv, hd) at their slots (N,)."""
        n_kv, hd = k.shape[1], k.shape[2]
        self.k[layer].view(-1, n_kv, hd).index_copy_(0, slots, k.to(self.k[layer].dtype))
        self.v[layer].view(-1, n_kv, hd).index_copy_(0, slots, v.to(self.v[layer].dtype))


@dataclass
class SeqSpan:
    """One sequence's part of a step."""

    q_start: int  # its first query's row in the flattened batch
    q_len: int  # its new tokens this step
    ctx_len: int  # positions with KV after this step (its queries are the last q_len of them)
    ctx_slots: torch.Tensor  # (ctx_len,) the slots of positions 0..ctx_len-1


@dataclass
class AttnBatch:
    slots: torch.Tensor  # (N,) where each new token's K/V is written
    spans: list[SeqSpan]
    # For the native kernel (None: the reference runs): int32 CPU tensors q_start, q_len,
    # ctx_len (per sequence), tables (every sequence's block ids, one after another) and
    # table_start (where each sequence's ids begin in tables).
    native_meta: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int, int]], block_size: int, device,
              native: bool = False) -> AttnBatch:
        """seqs: (block_table, first new position, number of new tokens) per sequence;
        native: attend with the native kernel (only for a pool on the CPU)."""
        spans, new_slots, row = [], [], 0
        tables, meta = [], []
        for table, start, num in seqs:
            ctx_len = start + num
            used = table[:-(-ctx_len // block_size)]
            blocks = torch.tensor(used, dtype=torch.long)
            slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:ctx_len]
            slots = slots.to(device)
            spans.append(SeqSpan(row, num, ctx_len, slots))
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
        if self.native_meta is not None and q.dtype == torch.float32:
            from localllm.runners.torch import native

            return native.paged_attention(q, pool.k[layer], pool.v[layer], self.native_meta, scale, n_swa)
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
    """The reference: per sequence, gather its context's K/V through its slots and attend.
    q: (N, n_head, hd) -> (N, n_head, hd), in q's dtype."""
    out = torch.empty_like(q)
    n_kv, hd = pool.k[layer].shape[2], pool.k[layer].shape[3]
    k_flat = pool.k[layer].view(-1, n_kv, hd)
    v_flat = pool.v[layer].view(-1, n_kv, hd)
    group = q.shape[1] // n_kv
    for span in batch.spans:
        qs = q[span.q_start:span.q_start + span.q_len]  # (q, H, hd)
        k = k_flat.index_select(0, span.ctx_slots).to(q.dtype)  # (L, n_kv, hd)
        v = v_flat.index_select(0, span.ctx_slots).to(q.dtype)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        q_pos = torch.arange(span.ctx_len - span.q_len, span.ctx_len, device=q.device)
        k_pos = torch.arange(span.ctx_len, device=q.device)
        mask = _mask(q_pos, k_pos, n_swa)  # (q, L)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out[span.q_start:span.q_start + span.q_len] = torch.einsum("hqk,khd->qhd", probs, v)
    return out
