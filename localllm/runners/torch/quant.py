"""Quantized linear layers over torch's CPU int4 and int8 matmuls, built from GGUF tensors.

Which scheme a tensor gets follows how it is stored:

- Q4_K: int4, group 32, *without* re-quantizing: a Q4_K super-block is 8 sub-blocks of 32
  weights w = d*sc*q - dmin*m (q in 0..15), and torch's int4 groups are w = (q - 8)*s + z,
  so s = d*sc and z = 8*s - dmin*m give the same weights exactly (up to bfloat16 scales).
- Q5_0, Q5_1, Q5_K, Q6_K, Q8_0: dequantized, then int8 with one scale per output row. (For
  Q5_0, the bulk of Qwen2.5-Coder-0.5B's "Q4_K_M" file, int4 groups of 32 multiplied with
  7.7-8.0 % relative error against the file's weights, int8 rows with 0.8-0.9 %; bfloat16
  alone costs 0.3 %.)
- Q4_0, Q4_1 and the lower-bit types: dequantized, then int4 group 32 (min/max per group).
- F32, F16, BF16 (norms, and files that are not quantized): kept as floats.

The int4 and int8 kernels take bfloat16 activations (with float32 ones they are many times
slower) and return bfloat16.

On CUDA the int4 layers use torch's CUDA int4 kernel (``_weight_int4pack_mm``: the same
groups, packed for tensor cores from two 4-bit values a byte), and the tensors the CPU keeps
as int8 rows stay bfloat16 (torch has no CUDA int8 weight-only matmul; the GPU has room).
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32
INT8_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"})
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
# The schemes of quantized files: scheme -> the stored types that become int8 rows (the other
# quantized types become int4 groups). The default keeps 5-bit tensors at int8; "int4-bf16"
# takes them to int4 too (fewer bytes a step, less faithful: docs/benchmarks.md's frontier).
# "gguf-blocks" (where the native kernels were built): Q4_0 / Q5_0 / Q8_0 tensors stay in the
# file's own blocks, multiplied by native/qmatmul.c as llama.cpp multiplies them (BlockLinear),
# with float32 activations; the rest as "int4-int8-bf16". The runner takes it on the CPU
# wherever the native kernels are there, and DEFAULT_SCHEME elsewhere (CUDA, MPS, no compiler).
SCHEMES = {"int4-int8-bf16": INT8_TYPES, "int4-bf16": frozenset({"Q6_K", "Q8_0"}), "gguf-blocks": INT8_TYPES}
DEFAULT_SCHEME = "int4-int8-bf16"
BLOCK_SCHEMES = frozenset({"gguf-blocks"})


def q4k_groups(data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K tensor's raw blocks as (q (rows, cols) uint8 in 0..15, scale, min (rows, cols/32))
    with w = scale * q - min per group of 32."""
    from gguf.quants import Q4_K

    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, 144)  # d, dmin (f16), 12 scale bytes, 128 q bytes
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (n, 1)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # (n, 8) each
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(rows, cols)
    scale = (d * sc.astype(np.float32)).reshape(rows, cols // GROUP)
    minimum = (dmin * m.astype(np.float32)).reshape(rows, cols // GROUP)
    return q, scale, minimum


def int4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weights (rows, cols) as (q, scale, min) per group of 32, min/max rounding."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(rows, cols), scale, -lo


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(rows, cols) values 0..15 -> (rows, cols / 2) uint8, column 2i in the high nibble and
    2i+1 in the low one: the input of torch's CUDA ``_convert_weight_to_int4pack``."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] << 4) | q[:, 1::2]


def cuda_inner_k_tiles(rows: int, cols: int) -> int | None:
    """The tiling torch's CUDA int4 kernel takes for a (rows, cols) weight, or None when its
    shape does not fit the kernel (it needs cols a multiple of 16 x tiles and rows of 8)."""
    if rows % 8:
        return None
    return next((t for t in (8, 4, 2) if cols % (16 * t) == 0), None)


class Int4Linear:
    """y = x W^T (+ b) with W in torch's packed int4 (groups of 32 along the input), for the
    CPU's kernel or, on a CUDA device, torch's CUDA one (see ``from_groups``)."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None = None):
        self.packed = packed
        self.scales_and_zeros = scales_and_zeros  # (in / 32, out, 2) bfloat16
        self.in_features = scales_and_zeros.shape[0] * GROUP
        self.bias = bias.to(device=packed.device, dtype=torch.bfloat16) if bias is not None else None
        self.on_cpu = packed.device.type == "cpu"

    @staticmethod
    def scales_and_zeros(scale, minimum) -> torch.Tensor:
        """Groups w = scale * q - min as torch's (in / 32, out, 2) bfloat16 (scale, zero)
        with w = (q - 8) * scale + zero."""
        zero = 8 * scale.float() - minimum.float()
        return torch.stack([scale.float().t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()

    @classmethod
    def from_groups(cls, q, scale, minimum, bias: torch.Tensor | None = None, device="cpu") -> Int4Linear:
        """From weights w = scale * q - min per group of 32 (q in 0..15), for the CPU or a
        CUDA device (whose kernel needs a shape ``cuda_inner_k_tiles`` accepts)."""
        q, scale, minimum = (torch.as_tensor(t) for t in (q, scale, minimum))
        sz = cls.scales_and_zeros(scale, minimum)
        device = torch.device(device)
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
        else:
            tiles = cuda_inner_k_tiles(*q.shape)
            packed = torch.ops.aten._convert_weight_to_int4pack(pack_nibbles(q).to(device), tiles)
            sz = sz.to(device)
        return cls(packed, sz, bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "sz": self.scales_and_zeros, **({"b": self.bias} if self.bias is not None else {})}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16).reshape(-1, self.in_features)
        if self.on_cpu:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x, self.packed, GROUP, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias


class Int8Linear:
    """y = x W^T (+ b) with W int8 and one scale per output row."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight  # (out, in) int8
        self.scales = scales  # (out,) bfloat16
        self.bias = bias.to(torch.bfloat16) if bias is not None else None

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        w = w.float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-10)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        return cls(q, scale.to(torch.bfloat16), bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"w8": self.weight, "s8": self.scales, **({"b": self.bias} if self.bias is not None else {})}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales)
        return y if self.bias is None else y + self.bias


