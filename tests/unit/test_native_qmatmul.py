"""native/qmatmul.c against the plain computation: y = x W^T with W read from its GGUF blocks
(Q4_0, Q5_0, Q8_0 written by the gguf package's own quantizer) and x quantized to 8-bit blocks
as llama.cpp does. No model needed."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from localllm.runners.torch import native  # noqa: E402
from localllm.runners.torch.quant import BlockLinear  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available(), reason="localllm._native was not built here")
KINDS = ["Q4_0", "Q5_0", "Q8_0"]
ROWS8 = ["Q4_0R", "Q5_0R", "Q8_0R", "Q4_KR", "Q6_KR"]


def blocks_of(w: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind]))


def q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp's Q8_0 activations: per 32, scale max|x| / 127 kept as float16, values
    rounded to nearest even."""
    g = x.reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.round(g * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (q * (amax / 127).half().float()).reshape(x.shape)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_gives_the_gguf_packages_weights(kind):
    w = np.random.default_rng(0).standard_normal((24, 128)).astype(np.float32)
    blocks = blocks_of(w, kind)
    want = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[kind])
    assert torch.equal(native.dequantize(blocks, kind, 128), torch.from_numpy(want))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_qmatmul_is_the_product_of_the_quantized_activations_and_weights(kind, m):
    rng = np.random.default_rng(m)
    n, k = 200, 256  # 200 rows: not a multiple of the 8-row runs the threads take
    w = rng.standard_normal((n, k)).astype(np.float32)
    blocks = blocks_of(w, kind)
    wq = native.dequantize(blocks, kind, k).double()
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    x[0, :32] = 0  # an all-zero block
    want = (q8_blocks(x).double() @ wq.t()).float()
    for threads in (1, 2, 3):
        got = native.qmatmul(x, blocks, kind, n_threads=threads)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(native.qmatmul(x, blocks, kind, force_scalar=True), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kind):
    """Decoding one token and checking it among drafts must give the same logits (greedy
    output does not change with drafting on)."""
    rng = np.random.default_rng(7)
    blocks = blocks_of(rng.standard_normal((64, 96)).astype(np.float32), kind)
    x = torch.from_numpy(rng.standard_normal((7, 96)).astype(np.float32))
    alone = torch.cat([native.qmatmul(x[i:i + 1], blocks, kind) for i in range(7)])
    assert torch.equal(native.qmatmul(x, blocks, kind), alone)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_interleaved_by_eight_are_the_product_alike_on_every_tile_and_pack_back(kind):
    """Q4_0R / Q5_0R / Q8_0R (native/rows8.c) hold the file's weights 8 rows at a time: they
    pack back to the file's bytes, give the quantized product, the same bits for a row of x
    alone or among others and on any thread count, and two matrices stacked (a fused Q, K, V)
    give each one's own bits. BlockLinear keeps a matrix of 8k rows so, on every tier."""
    rng = np.random.default_rng(21)
    n, k = 48, 320
    blocks = blocks_of(rng.standard_normal((n, k)).astype(np.float32), kind)
    rows8 = native.repack(blocks, kind, packed=kind + "R")
    assert not torch.equal(rows8, blocks) and rows8.shape == blocks.shape
    assert torch.equal(native.repack(rows8, kind, reverse=True, packed=kind + "R"), blocks)
    x = torch.from_numpy(rng.standard_normal((9, k)).astype(np.float32))
    x[1, 32:64] = 0  # an all-zero block
    want = (q8_blocks(x).double() @ native.dequantize(blocks, kind, k).double().t()).float()
    got = native.qmatmul(x, rows8, kind + "R")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    rows_alike_and_kept(blocks, kind, rows8, x, got)


def rows_alike_and_kept(blocks, kind: str, rows8, x, got) -> None:
    """What every layout of 8 rows interleaved holds to (48 rows of ``kind``'s ``blocks``,
    ``rows8`` made of them, ``got`` their product with the 9 rows of x): a row of x alone gives
    its bits among others, on any thread count; two matrices stacked (a fused layer) give each
    one's bits; BlockLinear keeps the matrix so and gives the file's blocks back, and keeps a
    matrix whose rows are not a multiple of 8 in another layout, which repack refuses."""
    alone = torch.cat([native.qmatmul(x[i:i + 1], rows8, kind + "R") for i in range(9)])
    assert torch.equal(got, alone)
    for threads in (1, 2, 3):
        assert torch.equal(native.qmatmul(x, rows8, kind + "R", n_threads=threads), got)
    top, rest = (native.repack(blocks[a:b].contiguous(), kind, packed=kind + "R") for a, b in ((0, 16), (16, 48)))
    assert torch.equal(native.qmatmul(x, torch.cat([top, rest]), kind + "R"), got)
    layer = BlockLinear(blocks, kind)
    assert layer.kind == kind + "R" and torch.equal(layer.tensors()["blocks"], blocks)
    assert torch.equal(layer(x), got)
    assert BlockLinear(blocks[:44].contiguous(), kind).kind != kind + "R"  # not a multiple of 8 rows
    with pytest.raises(ValueError, match="cannot be repacked"):
        native.repack(blocks[:44].contiguous(), kind, packed=kind + "R")


