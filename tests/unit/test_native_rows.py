"""native/rows.c against torch: RMS norm (summed as llama.cpp sums it) and rotary embeddings,
each row computed alone. No model needed."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from localllm.runners.torch import layers, native  # noqa: E402
from localllm.runners.torch.layers import Rope  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available(), reason="localllm._native was not built here")


def test_rms_norm_is_llama_cpps_double_sum_then_float_steps():
    x = torch.randn(5, 896, generator=torch.Generator().manual_seed(0)) * 3
    w = torch.randn(896, generator=torch.Generator().manual_seed(1))
    got = native.rms_norm(x, w, 1e-6)
    xs = x.numpy()
    for r in range(5):  # ggml_compute_forward_rms_norm_f32, then ggml_mul
        total = 0.0
        for v in xs[r]:
            total += float(np.float32(v * v))
        scale = np.float32(1.0) / np.sqrt(np.float32(total / 896) + np.float32(1e-6), dtype=np.float32)
        want = (xs[r] * scale).astype(np.float32) * w.numpy()
        assert np.array_equal(got[r].numpy(), want), r
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (896,), w, 1e-6))


def test_each_row_is_computed_alone():
    x = torch.randn(7, 3, 64, generator=torch.Generator().manual_seed(2))
    w = torch.randn(64)
    alone = torch.cat([native.rms_norm(x[i:i + 1].contiguous(), w, 1e-5) for i in range(7)])
    assert torch.equal(native.rms_norm(x, w, 1e-5), alone)
    rope = Rope(64, 1e6, neox=True, device="cpu")
    pos = torch.arange(7) * 100
    whole = rope(x, pos)
    for i in range(7):
        assert torch.equal(Rope(64, 1e6, neox=True, device="cpu")(x[i:i + 1], pos[i:i + 1]), whole[i:i + 1])


@pytest.mark.parametrize("neox", [True, False])
def test_rope_matches_the_torch_formula(neox, monkeypatch):
    x = torch.randn(6, 4, 32, generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([0, 1, 5, 300, 2000, 4095])
    got = Rope(32, 10000.0, neox=neox, device="cpu")(x, pos)
    monkeypatch.setattr(layers, "_native_rows", lambda *t: None)
    want = Rope(32, 10000.0, neox=neox, device="cpu")(x, pos)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)
    assert torch.equal(got[0], x[0])  # position 0 turns nothing


def test_bfloat16_activations_go_through_float32_and_come_back():
    h = torch.randn(2, 64).to(torch.bfloat16)  # the int4 / int8 schemes' activations
    assert layers.rms_norm(h, torch.ones(64), 1e-6).dtype == torch.bfloat16


def test_a_views_layout_does_not_choose_the_arithmetic():
    """Activations are often views into one matmul's output: contiguous for one row, strided
    for several. Both must take the same kernel, or a position decoded alone and the same
    position checked among drafts round differently."""
    fused = torch.randn(4, 2 * 48, generator=torch.Generator().manual_seed(4)) * 3
    x = fused[:, :48]
    assert not x.is_contiguous() and x[1:2].is_contiguous()
    normed = layers.rms_norm(x, torch.ones(48), 1e-6)
    for i in range(4):
        assert torch.equal(layers.rms_norm(x[i:i + 1], torch.ones(48), 1e-6), normed[i:i + 1])


def test_silu_mul_is_within_two_ulps_of_the_exact_one_and_reads_strided_halves():
    g = torch.cat([torch.linspace(-100, 100, 4001), torch.randn(4000, generator=torch.Generator().manual_seed(2)) * 4,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 86.5, -86.5, 89.0, -89.0, 1e4, -1e4])])
    u = torch.randn(g.numel(), generator=torch.Generator().manual_seed(3))
    got = native.silu_mul(g, u)
    want = (g.double() * torch.sigmoid(g.double()) * u.double()).float()
    ulp = torch.finfo(torch.float32).eps * want.abs()
    # (below -86 exp(-g) is held at exp(86): a silu within 1e-34 of 0 instead of nearer)
    assert ((got - want).abs() <= 2 * ulp + 1e-34).all()
    assert ((got - want).abs() <= 2 * ulp)[g > -86].all()
    # the halves of a joined gate | up output, rows read at their stride: the same bits as copies
    joined = torch.randn(7, 2 * 96, generator=torch.Generator().manual_seed(4)) * 5
    gate, up = joined.split(96, dim=-1)
    assert torch.equal(native.silu_mul(gate, up), native.silu_mul(gate.contiguous(), up.contiguous()))
    assert torch.equal(layers.silu_mul(gate, up), native.silu_mul(gate.contiguous(), up.contiguous()))
    # each row alone: a row's result does not depend on the rows beside it
    assert torch.equal(native.silu_mul(gate[3:4], up[3:4]), native.silu_mul(gate, up)[3:4])
    with pytest.raises(ValueError, match="silu_mul of shapes"):
        native.silu_mul(gate, up[:, :95])