class BlockLinear:
    """y = x W^T (+ b) with W kept in its GGUF blocks (Q4_0, Q5_0 or Q8_0; Q4_K, Q5_K or Q6_K where
    the CPU has AVX2) and multiplied by the native kernel (native/qmatmul.c): x quantized
    to 8-bit blocks (Q8_K super-blocks for the K-quants), integer sums per block, as llama.cpp
    computes it. Takes and returns float32.

    Q4_0 / Q5_0 / Q8_0 / Q4_K / Q6_K matrices of a multiple of 8 rows are kept with 8 rows
    interleaved ("Q4_0R" / "Q5_0R" / "Q8_0R", native/rows8.c; "Q4_KR" / "Q6_KR", native/kquant.c:
    a lane a row, one float sum a row, on every tier); others, where the CPU has AVX2, Q4_0 /
    Q5_0 in pairs of blocks ("Q4_0P" / "Q5_0P" / "Q5_0X", which the kernels unpack in a
    fraction of the instructions: the same products as the file's blocks, bit for bit).
    ``tensors()`` gives them back as the file's blocks."""

    def __init__(self, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None = None):
        from localllm.runners.torch import native

        if kind in native.SUPER_BYTES:
            self.in_features = blocks.shape[1] // native.SUPER_BYTES[kind] * 256
        else:
            self.in_features = blocks.shape[1] * GROUP // native.BLOCK_BYTES[kind]
        packed = native.pairs_kind(kind) if native.vector_loops() and self.in_features % (2 * GROUP) == 0 else None
        packed = native.rows8_kind(kind, blocks.shape[0]) or packed
        if packed:
            blocks, kind = native.repack(blocks.contiguous(), kind, packed=packed), packed
        self.blocks = blocks.contiguous()  # (out, in / 32 * block bytes) uint8
        self.kind = kind
        self.bias = bias.float() if bias is not None else None
        self.matmul = native.QMatmul(self.blocks, kind, self.in_features)

    def tensors(self) -> dict[str, torch.Tensor]:
        from localllm.runners.torch import native

        kind, blocks = self.kind, self.blocks
        if kind in native.PACKED_TYPES:
            packed, kind = kind, native.UNPACKED[kind]
            blocks = native.repack(blocks, kind, reverse=True, packed=packed)
        code = native.BLOCK_TYPES.get(kind) or native.K_TYPES[kind]
        return {"blocks": blocks, "kind": torch.tensor([code], dtype=torch.int32),
                **({"b": self.bias} if self.bias is not None else {})}

    @classmethod
    def from_tensors(cls, blocks: torch.Tensor, kind: torch.Tensor, bias: torch.Tensor | None) -> BlockLinear:
        from localllm.runners.torch import native

        names = {v: k for k, v in {**native.BLOCK_TYPES, **native.K_TYPES}.items()}
        return cls(blocks, names[int(kind[0])], bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features))
        return y if self.bias is None else y.add_(self.bias)  # y is the matmul's own new tensor


class BlockEmbedding:
    """A token embedding table kept in its GGUF blocks (Q4_0, Q5_0 or Q8_0): ``table[tokens]``
    dequantizes the rows of those tokens alone (native dequantize: the gguf package's values
    bit for bit, as float32), so the table costs its file's bytes, not four per weight."""

    def __init__(self, blocks: torch.Tensor, kind: str, dim: int):
        self.blocks, self.kind, self.dim = blocks, kind, dim

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.dim

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        from localllm.runners.torch import native

        return native.dequantize(self.blocks[tokens.reshape(-1)], self.kind, self.dim).view(*tokens.shape, self.dim)