def test_block_linear_adds_its_bias_and_takes_any_leading_shape():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 64)).astype(np.float32)
    bias = torch.randn(40)
    layer = BlockLinear(blocks_of(w, "Q8_0"), "Q8_0", bias=bias)
    x = torch.randn(5, 64)
    assert layer.in_features == 64
    torch.testing.assert_close(layer(x), native.qmatmul(x, layer.blocks, layer.kind) + bias)
    again = BlockLinear.from_tensors(**{k if k != "b" else "bias": v for k, v in layer.tensors().items()})
    assert again.kind == layer.kind == "Q8_0R" and torch.equal(again(x), layer(x))


def test_bad_shapes_are_refused_with_a_clear_error():
    blocks = blocks_of(np.ones((8, 64), dtype=np.float32), "Q5_0")
    with pytest.raises(ValueError, match="do not hold"):
        native.qmatmul(torch.ones(1, 96), blocks, "Q5_0")
    with pytest.raises(ValueError, match="8 rows at a time: 12 rows"):  # interleaved rows: whole groups only
        native.qmatmul(torch.ones(1, 64), blocks_of(np.ones((12, 64), dtype=np.float32), "Q5_0"), "Q5_0R")
    with pytest.raises(ValueError, match=r"8 rows at a time: 12 rows .*keep such a matrix as Q4_K"):
        native.qmatmul(torch.ones(1, 256), torch.zeros(12, 148, dtype=torch.uint8), "Q4_KR")
    with pytest.raises(ValueError, match="do not hold"):  # Q4_KR's rows are 148 bytes a super-block, not 144
        native.qmatmul(torch.ones(1, 256), torch.zeros(8, 144, dtype=torch.uint8), "Q4_KR")


vector = pytest.mark.skipif(not native.vector_loops(), reason="the CPU has no AVX2")
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]


