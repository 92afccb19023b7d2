"""The torch runner's paged attention and rope, with no model: attention read through
scattered block tables equals plain causal attention over contiguous K/V (grouped-query
heads, sliding window, several sequences in one flattened batch)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from localllm.runners.torch.attention import AttnBatch, KVPool, paged_attention  # noqa: E402
from localllm.runners.torch.layers import Rope  # noqa: E402

BS = 4


def dense_attention(q, k, v, scale, n_swa=0):
    """q (Lq, H, d) for the last Lq positions of k/v (L, Hkv, d): the textbook computation."""
    L, Lq = k.shape[0], q.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.empty_like(q)
    for i in range(Lq):
        p = L - Lq + i
        keys = [j for j in range(L) if j <= p and (not n_swa or p - j < n_swa)]
        s = torch.stack([(q[i] * k[j]).sum(-1) for j in keys], dim=-1) * scale  # (H, n)
        w = torch.softmax(s, dim=-1)
        out[i] = sum(w[:, n, None] * v[j] for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("n_swa", [0, 5])
def test_paged_attention_equals_dense_attention_over_scattered_blocks(n_swa):
    g = torch.Generator().manual_seed(0)
    n_head, n_kv, hd = 4, 2, 8
    pool = KVPool(1, num_blocks=16, block_size=BS, n_kv_heads=n_kv, head_dim=hd, dtype=torch.float32)
    # Two sequences: one decoding (ctx 11, 1 new token), one prefilling a chunk (ctx 7, 3 new).
    tables = [[9, 2, 14], [5, 0]]
    lengths, new = [11, 7], [1, 3]
    ks = [torch.randn(n, n_kv, hd, generator=g) for n in lengths]
    vs = [torch.randn(n, n_kv, hd, generator=g) for n in lengths]
    # The context before this step is already in the pool.
    for table, k, v, n, m in zip(tables, ks, vs, lengths, new):
        old = AttnBatch.build([(table, 0, n - m)], BS, "cpu")
        pool.write(0, old.slots, k[:n - m], v[:n - m])
    batch = AttnBatch.build([(t, n - m, m) for t, n, m in zip(tables, lengths, new)], BS, "cpu")
    pool.write(0, batch.slots, torch.cat([k[n - m:] for k, n, m in zip(ks, lengths, new)]),
               torch.cat([v[n - m:] for v, n, m in zip(vs, lengths, new)]))
    q = torch.randn(sum(new), n_head, hd, generator=g)
    scale = 1 / math.sqrt(hd)
    got = paged_attention(q, pool, 0, batch, scale, n_swa)
    want = torch.cat([dense_attention(q[:1], ks[0], vs[0], scale, n_swa),
                      dense_attention(q[1:], ks[1], vs[1], scale, n_swa)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_batch_slots_follow_the_block_tables():
    batch = AttnBatch.build([([7, 3], 5, 2), ([1], 0, 3)], BS, "cpu")
    assert batch.slots.tolist() == [3 * BS + 1, 3 * BS + 2, 1 * BS + 0, 1 * BS + 1, 1 * BS + 2]
    assert batch.spans[0].ctx_slots.tolist() == [28, 29, 30, 31, 12, 13, 14]
    assert [(s.q_start, s.q_len, s.ctx_len) for s in batch.spans] == [(0, 2, 7), (2, 3, 3)]


def test_norm_rope_on_pairs_is_neox_rope_on_permuted_dims():
    hd = 8
    x = torch.randn(5, 2, hd, generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([0, 1, 2, 7, 100])
    perm = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])  # pairs -> halves
    norm = Rope(hd, 10000.0, neox=False, device="cpu")(x, pos)
    neox = Rope(hd, 10000.0, neox=True, device="cpu")(x[..., perm], pos)
    torch.testing.assert_close(norm[..., perm], neox)
    torch.testing.assert_close(Rope(hd, 10000.0, True, "cpu")(x, torch.zeros(5, dtype=torch.long)), x)
