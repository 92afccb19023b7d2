"""The pieces every model family is built of: RMS norm, rotary embeddings, linear layers.

Conventions are llama.cpp's, since the weights come from its GGUF files: rope "NORM"
rotates adjacent pairs (x[2i], x[2i+1]) (llama: the converter permuted Q and K for it),
rope "NEOX" rotates the halves (x[i], x[i + d/2]) (qwen2, gemma3).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from localllm.runners.torch.weights import GGUFWeights


def _gelu_formula(h: torch.Tensor) -> torch.Tensor:
    """GELU's tanh form on float16 values, computed in float32, rounded to float16."""
    h = h.float()
    return (0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * h * (1.0 + 0.044715 * h * h)))).to(torch.float16)


@functools.cache
def gelu_table() -> torch.Tensor:
    """_gelu_formula of every float16 value, as float32, indexed by the value's 16 bits."""
    return _gelu_formula(torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)).float()


def gelu_ggml(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh form) as llama.cpp's CPU kernel computes it: through a table indexed by the
    input rounded to float16, holding float16 results; 0 below -10, x above 10. On the CPU the
    table is looked up (a 512-token Gemma prefill spent a tenth of its time computing it);
    elsewhere the formula, the same values."""
    if x.device.type == "cpu":
        bits = x.to(torch.float16).view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF)
        y = gelu_table().index_select(0, bits.flatten()).view(x.shape).to(x.dtype)
    else:
        y = _gelu_formula(x.to(torch.float16)).to(x.dtype)
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up. On the CPU in float32, native/rows.c's (the native layers of fused.py
    call the same, and it sums in one order on every tier); torch's otherwise."""
    kernels = _native_rows(gate, up)
    if kernels is not None:
        return kernels.silu_mul(gate, up)
    return F.silu(gate) * up


@functools.cache
def _rows():
    """localllm's native row kernels (native/rows.c) when they were built, else None."""
    from localllm.runners.torch import native

    return native if native.available() else None