def k_blocks(rng, n: int, k: int, kind: str) -> torch.Tensor:
    """Random super-blocks: every byte pattern is a valid K-quant block once its float16 scales
    are finite, so random bytes reach every scale, min and weight value."""
    raw = rng.integers(0, 256, (n, k // 256, native.SUPER_BYTES[kind]), dtype=np.uint8)
    for at in ([208] if kind == "Q6_K" else [0, 2]):  # d (and dmin)
        raw[:, :, at:at + 2] = (rng.random((n, k // 256, 1)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1).copy())


def q8k_values(x: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp's Q8_K activations (quantize_row_q8_K_ref): per 256, d = max / -127 with
    max the value of largest magnitude, values round(x / d) to nearest even, capped at 127."""
    g = x.reshape(x.shape[0], -1, 256)
    mx = g.gather(-1, g.abs().argmax(-1, keepdim=True))
    iscale = torch.where(mx != 0, -127.0 / mx, torch.zeros_like(mx))
    q = torch.round(iscale * g).clamp(max=127)
    return (q * torch.where(mx != 0, 1.0 / iscale, torch.zeros_like(iscale))).reshape(x.shape)


@pytest.mark.parametrize("kind", K_QUANTS)
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_k_quants_are_the_product_of_q8k_activations_and_the_files_weights(kind, m):
    rng = np.random.default_rng(m)
    n, k = 70, 768
    blocks = k_blocks(rng, n, k, kind)
    wq = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[kind])).double()
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    x[0, :256] = 0  # an all-zero super-block
    want = (q8k_values(x).double() @ wq.t()).float()
    for threads in (1, 2, 3):
        torch.testing.assert_close(native.qmatmul(x, blocks, kind, n_threads=threads), want, atol=1e-4, rtol=1e-5)
    alone = torch.cat([native.qmatmul(x[i:i + 1], blocks, kind) for i in range(m)])
    assert torch.equal(native.qmatmul(x, blocks, kind), alone)
    assert torch.equal(native.qmatmul(x, blocks, kind, force_scalar=True), alone)  # this tier's loop: the same bits


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quants_interleaved_by_eight_are_the_product_alike_and_pack_back(kind):
    """Q4_KR / Q6_KR (native/kquant.c) hold the file's super-blocks 8 rows at a time (Q4_K's
    6-bit scales and mins unpacked to bytes): they pack back to the file's bytes, give the
    product of the Q8_K activations and the file's weights, one row's bits alone or among others,
    on any thread count and stacked (a fused layer), and the lanes contract's result within
    rounding. BlockLinear keeps a matrix of 8k rows so."""
    rng = np.random.default_rng(22)
    n, k = 48, 768
    blocks = k_blocks(rng, n, k, kind)
    rows8 = native.repack(blocks, kind, packed=kind + "R")
    assert rows8.shape == (n, native.row_bytes(kind + "R", k)) and rows8.shape[1] == (444 if kind == "Q4_K" else 630)
    assert torch.equal(native.repack(rows8, kind, reverse=True, packed=kind + "R"), blocks)
    wq = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[kind])).double()
    x = torch.from_numpy(rng.standard_normal((9, k)).astype(np.float32))
    x[1, 256:512] = 0  # an all-zero super-block
    got = native.qmatmul(x, rows8, kind + "R")
    torch.testing.assert_close(got, (q8k_values(x).double() @ wq.t()).float(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got, native.qmatmul(x, blocks, kind), atol=1e-4, rtol=1e-5)
    assert torch.equal(got, native.qmatmul(x, rows8, kind + "R", force_scalar=True))
    rows_alike_and_kept(blocks, kind, rows8, x, got)


@vector
@pytest.mark.parametrize("kind,packed", [("Q4_0", "Q4_0P"), ("Q5_0", "Q5_0P"), ("Q5_0", "Q5_0X")])
def test_blocks_in_pairs_give_the_same_bits_and_pack_back(kind, packed):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((90, 384)).astype(np.float32)
    blocks = blocks_of(w, kind)
    pairs = native.repack(blocks, kind, packed=packed)
    assert not torch.equal(pairs, blocks)
    assert torch.equal(native.repack(pairs, kind, reverse=True, packed=packed), blocks)
    for m in (1, 2, 4, 5, 12):
        x = torch.from_numpy(rng.standard_normal((m, 384)).astype(np.float32))
        for threads in (1, 2):
            assert torch.equal(native.qmatmul(x, pairs, packed, n_threads=threads),
                               native.qmatmul(x, blocks, kind, n_threads=threads))
    layer = BlockLinear(blocks, kind)
    assert layer.kind == native.pairs_kind(kind) and torch.equal(layer.tensors()["blocks"], blocks)


@vector
def test_q5_0_pair_layouts_differ_only_in_the_order_of_the_high_bits():
    blocks = blocks_of(np.random.default_rng(6).standard_normal((8, 128)).astype(np.float32), "Q5_0")
    wide, narrow = (native.repack(blocks, "Q5_0", packed=p).view(-1, 44) for p in ("Q5_0P", "Q5_0X"))
    assert torch.equal(wide[:, :4], narrow[:, :4]) and torch.equal(wide[:, 12:], narrow[:, 12:])
    assert not torch.equal(wide[:, 4:12], narrow[:, 4:12])
    bits = lambda t: np.unpackbits(t.numpy(), axis=1, bitorder="little")  # (pairs, 64): bit i of the 8 bytes
    lane = np.arange(64)
    assert (bits(narrow[:, 4:12])[:, 8 * (lane % 8) + lane // 8] == bits(wide[:, 4:12])[:, lane]).all()
    assert native.pairs_kind("Q5_0") == ("Q5_0P" if native.wide_kernels() else "Q5_0X")
    assert native.pairs_kind("Q8_0") is None


@vector
def test_odd_shapes_are_refused_for_the_wide_layouts():
    with pytest.raises(ValueError, match="cannot be repacked"):
        native.repack(blocks_of(np.ones((4, 96), dtype=np.float32), "Q5_0"), "Q5_0")  # 3 blocks a row
    assert BlockLinear(blocks_of(np.ones((4, 96), dtype=np.float32), "Q5_0"), "Q5_0").kind == "Q5_0"
    blocks = k_blocks(np.random.default_rng(0), 4, 512, "Q6_K")
    with pytest.raises(ValueError, match="do not hold"):
        native.qmatmul(torch.ones(1, 384), blocks, "Q6_K")


@vector
@pytest.mark.parametrize("kind", KINDS + K_QUANTS + ["Q4_0P", "Q5_0P", "Q5_0X"] + ROWS8)
def test_every_tile_of_rows_gives_the_portable_loops_bits(kind):
    """The vector loops take the rows of x 4 at a time and have a loop for each tile size (1, 2,
    3, 4), and past 4 rows tiles of several weight rows: every size, and an odd last block,
    gives the bits of the portable loop (pairs: of the file's blocks there; 8 rows interleaved:
    of their own portable loop, which sums a row in one order)."""
    rng = np.random.default_rng(11)
    file_kind = native.UNPACKED.get(kind, kind)
    k = 768 if file_kind in K_QUANTS else (704 if kind in native.PACKED_TYPES and kind not in ROWS8 else 736)
    n = 40 if kind in ROWS8 else 37  # 8 rows interleaved: whole groups (37: a part run of 8 rows)
    if file_kind in K_QUANTS:
        blocks = k_blocks(rng, n, k, file_kind)
    else:
        blocks = blocks_of(rng.standard_normal((n, k)).astype(np.float32), file_kind)
    weights = native.repack(blocks, file_kind, packed=kind) if file_kind != kind else blocks
    x = torch.from_numpy(rng.standard_normal((11, k)).astype(np.float32))
    for m in range(12):  # 0: an empty batch gives an empty result
        if kind in ROWS8:
            want = native.qmatmul(x[:m], weights, kind, force_scalar=True)
        else:
            want = native.qmatmul(x[:m], blocks, file_kind, force_scalar=True)
        for threads in (1, 2):
            assert torch.equal(native.qmatmul(x[:m], weights, kind, n_threads=threads), want), (m, threads)


@vector
@pytest.mark.parametrize("kind", KINDS + ["Q5_0P"] + K_QUANTS + ROWS8)
def test_many_rows_of_x_against_long_rows_give_the_portable_loops_bits(kind):
    """Past 4 rows of x the AVX-512 loops make x ready in chunks that a core's cache holds
    (512 KiB: 4 rows of x at this length) and unpack each tile of weight rows once a chunk:
    rows of x in three chunks, the last a part, and an odd last block give the portable loop's
    bits. So many rows are quantized over the threads (the K-quants' too)."""
    rng = np.random.default_rng(12)
    file_kind = native.UNPACKED.get(kind, kind)
    n = 16 if kind in ROWS8 else 9
    if file_kind in K_QUANTS:
        k = 256 * 19
        blocks = k_blocks(rng, n, k, file_kind)
    else:
        k = 32 * (684 if kind == "Q5_0P" else 683)  # 683 blocks: an odd last one
        blocks = blocks_of(rng.standard_normal((n, k)).astype(np.float32), file_kind)
    weights = native.repack(blocks, file_kind, packed=kind) if kind != file_kind else blocks
    x = torch.from_numpy(rng.standard_normal((11, k)).astype(np.float32))
    want = native.qmatmul(x, weights if kind in ROWS8 else blocks, kind if kind in ROWS8 else file_kind,
                          force_scalar=True)
    for threads in (1, 2):
        assert torch.equal(native.qmatmul(x, weights, kind, n_threads=threads), want), threads


@pytest.mark.parametrize("threads", [1, 2])
def test_x_is_quantized_alike_on_every_tier_ties_and_nans_included(threads):
    """x's 8-bit blocks are made by the vector loop where the tier has one, over the threads
    when x has many rows: the same bytes and scales as the portable loop's, values that fall
    exactly half-way rounded to even (127 first makes the block's scale 1), NaNs passed over
    when the block's largest magnitude is found. Read back through an identity in Q8_0."""
    k, m = 1024, 40  # 40 x 32 blocks: enough to share out
    rng = np.random.default_rng(13)
    x = rng.standard_normal((m, k)).astype(np.float32) * 40
    ties = x[:20].reshape(20, -1, 32)
    ties[:, :, 0] = 127
    ties[:, :, 1:] = rng.integers(-126, 126, ties[:, :, 1:].shape) + 0.5
    x[20, 30] = np.nan  # in the last 8 of its block
    eye = blocks_of(np.eye(k, dtype=np.float32)[:96], "Q8_0")  # y[:, n] reads x's value n
    xt = torch.from_numpy(x)
    got = native.qmatmul(xt, eye, "Q8_0", n_threads=threads)
    want = native.qmatmul(xt, eye, "Q8_0", force_scalar=True)
    assert torch.equal(got[:20], want[:20]) and torch.equal(got[21:], want[21:])
    others = [n for n in range(96) if n != 30]  # (the NaN's own byte is whatever its conversion gives)
    assert torch.equal(got[20, others], want[20, others])
    one = blocks_of(np.ones((1, 32), dtype=np.float32), "Q8_0")[0, :2].view(torch.float16).item()
    assert torch.equal(got[:20, 1:32], torch.from_numpy((127 * np.rint(ties[:, 0, 1:])) * np.float32(one)))
