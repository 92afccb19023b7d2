"""gelu_ggml, llama.cpp's GELU: on the CPU a table of every float16 input, elsewhere the formula.
Both give the same values: the float16 result of the tanh form at the input rounded to float16,
0 at or below -10 and the input itself at or above 10."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from localllm.runners.torch.layers import _gelu_formula, gelu_ggml  # noqa: E402


def by_formula(x: torch.Tensor) -> torch.Tensor:
    y = _gelu_formula(x.to(torch.float16)).to(x.dtype)
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


def test_the_table_gives_the_formulas_value_for_every_float16_input():
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    every = every[torch.isfinite(every)]
    assert torch.equal(gelu_ggml(every), by_formula(every))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_shape_and_dtype_and_the_bounds(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=g) * 8).to(dtype)
    assert torch.equal(gelu_ggml(x), by_formula(x)) and gelu_ggml(x).dtype == dtype
    edges = torch.tensor([-10.5, -10.0, -9.999, 0.0, 9.999, 10.0, 10.001], dtype=dtype)
    got = gelu_ggml(edges)
    assert got[0] == 0 and got[1] == 0 and got[-1] == edges[-1] and got[-2] == edges[-2]
    assert torch.equal(got, by_formula(edges))