def _native_rows(*tensors: torch.Tensor):
    """The native row kernels when every tensor is a float32 one on the CPU (callers pass them
    contiguous). Whether they are used must not depend on a tensor's layout, which differs
    between a decode step and a batch: each path rounds its own way, and a position decoded
    alone must equal the same position checked among drafts."""
    kernels = _rows()
    if kernels is None:
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32:
            return None
    return kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, in float32 (a decode step
    makes about fifty of these): on the CPU native/rows.c, summing as llama.cpp does."""
    xf = x.float()
    kernels = _native_rows(xf, weight)
    if kernels is not None:
        return kernels.rms_norm(xf.contiguous(), weight.contiguous(), eps).to(x.dtype)
    return F.rms_norm(xf, (x.shape[-1],), weight, eps).to(x.dtype)


class Rope:
    """Rotary position embeddings for heads of ``head_dim``, with llama.cpp's angles.

    llama.cpp computes a position's angles in float32, each pair's from the one before:
    theta_0 = p, theta_i = theta_(i-1) * s with s = powf(base, -2 / head_dim), each product
    rounded to float32, and takes cosf / sinf of them. At position 2,000 a float32 angle is
    already 1e-4 rad off the exact one, so exact angles would differ from llama.cpp's by that
    much; these tables reproduce its angles bit for bit (cos and sin rounded from float64). cos
    and sin are made once for positions 0.. as far as a step has asked (doubling: 256 KiB per
    1,000 positions at head_dim 64), and a step's rows of C and S once per positions tensor
    rather than twice per layer."""

    def __init__(self, head_dim: int, base: float, neox: bool, device):
        self.neox, self.head_dim, self.device = neox, head_dim, device
        self.scale = np.power(np.float32(base), np.float32(-2.0) / np.float32(head_dim), dtype=np.float32)
        self._cos = self._sin = torch.empty(0, head_dim // 2)  # (positions, hd / 2)
        self._positions: torch.Tensor | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor] = ()
        self._rows: tuple[torch.Tensor, torch.Tensor] = ()  # the step's cos and sin (N, hd / 2)
        self._reserved = False  # see reserve

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self._cos.shape[0], 256)
        theta = np.empty((n, self.head_dim // 2), dtype=np.float32)
        theta[:, 0] = np.arange(n, dtype=np.float32)
        for i in range(1, self.head_dim // 2):
            theta[:, i] = theta[:, i - 1] * self.scale  # float32 products, one at a time, as llama.cpp
        self._cos = torch.from_numpy(np.cos(theta.astype(np.float64)).astype(np.float32)).to(self.device)
        self._sin = torch.from_numpy(np.sin(theta.astype(np.float64)).astype(np.float32)).to(self.device)

    def reserve(self, n: int) -> None:
        """Make the tables of positions 0..n-1 now and stop reading a step's positions back to
        grow them (a step that waits for the device cannot be captured as a CUDA graph):
        positions must stay below n from here on."""
        if n > self._cos.shape[0]:
            self._grow(n)
        self._reserved = True

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, 1, hd) float32 C and S with rope(x) = x * C + partner(x) * S, where partner(x)
        swaps each rotated pair (x_i, x_j) to (x_j, x_i): C holds cos on both, S -sin on the
        first and sin on the second, so each output is x_i cos - x_j sin or x_j cos + x_i sin,
        bit for bit as written out."""
        if positions is not self._positions:
            top = int(positions.max()) + 1 if positions.numel() and not self._reserved else 0
            if top > self._cos.shape[0]:
                self._grow(top)
            cos, sin = self._cos[positions], self._sin[positions]
            self._rows = (cos, sin)
            if self.neox:
                c, s = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
            else:
                c, s = torch.stack([cos, cos], -1).flatten(-2), torch.stack([-sin, sin], -1).flatten(-2)
            self._positions, self._tables = positions, (c[:, None, :], s[:, None, :])
        return self._tables

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's cos and sin (N, hd / 2) float32, contiguous (what native/rows.c reads)."""
        self.tables(positions)
        return self._rows

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (N, heads, hd); positions: (N,)."""
        c, s = self.tables(positions)
        xf = x.float()
        kernels = _native_rows(xf, *self._rows)
        if kernels is not None:
            return kernels.rope(xf.contiguous(), *self._rows, self.neox).to(x.dtype)
        if self.neox:
            half = xf.shape[-1] // 2
            partner = torch.cat([xf[..., half:], xf[..., :half]], dim=-1)
        else:
            partner = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        if xf.is_cuda:  # one kernel fewer (a fused multiply-add: on CUDA only, the CPU keeps llama.cpp's bits)
            return torch.addcmul(xf * c, partner, s).to(x.dtype)
        return (xf * c + partner * s).to(x.dtype)


class Linear:
    """y = x W^T (+ b), W (out, in) as floats."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"w": self.weight, **({"b": self.bias} if self.bias is not None else {})}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def out_features(layer) -> int:
    from localllm.runners.torch import quant

    if isinstance(layer, quant.BlockLinear):
        return layer.blocks.shape[0]
    if isinstance(layer, quant.Int4Linear):
        return layer.scales_and_zeros.shape[1]
    return layer.weight.shape[0]  # Linear, Int8Linear


def _fuse(a, b):
    """One layer computing a's outputs then b's, or None. On the CPU only formats whose output
    rows are computed each on its own are joined, so the bits stay those of the layers alone:
    the file's blocks of one type (qmatmul works row by row) and int8 rows (torch's kernel
    gives the same bits for a row whatever rows surround it); on CUDA float layers too. Both
    layers must have a bias, or neither."""
    from localllm.runners.torch import quant

    if (a.bias is None) != (b.bias is None):
        return None
    bias = torch.cat([a.bias, b.bias]) if a.bias is not None else None
    if isinstance(a, quant.BlockLinear) and isinstance(b, quant.BlockLinear):
        if a.kind != b.kind or a.in_features != b.in_features:
            return None
        return quant.BlockLinear(torch.cat([a.blocks, b.blocks]), a.kind, bias)
    if (isinstance(a, Linear) and isinstance(b, Linear) and a.weight.device.type == "cuda"
            and a.weight.dtype == b.weight.dtype and a.weight.shape[1] == b.weight.shape[1]):
        # On CUDA, where a decode step is bound by launches: one matmul for Q, K and V (and
        # gate and up) where they are floats (what the CPU keeps as int8 rows is bfloat16 there).
        return Linear(torch.cat([a.weight, b.weight]), bias)
    if isinstance(a, quant.Int8Linear) and isinstance(b, quant.Int8Linear) and a.weight.device.type == "cpu":
        if a.weight.shape[1] != b.weight.shape[1]:
            return None
        return quant.Int8Linear(torch.cat([a.weight, b.weight]), torch.cat([a.scales, b.scales]), bias)
    return None


