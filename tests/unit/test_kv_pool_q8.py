"""The q8_0 KV pool (int8 K/V, a float16 scale per token and KV head): how rows are quantized,
the bytes it takes (measured from its tensors), attention over it as over the dequantized
values, and its bytes for the prefix cache: they round-trip, and a pool of another dtype
never reads them (nor a q8_0 pool float16 bytes)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from localllm.runners.torch.attention import (  # noqa: E402
    KV_HEADER, KV_MAGIC, AttnBatch, KVPool, block_slots, dequantize_rows, paged_attention, quantize_rows)

from test_torch_attention import filled_pool  # noqa: E402  (tests/unit is on the path)

BS = 4


def test_rows_quantize_symmetrically_with_one_float16_scale_each():
    x = torch.tensor([[127.0, -63.5, 0.0, 1.0],  # scale 1: -63.5 rounds to even
                      [0.0, 0.0, 0.0, 0.0],  # a zero row: scale 0, q 0
                      [-254.0, 1.0, 3.0, 2.5],  # scale 2: 0.5 -> 0, 1.5 -> 2, 1.25 -> 1
                      [0.1, 0.2, -0.3, 0.05]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16
    assert scale[:3].tolist() == [1.0, 0.0, 2.0]
    assert scale[3].item() == torch.tensor(0.3 / 127).half().item()
    assert q[:3].tolist() == [[127, -64, 0, 1], [0, 0, 0, 0], [-127, 0, 2, 1]]
    s = scale[3].float()
    assert q[3].tolist() == [round(v / s.item()) for v in torch.tensor([0.1, 0.2, -0.3, 0.05]).tolist()]


def test_dequantized_rows_are_within_half_a_step_and_exact_in_float32():
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * 4
    q, scale = quantize_rows(x)
    assert q.abs().max().item() == 127  # the largest value of each row maps to +-127
    back = dequantize_rows(q, scale)
    assert back.dtype == torch.float32
    # The float16 scale may sit a little below absmax / 127: the clamp then costs at most that.
    step = scale.float()[..., None]
    assert ((back - x).abs() <= step * 0.5 + x.abs().amax(-1, keepdim=True) * 2 ** -10).all()
    assert torch.equal(back.double(), q.double() * scale.double()[..., None])  # q * scale has no rounding


def test_pool_bytes_are_measured_and_count_the_scales():
    # Qwen2.5-0.5B's KV: 24 layers, 2 KV heads of 64.
    f16 = KVPool(24, num_blocks=3, block_size=16, n_kv_heads=2, head_dim=64, dtype=torch.float16)
    q8 = KVPool(24, num_blocks=3, block_size=16, n_kv_heads=2, head_dim=64, dtype=torch.int8)
    assert f16.k_scales == [] and f16.nbytes == 48 * 2 * 24 * 2 * 64 * 2
    assert [t.shape for t in (q8.k[0], q8.k_scales[0])] == [(3, 16, 2, 64), (3, 16, 2)]
    assert {t.dtype for t in q8.k + q8.v} == {torch.int8} and {t.dtype for t in q8.k_scales + q8.v_scales} == {
        torch.float16}
    assert q8.nbytes == 48 * 2 * 24 * (2 * 64 + 2 * 2)
    assert (f16.bytes_per_token, q8.bytes_per_token) == (12288, 6336)
    assert f16.bytes_per_token / q8.bytes_per_token >= 1.9  # 128 / 66


def test_write_quantizes_at_the_slots_and_touches_nothing_else():
    pool = KVPool(1, num_blocks=4, block_size=BS, n_kv_heads=2, head_dim=8, dtype=torch.int8)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    slots = torch.tensor([13, 2, 7])
    pool.write(0, slots, k.bfloat16(), v)  # the activations' dtype does not matter
    for got, scales, x in ((pool.k[0], pool.k_scales[0], k.bfloat16()), (pool.v[0], pool.v_scales[0], v)):
        q, scale = quantize_rows(x)
        assert torch.equal(got.view(-1, 2, 8)[slots], q) and torch.equal(scales.view(-1, 2)[slots], scale)
        untouched = torch.ones(pool.num_slots, dtype=torch.bool)
        untouched[slots] = False
        assert not got.view(-1, 2, 8)[untouched].any() and not scales.view(-1, 2)[untouched].any()
    k_back, v_back = pool.gather(0, slots, torch.float64)
    assert k_back.dtype == torch.float64
    assert torch.equal(v_back, dequantize_rows(*quantize_rows(v)).double())


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("n_swa", [0, 5])
def test_attention_over_a_q8_pool_is_attention_over_its_dequantized_values(n_swa, exact):
    """The reference over int8 K/V equals it over a float32 pool holding q * scale (the same
    numbers), and stays near attention over the unquantized values."""
    g = torch.Generator().manual_seed(2)
    n_head, n_kv, hd = 4, 2, 16
    tables, lengths, new = [[9, 2, 14], [5, 0]], [11, 7], [1, 3]
    q8 = KVPool(1, num_blocks=16, block_size=BS, n_kv_heads=n_kv, head_dim=hd, dtype=torch.int8)
    f32 = KVPool(1, num_blocks=16, block_size=BS, n_kv_heads=n_kv, head_dim=hd, dtype=torch.float32)
    raw = KVPool(1, num_blocks=16, block_size=BS, n_kv_heads=n_kv, head_dim=hd, dtype=torch.float32)
    for table, n in zip(tables, lengths):
        slots = block_slots(table, n, BS)
        k, v = torch.randn(n, n_kv, hd, generator=g), torch.randn(n, n_kv, hd, generator=g)
        q8.write(0, slots, k, v)
        raw.write(0, slots, k, v)
        f32.write(0, slots, dequantize_rows(*quantize_rows(k)), dequantize_rows(*quantize_rows(v)))
    batch = AttnBatch.build([(t, n - m, m, exact) for t, n, m in zip(tables, lengths, new)], BS, "cpu")
    q = torch.randn(sum(new), n_head, hd, generator=g)
    scale = 1 / math.sqrt(hd)
    got = paged_attention(q, q8, 0, batch, scale, n_swa)
    assert torch.equal(got, paged_attention(q, f32, 0, batch, scale, n_swa))
    # 8 bits per value: outputs move by about 1e-2 of their size.
    torch.testing.assert_close(got, paged_attention(q, raw, 0, batch, scale, n_swa), atol=3e-2, rtol=0)


def filled_q8_pool(table, num_tokens, dtype=torch.int8, n_layer=2, n_kv=2, hd=4):
    return filled_pool(table, num_tokens, n_layer=n_layer, n_kv=n_kv, hd=hd, dtype=dtype)


def test_q8_kv_bytes_carry_the_scales_and_round_trip_into_other_blocks():
    src, src_slots = filled_q8_pool([9, 2], 7)
    payload = src.export_slots(src_slots)
    # 32 header bytes; scales: 2 layers x (K, V) x 7 positions x 2 heads x 2 bytes; then
    # int8 K/V: 2 x 2 x 7 x 2 x 4 bytes.
    assert payload.nbytes == 32 + 2 * 2 * 7 * 2 * 2 + 2 * 2 * 7 * 2 * 4
    assert KV_HEADER.unpack_from(payload) == (KV_MAGIC, 1, 4, 2, 2, 4, 7)
    body = bytes(payload)[32:]
    layer0_k_scales = src.k_scales[0].view(-1, 2)[src_slots].numpy().tobytes()
    assert body[:len(layer0_k_scales)] == layer0_k_scales
    layer1_v = src.v[1].view(-1, 2, 4)[src_slots].numpy().tobytes()
    assert body[-len(layer1_v):] == layer1_v  # scales, then layer 0 K, 0 V, 1 K, 1 V
    dst = KVPool(2, num_blocks=12, block_size=BS, n_kv_heads=2, head_dim=4, dtype=torch.int8)
    dst_slots = block_slots([5, 0], 6, BS)
    assert dst.import_slots(dst_slots, bytes(payload))
    for layer in range(2):
        for got, want, row in ((dst.k[layer], src.k[layer], (2, 4)), (dst.v[layer], src.v[layer], (2, 4)),
                               (dst.k_scales[layer], src.k_scales[layer], (2,)),
                               (dst.v_scales[layer], src.v_scales[layer], (2,))):
            flat = got.view(-1, *row)
            assert torch.equal(flat[dst_slots], want.view(-1, *row)[src_slots[:6]])
            untouched = torch.ones(flat.shape[0], dtype=torch.bool)
            untouched[dst_slots] = False
            assert not flat[untouched].any()


@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float16, torch.int8), (torch.int8, torch.float16),
                                                 (torch.float32, torch.int8)])
def test_kv_bytes_of_another_dtype_are_refused_and_nothing_is_written(src_dtype, dst_dtype):
    """An f16 pool's bytes are never read into a q8_0 pool, nor the other way round."""
    src, slots = filled_q8_pool([1, 2], 6, dtype=src_dtype)
    payload = src.export_slots(slots)
    dst = KVPool(2, num_blocks=12, block_size=BS, n_kv_heads=2, head_dim=4, dtype=dst_dtype)
    assert not dst.import_slots(block_slots([3, 4], 6, BS), payload)
    assert not any(t.any() for t in dst.k + dst.v + dst.k_scales + dst.v_scales)


