"""The torch runner's paged attention and rope, with no model: attention read through
scattered block tables equals plain causal attention over contiguous K/V (grouped-query
heads, sliding window, several sequences in one flattened batch); the pool's K/V bytes for the
prefix cache round-trip between block tables, and bytes of another layout are refused."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from localllm.runners.torch.attention import (  # noqa: E402
    KV_HEADER, KV_MAGIC, AttnBatch, KVPool, block_slots, paged_attention)
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


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("n_swa", [0, 5])
def test_paged_attention_equals_dense_attention_over_scattered_blocks(n_swa, exact):
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
        old = AttnBatch.build([(table, 0, n - m, False)], BS, "cpu")
        pool.write(0, old.slots, k[:n - m], v[:n - m])
    batch = AttnBatch.build([(t, n - m, m, exact) for t, n, m in zip(tables, lengths, new)], BS, "cpu")
    pool.write(0, batch.slots, torch.cat([k[n - m:] for k, n, m in zip(ks, lengths, new)]),
               torch.cat([v[n - m:] for v, n, m in zip(vs, lengths, new)]))
    q = torch.randn(sum(new), n_head, hd, generator=g)
    scale = 1 / math.sqrt(hd)
    got = paged_attention(q, pool, 0, batch, scale, n_swa)
    want = torch.cat([dense_attention(q[:1], ks[0], vs[0], scale, n_swa),
                      dense_attention(q[1:], ks[1], vs[1], scale, n_swa)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_batch_slots_follow_the_block_tables():
    batch = AttnBatch.build([([7, 3], 5, 2, True), ([1], 0, 3, False)], BS, "cpu")
    assert batch.slots.tolist() == [3 * BS + 1, 3 * BS + 2, 1 * BS + 0, 1 * BS + 1, 1 * BS + 2]
    assert batch.spans[0].ctx_slots.tolist() == [28, 29, 30, 31, 12, 13, 14]
    assert [(s.q_start, s.q_len, s.ctx_len, s.exact) for s in batch.spans] == [(0, 2, 7, True), (2, 3, 3, False)]


def decoding_pool(seed: int, dtype=torch.float16):
    """A pool (float16, or int8: q8_0) holding 300 positions of a 14-head, 2-KV-head sequence
    (blocks in reverse order), its block table, and a query for every position."""
    g = torch.Generator().manual_seed(seed)
    n_head, n_kv, hd, length = 14, 2, 64, 300
    pool = KVPool(1, num_blocks=24, block_size=16, n_kv_heads=n_kv, head_dim=hd, dtype=dtype)
    table = list(range(24))[::-1]
    pool.write(0, block_slots(table, length, 16), torch.randn(length, n_kv, hd, generator=g),
               torch.randn(length, n_kv, hd, generator=g))
    q = torch.randn(length, n_head, hd, generator=g)
    return pool, table, q


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8], ids=["f16", "q8_0"])
def test_an_exact_position_decoded_alone_equals_it_checked_among_drafts(dtype):
    """Bit for bit: the float32 result of a decode step's query equals that of the same query
    as the first row of a verify step (1 + k rows, the drafts' keys masked), whatever k."""
    pool, table, q = decoding_pool(2, dtype)

    def attend(start, num):
        return paged_attention(q[start:start + num], pool, 0, AttnBatch.build([(table, start, num, True)], 16, "cpu"),
                               0.125)

    for p in range(250, 290, 3):
        alone = attend(p, 1)
        for k in (1, 2, 5, 10):
            assert torch.equal(attend(p, 1 + k)[:1], alone), (p, k)


def test_norm_rope_on_pairs_is_neox_rope_on_permuted_dims():
    hd = 8
    x = torch.randn(5, 2, hd, generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([0, 1, 2, 7, 100])
    perm = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])  # pairs -> halves
    norm = Rope(hd, 10000.0, neox=False, device="cpu")(x, pos)
    neox = Rope(hd, 10000.0, neox=True, device="cpu")(x[..., perm], pos)
    torch.testing.assert_close(norm[..., perm], neox)
    torch.testing.assert_close(Rope(hd, 10000.0, True, "cpu")(x, torch.zeros(5, dtype=torch.long)), x)


