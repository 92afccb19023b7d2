"""The torch runner's device paths. The layouts are checked here on the CPU; the tests marked
``cuda`` run the CUDA kernels themselves and are skipped where torch sees no CUDA device."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from localllm.runners.torch import quant  # noqa: E402
from localllm.runners.torch.attention import AttnBatch, KVPool, paged_attention  # noqa: E402

cuda = pytest.mark.cuda


def random_groups(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    scale = torch.rand(rows, cols // 32, generator=g) * 0.02 + 0.001
    minimum = torch.rand(rows, cols // 32, generator=g) * 0.1
    w = (q.float().reshape(rows, cols // 32, 32) * scale[..., None] - minimum[..., None]).reshape(rows, cols)
    return q, scale, minimum, w


def test_nibbles_pack_two_columns_a_byte_the_even_one_high():
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 7, 8]])
    packed = quant.pack_nibbles(q)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x12, 0x34], [0xF0, 0x78]]
    q = random_groups(16, 64)[0]
    packed = quant.pack_nibbles(q)
    unpacked = torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(16, 64)
    assert torch.equal(unpacked, q)


@pytest.mark.parametrize("shape,tiles", [
    ((896, 896), 8), ((4864, 896), 8), ((896, 4864), 8), ((128, 896), 8),  # Qwen2.5-0.5B
    ((640, 640), 8), ((2048, 640), 8), ((640, 2048), 8), ((256, 640), 8),  # Gemma 3 270M
    ((64, 96), 2), ((64, 192), 4), ((63, 256), None), ((64, 40), None),
])
def test_cuda_kernel_tiling_takes_the_shapes_it_can(shape, tiles):
    assert quant.cuda_inner_k_tiles(*shape) == tiles


def test_scales_and_zeros_give_the_groups_weights():
    q, scale, minimum, w = random_groups(8, 64)
    sz = quant.Int4Linear.scales_and_zeros(scale, minimum)
    assert sz.shape == (2, 8, 2) and sz.dtype == torch.bfloat16
    s, z = sz[..., 0].float().t(), sz[..., 1].float().t()  # (rows, groups)
    rebuilt = ((q.float().reshape(8, 2, 32) - 8) * s[..., None] + z[..., None]).reshape(8, 64)
    torch.testing.assert_close(rebuilt, w, atol=2e-3, rtol=1e-2)  # bfloat16 scales


@cuda
def test_cuda_int4_layer_multiplies_like_its_float_weights():
    q, scale, minimum, w = random_groups(896, 4864, seed=1)
    layer = quant.Int4Linear.from_groups(q, scale, minimum, device="cuda")
    assert not layer.on_cpu and layer.packed.is_cuda
    x = torch.randn(7, 4864, generator=torch.Generator().manual_seed(2))
    want = x @ w.t()
    got = layer(x.cuda()).float().cpu()
    cpu = quant.Int4Linear.from_groups(q, scale, minimum)(x).float()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.01, f"relative error {rel:.4f}"  # bfloat16 activations, scales and outputs
    assert ((got - cpu).norm() / cpu.norm()).item() < 0.01


@cuda
def test_reference_attention_runs_on_cuda_like_on_the_cpu():
    g = torch.Generator().manual_seed(4)
    pools = {}
    for dev in ("cpu", "cuda"):
        pool = KVPool(1, 12, 16, 2, 64, dtype=torch.float16, device=dev)
        pools[dev] = pool
    k = torch.randn(pools["cpu"].k[0].shape, generator=g)
    v = torch.randn(pools["cpu"].v[0].shape, generator=g)
    q = torch.randn(6, 14, 64, generator=g)
    seqs = [([3, 7, 1, 9], 50, 1, True), ([0, 2], 20, 5, False)]
    outs = {}
    for dev, pool in pools.items():
        pool.k[0].copy_(k)
        pool.v[0].copy_(v)
        outs[dev] = paged_attention(q.to(dev), pool, 0, AttnBatch.build(seqs, 16, dev), 0.125, 0).cpu()
    torch.testing.assert_close(outs["cuda"], outs["cpu"], atol=1e-4, rtol=1e-3)


@cuda
def test_a_q8_pool_works_on_cuda_like_on_the_cpu():
    """The q8_0 pool's int8 + scale layout through the reference path on CUDA: the same bytes
    (quantization rounds alike on both), attention as on the CPU, and prefix-cache bytes that
    a CPU pool reads back."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(12 * 16, 2, 64, generator=g)
    v = torch.randn(12 * 16, 2, 64, generator=g)
    q = torch.randn(6, 14, 64, generator=g)
    seqs = [([3, 7, 1, 9], 50, 1, True), ([0, 2], 20, 5, False)]
    pools, outs = {}, {}
    for dev in ("cpu", "cuda"):
        pool = KVPool(1, 12, 16, 2, 64, dtype=torch.int8, device=dev)
        pool.write(0, torch.arange(12 * 16, device=dev), k.to(dev), v.to(dev))
        pools[dev] = pool
        outs[dev] = paged_attention(q.to(dev), pool, 0, AttnBatch.build(seqs, 16, dev), 0.125, 0).cpu()
    for name in ("k", "v", "k_scales", "v_scales"):
        assert torch.equal(getattr(pools["cuda"], name)[0].cpu(), getattr(pools["cpu"], name)[0]), name
    torch.testing.assert_close(outs["cuda"], outs["cpu"], atol=1e-4, rtol=1e-3)
    slots = torch.tensor([5, 70, 3, 191])
    payload = pools["cuda"].export_slots(slots)
    assert bytes(payload) == bytes(pools["cpu"].export_slots(slots))
    back = KVPool(1, 12, 16, 2, 64, dtype=torch.int8, device="cuda")
    assert back.import_slots(slots.cuda(), payload)
    assert torch.equal(back.k_scales[0].view(-1, 2)[slots.cuda()].cpu(), pools["cpu"].k_scales[0].view(-1, 2)[slots])