def test_truncated_q8_bytes_are_refused():
    src, slots = filled_q8_pool([1, 2], 6)
    payload = bytes(src.export_slots(slots))
    dst = KVPool(2, num_blocks=12, block_size=BS, n_kv_heads=2, head_dim=4, dtype=torch.int8)
    for cut in (payload[:-1], payload[:-6 * 2 * 2 * 4]):  # a byte short; the last layer's V missing
        assert not dst.import_slots(block_slots([3, 4], 6, BS), cut)
    assert not any(t.any() for t in dst.k + dst.v + dst.k_scales + dst.v_scales)


def test_a_pool_of_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="float16, float32, bfloat16 or int8"):
        KVPool(1, 2, BS, 1, 4, dtype=torch.uint8)


def test_smoothed_keys_keep_q_dot_k_and_the_small_channels_precision():
    """Keys whose channel 5 (and its rope partner 5 + 32) is 30 times the others, as a K bias
    makes them: smoothing by the channels' sizes keeps the attention (q . k is unchanged,
    the queries carry the factors) and cuts its error against float32 several times."""
    g = torch.Generator().manual_seed(0)
    n_kv, hd, n_head, n = 2, 64, 4, 40
    size = torch.ones(n_kv, hd)
    size[:, [5, 37]] = 30.0
    k = torch.randn(n, n_kv, hd, generator=g) * size
    v = torch.randn(n, n_kv, hd, generator=g)
    q = torch.randn(n, n_head, hd, generator=g)
    table = list(range(n // BS))
    batch = AttnBatch.build([(table, 0, n, False)], BS, "cpu")
    out = {}
    for name, dtype, smooth in (("f32", torch.float32, None), ("q8", torch.int8, None),
                                ("q8 smoothed", torch.int8, size.sqrt())):
        pool = KVPool(1, n // BS, BS, n_kv, hd, dtype)
        if smooth is not None:
            pool.set_key_smoothing([smooth])
        pool.write(0, batch.slots, k, v)
        out[name] = batch.attend(q, pool, 0, 1 / math.sqrt(hd))
    plain = (out["q8"] - out["f32"]).abs().max().item()
    smoothed = (out["q8 smoothed"] - out["f32"]).abs().max().item()
    assert smoothed < plain / 3, (plain, smoothed)
    with pytest.raises(ValueError, match="only a q8_0 pool"):
        KVPool(1, 2, BS, n_kv, hd, torch.float16).set_key_smoothing([size])