class Parallel:
    """Layers that read the same input (Q, K and V; gate and up), run as few matmuls as their
    formats allow: neighbours of one format are joined into one layer whose output is split
    again. Each joined call quantizes the input once and costs one call instead of two or
    three, and gives the same bits as the layers alone."""

    def __init__(self, layers: list):
        self.groups: list[tuple[object, list[int]]] = []  # (layer, the output sizes it holds)
        for layer in layers:
            if self.groups:
                last, sizes = self.groups[-1]
                joined = _fuse(last, layer)
                if joined is not None:
                    self.groups[-1] = (joined, sizes + [out_features(layer)])
                    continue
            self.groups.append((layer, [out_features(layer)]))

    def layer_of(self, i: int):
        """The layer that computes the i-th output."""
        for layer, sizes in self.groups:
            if i < len(sizes):
                return layer
            i -= len(sizes)
        raise IndexError(i)

    def __call__(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """The layers' outputs, in ``dtype`` when given (each joined output converted once,
        then split: views with the joined row's stride)."""
        outs = []
        for layer, sizes in self.groups:
            y = layer(x)
            if dtype is not None:
                y = y.to(dtype)
            outs += y.split(sizes, dim=-1) if len(sizes) > 1 else [y]
        return outs


def load_linear(weights: GGUFWeights, name: str, act_dtype: torch.dtype, device, bias: bool = False,
                int8_types: frozenset[str] | None = None, blocks: bool = False):
    """The layer ``name`` (its ``.weight``, and ``.bias`` when asked) in the scheme its storage
    calls for (see quant.py): on the CPU int4 or int8 (or, with ``blocks``, the file's blocks); on CUDA int4 where the storage is 4-bit
    and the shape fits torch's CUDA kernel; float weights in ``act_dtype`` otherwise (when
    computing in float32, on Apple's MPS). int8_types: the stored types kept as int8 rows
    (quant.SCHEMES; the default scheme's when None). blocks: Q4_0 / Q5_0 / Q8_0 tensors, and
    where the CPU has AVX2 Q4_K / Q5_K / Q6_K ones, stay in their GGUF blocks for the native
    kernel (the "gguf-blocks" scheme; CPU only)."""
    from localllm.runners.torch import native, quant

    int8_types = quant.INT8_TYPES if int8_types is None else int8_types
    kind = weights.tensor_type(f"{name}.weight")
    dev = torch.device(device)
    b = weights.get(f"{name}.bias").to(device) if bias else None
    if blocks and dev.type == "cpu" and (kind in native.BLOCK_TYPES or (
            kind in native.K_TYPES and native.vector_loops() and weights.shape(f"{name}.weight")[1] % 256 == 0)):
        data, _, _ = weights.raw(f"{name}.weight")  # the file's mapping, not a copy
        return quant.BlockLinear(torch.from_numpy(data), kind, bias=b)
    dense = ((act_dtype == torch.float32 and not blocks) or kind in quant.FLOAT_TYPES
             or dev.type not in ("cpu", "cuda"))
    if dev.type == "cuda" and not dense:
        rows, cols = weights.shape(f"{name}.weight")
        dense = kind in int8_types or quant.cuda_inner_k_tiles(rows, cols) is None
    if dense:
        return Linear(weights.get(f"{name}.weight").to(device=device, dtype=act_dtype),
                      b.to(act_dtype) if b is not None else None)
    if kind == "Q4_K":
        data, rows, cols = weights.raw(f"{name}.weight")
        return quant.Int4Linear.from_groups(*quant.q4k_groups(data, rows, cols), bias=b, device=dev)
    w = weights.get(f"{name}.weight")
    if kind in int8_types:
        return quant.Int8Linear.from_float(w, bias=b)
    return quant.Int4Linear.from_groups(*quant.int4_groups(w), bias=b, device=dev)  # Q4_0, Q4_1, lower


class LayerSource:
    """Where a model's tensors come from. Blocks the native kernels read (``reads_in_place``)
    come from the file's mapping, never copied but to join neighbours (Parallel) or rearrange
    Q4_0 / Q5_0 in pairs; so do float32 vectors (norms, biases). Everything else is converted:
    taken from ``cache`` (a WeightCache, read at the first conversion) where an earlier load
    kept it, converted now otherwise and recorded in ``converted`` for the runner to keep.
    Cached names: ``NAME.w`` / ``.b`` float layers, ``.packed`` / ``.sz`` int4, ``.w8`` /
    ``.s8`` int8, ``.blocks`` / ``.kind`` blocks; vectors by their GGUF name."""

    def __init__(self, weights: GGUFWeights, dtype: torch.dtype, device, cache=None,
                 int8_types: frozenset[str] | None = None, blocks: bool = False):
        self.weights, self.dtype, self.device, self.cache = weights, dtype, device, cache
        self.int8_types, self.blocks = int8_types, blocks
        self._cached: dict[str, torch.Tensor] | None = None
        self.converted: dict[str, torch.Tensor] = {}
        self.num_from_cache = 0  # layers and vectors the cache gave

    def has(self, name: str) -> bool:
        return self.weights.has(name)

    def cached(self) -> dict[str, torch.Tensor]:
        """The cache's tensors ({} where there is none yet), read once."""
        if self._cached is None:
            self._cached = (self.cache.load() if self.cache is not None else None) or {}
        return self._cached

    def reads_in_place(self, name: str) -> bool:
        """Whether the matrix ``name`` stays in the file's blocks for the native matmul."""
        from localllm.runners.torch import native

        if not self.blocks or torch.device(self.device).type != "cpu":
            return False
        kind = self.weights.tensor_type(f"{name}.weight")
        return kind in native.BLOCK_TYPES or (kind in native.K_TYPES and native.vector_loops()
                                              and self.weights.shape(f"{name}.weight")[1] % 256 == 0)

    def linear(self, name: str, bias: bool = False):
        from localllm.runners.torch import quant

        if self.reads_in_place(name):
            return load_linear(self.weights, name, self.dtype, self.device, bias, self.int8_types, self.blocks)
        c = self.cached()
        b = c.get(f"{name}.b")
        layer = None
        if f"{name}.blocks" in c:
            layer = quant.BlockLinear.from_tensors(c[f"{name}.blocks"], c[f"{name}.kind"], b)
        elif f"{name}.packed" in c:
            layer = quant.Int4Linear(c[f"{name}.packed"], c[f"{name}.sz"], b)
        elif f"{name}.w8" in c:
            layer = quant.Int8Linear(c[f"{name}.w8"], c[f"{name}.s8"], b)
        elif f"{name}.w" in c:
            layer = Linear(c[f"{name}.w"], b)
        if layer is not None:
            self.num_from_cache += 1
            return layer
        layer = load_linear(self.weights, name, self.dtype, self.device, bias, self.int8_types, self.blocks)
        self.converted.update({f"{name}.{k}": t for k, t in layer.tensors().items()})
        return layer

    def vector(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor kept as floats (norms, the embedding table where it is not read in place)."""
        if dtype == torch.float32 and self.weights.tensor_type(name) == "F32":
            return self.weights.get(name).to(self.device)
        c = self.cached()
        if name in c:
            self.num_from_cache += 1
            return c[name]
        t = self.weights.get(name).to(device=self.device, dtype=dtype)
        self.converted[name] = t
        return t

    def embedding(self, name: str, dtype: torch.dtype):
        """The token embedding table: its rows looked up as ``table[tokens]``. On the CPU with the
        blocks scheme, the file's Q4_0 / Q5_0 / Q8_0 blocks, each step's rows dequantized as
        asked (quant.BlockEmbedding); a table of ``dtype`` floats otherwise."""
        from localllm.runners.torch import native, quant

        kind = self.weights.tensor_type(name)
        if self.blocks and torch.device(self.device).type == "cpu" and kind in native.BLOCK_TYPES:
            data, _, cols = self.weights.raw(name)
            return quant.BlockEmbedding(torch.from_numpy(data), kind, cols)
        return self.vector(name, dtype)