def test_rope_angles_are_llama_cpps_float32_products():
    """llama.cpp's angle of pair i at position p is p * s * s * ... (i times), each product
    rounded to float32, s = powf(base, -2 / head_dim); at position 3,000 the first pairs' angles
    differ from the exact p * base^(-2i/d) by about 1e-4 rad, which the tables keep."""
    hd, base = 64, 1e6
    rope = Rope(hd, base, neox=True, device="cpu")
    pos = torch.tensor([0, 1, 300, 3000])  # 3000: past the first tables, so they grow
    c, s = rope.tables(pos)
    scale = np.float32(np.power(np.float32(base), np.float32(-2.0 / hd), dtype=np.float32))
    for row, p in enumerate(pos.tolist()):
        theta = np.float32(p)
        for i in range(hd // 2):
            assert c[row, 0, i].item() == np.float32(np.cos(np.float64(theta))), (p, i)
            assert s[row, 0, hd // 2 + i].item() == np.float32(np.sin(np.float64(theta))), (p, i)
            theta = np.float32(theta * scale)
    exact = 3000 * base ** (-2 * 2 / hd)
    assert abs(float(np.float32(3000) * scale * scale) - exact) > 1e-5  # the float32 products drift


def filled_pool(table, num_tokens, n_layer=2, n_kv=2, hd=4, dtype=torch.float16):
    """A pool whose positions 0..num_tokens-1 (at ``table``) hold random K/V; (pool, slots)."""
    g = torch.Generator().manual_seed(3)
    pool = KVPool(n_layer, num_blocks=12, block_size=BS, n_kv_heads=n_kv, head_dim=hd, dtype=dtype)
    slots = block_slots(table, num_tokens, BS)
    for layer in range(n_layer):
        pool.write(layer, slots, torch.randn(num_tokens, n_kv, hd, generator=g),
                   torch.randn(num_tokens, n_kv, hd, generator=g))
    return pool, slots


def test_kv_bytes_round_trip_into_other_blocks():
    src, src_slots = filled_pool([9, 2], 7)
    payload = src.export_slots(src_slots)
    # 32 header bytes, then 2 layers x (K, V) x 7 positions x 2 heads x 4 halves.
    assert payload.nbytes == 32 + 2 * 2 * 7 * 2 * 4 * 2
    assert KV_HEADER.unpack_from(payload) == (KV_MAGIC, 1, 1, 2, 2, 4, 7)
    body = bytes(payload)[32:]
    layer1_v = src.v[1].view(-1, 2, 4)[src_slots].numpy().tobytes()
    assert body[3 * len(layer1_v):] == layer1_v  # layer 0 K, layer 0 V, layer 1 K, layer 1 V
    # The first 6 positions, into a sequence whose blocks are 5 and 0.
    dst = KVPool(2, num_blocks=12, block_size=BS, n_kv_heads=2, head_dim=4, dtype=torch.float16)
    dst_slots = block_slots([5, 0], 6, BS)
    assert dst_slots.tolist() == [20, 21, 22, 23, 0, 1]
    assert dst.import_slots(dst_slots, bytearray(payload))
    for layer in range(2):
        for got, want in ((dst.k[layer], src.k[layer]), (dst.v[layer], src.v[layer])):
            flat = got.view(-1, 2, 4)
            assert torch.equal(flat[dst_slots], want.view(-1, 2, 4)[src_slots[:6]])
            untouched = torch.ones(flat.shape[0], dtype=torch.bool)
            untouched[dst_slots] = False
            assert not flat[untouched].any()
    assert dst.import_slots(dst_slots, bytes(payload))  # a read-only buffer is read as well


@pytest.mark.parametrize("other", ["magic", "version", "dtype", "layers", "heads", "head_dim", "short", "truncated"])
def test_kv_bytes_of_another_layout_are_refused_and_nothing_is_written(other):
    pool, slots = filled_pool([1, 2], 6)
    payload = bytearray(pool.export_slots(slots))
    fields = list(KV_HEADER.unpack_from(payload))
    if other == "dtype":
        payload = bytearray(filled_pool([1, 2], 6, dtype=torch.float32)[0].export_slots(slots))
    elif other == "layers":
        payload = bytearray(filled_pool([1, 2], 6, n_layer=3)[0].export_slots(slots))
    elif other == "heads":
        payload = bytearray(filled_pool([1, 2], 6, n_kv=1, hd=8)[0].export_slots(slots))
    elif other == "head_dim":
        payload = bytearray(filled_pool([1, 2], 6, n_kv=4, hd=2)[0].export_slots(slots))
    elif other == "truncated":
        payload = payload[:-2]
    elif other != "short":
        fields[{"magic": 0, "version": 1}[other]] = b"LLMKVPFX" if other == "magic" else 2
        KV_HEADER.pack_into(payload, 0, *fields)
    dst = KVPool(2, num_blocks=12, block_size=BS, n_kv_heads=2, head_dim=4, dtype=torch.float16)
    want = 7 if other == "short" else 6  # asks for more positions than the bytes hold
    assert not dst.import_slots(block_slots([3, 4], want, BS), payload)
    assert not any(t.any() for t in dst.k + dst.v)
    assert not dst.import_slots(block_slots([3], 2, BS), b"LLMTORKV")  # shorter than a header


# -- the native kernel (native/attention.c) against the reference --------------------------

native = pytest.importorskip("localllm.runners.torch.native")


def test_the_native_kernels_are_built_where_a_compiler_is():
    import shutil
    import sysconfig

    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler here: the package is built without its native kernels")
    assert native.available(), (
        f"localllm._native is missing although a compiler is here; rebuild with `pip install -e .` "
        f"(Python headers in {sysconfig.get_paths()['include']}?)")


def scattered_batch(g, dtype, n_kv, hd, lengths, new, block_size=16, num_blocks=None):
    """A pool holding sequences of ``lengths`` positions in shuffled blocks, and the batch of
    their last ``new`` positions. An int8 (q8_0) pool gets its random K/V through write."""
    need = [-(-n // block_size) for n in lengths]
    num_blocks = num_blocks or sum(need) + 3
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for k in need:
        tables.append(ids[:k])
        ids = ids[k:]
    pool = KVPool(1, num_blocks, block_size, n_kv, hd, dtype=dtype)
    if pool.is_quantized:
        shape = (pool.num_slots, n_kv, hd)
        pool.write(0, torch.arange(pool.num_slots), torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    else:
        pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
        pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    return pool, [(t, n - m, m, m == 1) for t, n, m in zip(tables, lengths, new)]


@pytest.mark.skipif(not native.available(), reason="localllm._native was not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8], ids=["f32", "f16", "q8_0"])
@pytest.mark.parametrize("n_head,n_kv,hd", [(14, 2, 64), (4, 1, 256), (8, 8, 32), (4, 2, 8)])
@pytest.mark.parametrize("n_swa", [0, 37])
def test_native_attention_equals_the_reference(dtype, n_head, n_kv, hd, n_swa):
    g = torch.Generator().manual_seed(n_head * 1000 + hd + n_swa)
    # Decoding sequences of short and long contexts, a prefill chunk that starts mid-block,
    # a whole prompt at once, drafts being checked (a few rows at the end).
    lengths, new = [1, 17, 300, 1000, 45, 130], [1, 1, 1, 1, 29, 5]
    pool, seqs = scattered_batch(g, dtype, n_kv, hd, lengths, new)
    q = torch.randn(sum(new), n_head, hd, generator=g)
    scale = 1 / math.sqrt(hd)
    want = paged_attention(q, pool, 0, AttnBatch.build(seqs, 16, "cpu"), scale, n_swa)
    for threads in (1, 2, 5):
        batch = AttnBatch.build(seqs, 16, "cpu", native=True)
        got = native.paged_attention(q, pool.k[0], pool.v[0], batch.native_meta, scale, n_swa, threads,
                                     **pool_scales(pool))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def pool_scales(pool: KVPool) -> dict:
    """native.paged_attention's scale arguments for layer 0 of the pool (none for floats)."""
    return {"k_scales": pool.k_scales[0], "v_scales": pool.v_scales[0]} if pool.is_quantized else {}


@pytest.mark.skipif(not native.available(), reason="localllm._native was not built here")
@pytest.mark.parametrize("dtype", [torch.float16, torch.int8], ids=["f16", "q8_0"])
def test_batch_attend_uses_the_native_kernel_when_asked(dtype):
    g = torch.Generator().manual_seed(3)
    pool, seqs = scattered_batch(g, dtype, 2, 64, [70, 5], [1, 5])
    q = torch.randn(6, 14, 64, generator=g)
    ref = AttnBatch.build(seqs, 16, "cpu")
    fast = AttnBatch.build(seqs, 16, "cpu", native=True)
    assert ref.native_meta is None
    q_start, q_len, ctx_len, tables, table_start = (t.tolist() for t in fast.native_meta)
    assert (q_start, q_len, ctx_len, table_start) == ([0, 1], [1, 5], [70, 5], [0, 5])
    assert tables == seqs[0][0] + seqs[1][0]
    torch.testing.assert_close(fast.attend(q, pool, 0, 0.125), ref.attend(q, pool, 0, 0.125), atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not native.available(), reason="localllm._native was not built here")
@pytest.mark.parametrize("dtype", [torch.float16, torch.int8], ids=["f16", "q8_0"])
def test_native_decode_row_equals_its_row_in_a_verify_step(dtype):
    """As the reference's: bit for bit, a decoded query alone and as the first row of a verify
    step, whatever the number of drafts or the threads (greedy output does not change with
    drafting on)."""
    pool, table, q = decoding_pool(5, dtype)

    def attend(start, num, threads):
        batch = AttnBatch.build([(table, start, num, True)], 16, "cpu", native=True)
        return native.paged_attention(q[start:start + num], pool.k[0], pool.v[0], batch.native_meta, 0.125, 0,
                                      threads, **pool_scales(pool))

    for p in range(250, 290, 3):
        alone = attend(p, 1, 1)
        for k, threads in ((1, 1), (2, 2), (5, 1), (10, 3)):
            assert torch.equal(attend(p, 1 + k, threads)[:1], alone), (p, k)


@pytest.mark.skipif(not native.available(), reason="localllm._native was not built here")
@pytest.mark.parametrize("hd, n_swa", [(64, 0), (64, 37), (256, 37)])
def test_native_prompt_rows_equal_those_positions_computed_alone(hd, n_swa):
    """Bit for bit, with a sliding window too: the last row of a prompt's chunk, whatever its
    length, equals that position computed alone, as a restart's disk prefix hit computes it
    (the window's first key had set where the lanes began, and Gemma 3 answered otherwise
    after a restart)."""
    g = torch.Generator().manual_seed(hd + n_swa)
    n_head, n_kv, length = 4, 1, 300
    pool = KVPool(1, num_blocks=24, block_size=16, n_kv_heads=n_kv, head_dim=hd, dtype=torch.float16)
    table = list(range(24))[::-1]
    pool.write(0, block_slots(table, length, 16), torch.randn(length, n_kv, hd, generator=g),
               torch.randn(length, n_kv, hd, generator=g))
    q = torch.randn(length, n_head, hd, generator=g)

    def attend(start, num, threads):
        batch = AttnBatch.build([(table, start, num, num == 1)], 16, "cpu", native=True)
        return native.paged_attention(q[start:start + num], pool.k[0], pool.v[0], batch.native_meta, hd ** -0.5,
                                      n_swa, threads)

    for p in (150, 203, 299):
        alone = attend(p, 1, 1)
        for num, threads in ((2, 1), (5, 2), (9, 1), (64, 2), (p + 1, 1)):
            assert torch.equal(attend(p + 1 - num, num, threads)[-1:], alone), (p, num)


@pytest.mark.skipif(not native.available(), reason="localllm._native was not built here")
def test_native_attention_refuses_a_pool_it_cannot_read():
    g = torch.Generator().manual_seed(6)
    pool, seqs = scattered_batch(g, torch.bfloat16, 2, 64, [20], [1])
    batch = AttnBatch.build(seqs, 16, "cpu", native=True)
    with pytest.raises(ValueError, match="float16, float32 or int8"):
        native.paged_attention(torch.randn(1, 14, 64), pool.k[0], pool.v[0], batch.native_meta, 0.125)
    q8, seqs = scattered_batch(g, torch.int8, 2, 64, [20], [1])
    with pytest.raises(ValueError, match="needs its k_scales and v_scales"):
        native.paged_attention(torch.randn(1, 14, 64), q8.k[0], q8.v[0], batch.native_meta, 0.125)
    with pytest.raises(ValueError, match="contiguous float16 of shape"):
        native.paged_attention(torch.randn(1, 14, 64), q8.k[0], q8.v[0], batch.native_meta, 0.125,
                               k_scales=q8.k_scales[0].float(), v_scales=q8.v_scales[0].float())


@pytest.mark.skipif(not native.available(), reason="localllm._native was not built here")
def test_kernels_built_from_older_sources_are_never_called(monkeypatch):
    """A build whose ABI is not this code's (one from before the q8_0 pool, say) would misread
    the call: the library counts as missing, and a call says how to rebuild it."""
    g = torch.Generator().manual_seed(7)
    pool, seqs = scattered_batch(g, torch.int8, 2, 64, [20], [1])
    batch = AttnBatch.build(seqs, 16, "cpu", native=True)
    built = native.ABI_VERSION
    monkeypatch.setattr(native, "ABI_VERSION", built + 1)
    native._load.cache_clear()
    try:
        assert native.library() is None and not native.available() and native.is_outdated()
        assert f"was built from older sources (ABI {built}, this code needs {built + 1})" in native.why_unavailable()
        with pytest.raises(RuntimeError, match=r"older sources .*`pip install -e \.`"):
            native.paged_attention(torch.randn(1, 14, 64), pool.k[0], pool.v[0], batch.native_meta, 0.125,
                                   k_scales=pool.k_scales[0], v_scales=pool.v_scales[0])
    finally:
        monkeypatch.undo()
        native._load.cache_clear()
