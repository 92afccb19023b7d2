"""localllm's native kernels (native/*.c), called through ctypes.

The package build compiles them into the extension ``localllm._native`` when a C compiler is
there; without one the package installs all the same and the torch runner uses its pure-torch
reference instead (``available()`` says which). Each kernel takes raw pointers to contiguous
CPU tensors, so nothing is copied on the way in or out.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

import torch

from localllm.errors import UsageError

ABI_VERSION = 12  # native/localllm_native.h's LM_ABI_VERSION
# What a KV pool holds, as native/attention.c numbers it (LM_KV_*): int8 is q8_0, with scales.
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.int8: 2}
REBUILD = "rebuild localllm's native kernels with `pip install -e .` (a C compiler is needed)"
# GGUF block formats the native matmul reads in place (GGML's type numbers).
BLOCK_TYPES = {"Q4_0": 2, "Q5_0": 6, "Q8_0": 8}
BLOCK_BYTES = {"Q4_0": 18, "Q5_0": 22, "Q8_0": 34, "Q4_0P": 18, "Q5_0P": 22, "Q5_0X": 22,
               "Q4_0R": 18, "Q5_0R": 22, "Q8_0R": 34}
# K-quant super-blocks (256 weights) the matmul reads in place (native/kquant.c) where
# ``vector_loops()``.
K_TYPES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q4_KR": 148, "Q6_KR": 210}
# Layouts of our own the matmul also reads: "Q4_0P" / "Q5_0P" are Q4_0 / Q5_0 with each pair of blocks
# rearranged (native/qmatmul.c; ``repack`` makes it where ``vector_loops()``); "Q5_0X" is Q5_0's
# pairs with the high bits in the order the 256-bit loops unpack fastest (``pairs_kind``).
# "Q4_0R" / "Q5_0R" / "Q8_0R" hold 8 rows interleaved, a block at a time (native/rows8.c), and
# "Q4_KR" / "Q6_KR" a super-block at a time (native/kquant.c; Q4_KR's scales unpacked, 148 bytes
# a super-block's row): one lane a row, one float sum a row; every tier reads them (``rows8_kind``).
PACKED_TYPES = {"Q4_0P": 102, "Q5_0P": 106, "Q5_0X": 116, "Q4_0R": 122, "Q5_0R": 126, "Q8_0R": 128,
                "Q4_KR": 112, "Q6_KR": 114}
ROWS8_TYPES = ("Q4_0R", "Q5_0R", "Q8_0R", "Q4_KR", "Q6_KR")
UNPACKED = {"Q4_0P": "Q4_0", "Q5_0P": "Q5_0", "Q5_0X": "Q5_0", "Q4_0R": "Q4_0", "Q5_0R": "Q5_0", "Q8_0R": "Q8_0",
            "Q4_KR": "Q4_K", "Q6_KR": "Q6_K"}
_ERRORS = {1: "invalid arguments", 2: "out of memory"}
# Instruction-set tiers, lowest first, as native/isa.c numbers them (LM_ISA_*): AVX-VNNI is AVX2 with
# the 256-bit VEX vpdpbusd of Intel's laptop chips (a CPU with AVX-512 VNNI may lack it).
ISA_TIERS = {"scalar": 0, "avx2": 1, "avxvnni": 2, "avx512vnni": 3}
_ISA_NAMES = {v: k for k, v in ISA_TIERS.items()}
# The switch that forces a lower tier, as torch's kernels follow ATEN_CPU_CAPABILITY: a fast
# machine then runs, tests and times what a slower one runs (docs/testing.md). It is a switch of
# the process, like torch's, read once when the library loads.
ISA_VARIABLE = "LOCALLLM_NATIVE_ISA"


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when the package was built without them or they were
    built from other sources than this code's (``why_unavailable`` says which)."""
    return _load()[0]


def why_unavailable() -> str | None:
    """Why ``library()`` is None, in words; None when it is not."""
    return _load()[1]


def is_outdated() -> bool:
    """Whether the kernels are there but were built from other sources (so never called)."""
    return _load()[2]


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None, bool]:
    spec = importlib.util.find_spec("localllm._native")
    if spec is None or not spec.origin:
        return None, "localllm._native was not built (no C compiler when the package was installed)", False
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError as e:
        return None, f"localllm._native ({spec.origin}) does not load: {e}", False
    lib.lm_abi_version.restype = ctypes.c_int
    if lib.lm_abi_version() != ABI_VERSION:
        # An older build would misread this code's calls (a q8_0 pool, for one): never call it.
        return None, (f"localllm._native ({spec.origin}) was built from older sources (ABI "
                      f"{lib.lm_abi_version()}, this code needs {ABI_VERSION})"), True
    vp, ci = ctypes.c_void_p, ctypes.c_int
    lib.lm_paged_attention.restype = ci
    lib.lm_paged_attention.argtypes = [vp, vp, vp, vp, vp, vp, ci, ci, vp, vp, vp, vp, vp, ci, ci, ci, ci,
                                       ctypes.c_float, ci, ci]
    lib.lm_qmatmul.restype = ci
    lib.lm_qmatmul.argtypes = [vp, ci, ci, vp, ci, ci, vp, ci, ci]
    lib.lm_dequantize.restype = ci
    lib.lm_dequantize.argtypes = [vp, ci, ci, ci, vp]
    lib.lm_repack.restype = ci
    lib.lm_repack.argtypes = [vp, ci, ci, ci, vp, ci, ci]
    for name in ("lm_isa", "lm_isa_detected", "lm_isa_tiers"):
        getattr(lib, name).restype = ci
        getattr(lib, name).argtypes = []
    lib.lm_set_isa.restype = ci
    lib.lm_set_isa.argtypes = [ci]
    lib.lm_rms_norm.restype = ci
    lib.lm_rms_norm.argtypes = [vp, vp, vp, ci, ci, ctypes.c_float]
    lib.lm_rope.restype = ci
    lib.lm_rope.argtypes = [vp, vp, vp, vp, ci, ci, ci, ci]
    lib.lm_silu_mul.restype = ci
    lib.lm_silu_mul.argtypes = [vp, vp, vp, ci, ci, ci, ci]
    _force_isa(lib, os.environ.get(ISA_VARIABLE, ""))
    return lib, None, False


def _force_isa(lib: ctypes.CDLL, wanted: str) -> None:
    """Hold the kernels to the tier ``wanted`` names ("" leaves them at the CPU's best); a
    name that is no tier, or a tier this CPU lacks, is refused (a test or a figure would
    otherwise claim a tier it never ran)."""
    if not wanted:
        return
    tier = ISA_TIERS.get(wanted.strip().lower())
    if tier is None:
        raise UsageError(f"{ISA_VARIABLE}={wanted!r} names no tier of the native kernels; "
                         f"use one of {', '.join(ISA_TIERS)}, or unset it")
    if lib.lm_set_isa(tier):
        raise UsageError(f"{ISA_VARIABLE}={wanted}: this CPU lacks that tier (its best is "
                         f"{_ISA_NAMES[lib.lm_isa_detected()]}); force a lower one, or unset it")


_threads: int | None = None  # set_threads


def threads() -> int:
    """The threads the kernels run on: set_threads's count, or torch's until one is set."""
    return _threads or torch.get_num_threads()


def set_threads(n: int) -> None:
    """The threads the kernels run on from now on (one count a process, as torch's).

    The kernels run on a pool of their own (native/pool.c), not on torch's OpenMP threads: its
    callers claim parts of the work one at a time and sleep when they must wait, so a thread
    that another program holds off a core delays a step by a part, not by its share of every
    matrix (docs/benchmarks.md, "The kernels' own pool on a busy machine")."""
    global _threads
    if n < 1:
        raise ValueError(f"threads {n} must be at least 1")
    _threads = n


def available() -> bool:
    return library() is not None


def _required() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"{why_unavailable()}; {REBUILD}, or run the torch runner without them")
    return lib


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                    n_swa: int = 0, n_threads: int | None = None, k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """native/attention.c over one layer's pool: q (N, n_head, hd) float32 -> (N, n_head, hd).
    k_cache / v_cache: (num_blocks, block_size, n_kv, hd) float32, float16, or int8 (q8_0:
    then k_scales / v_scales (num_blocks, block_size, n_kv) float16 too, see KVPool).
    meta: the batch's int32 tensors (q_start, q_len, ctx_len, tables, table_start).
    Raises ValueError for a pool of another dtype or layout (it would be misread), and
    RuntimeError when the kernels are missing or older than this code (rebuild them)."""
    lib = _required()
    if k_cache.dtype not in KV_TYPES or v_cache.dtype != k_cache.dtype or not (
            k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"the native attention reads contiguous float16, float32 or int8 (q8_0) pools, "
                         f"not {k_cache.dtype} / {v_cache.dtype}")
    quantized = k_cache.dtype == torch.int8
    if quantized != (k_scales is not None) or quantized != (v_scales is not None):
        raise ValueError("an int8 (q8_0) pool needs its k_scales and v_scales, and a float pool takes none")
    if quantized and not all(s.dtype == torch.float16 and s.is_contiguous() and s.shape == k_cache.shape[:3]
                             for s in (k_scales, v_scales)):
        raise ValueError(f"q8_0 scales must be contiguous float16 of shape {tuple(k_cache.shape[:3])}")
    q = q.contiguous()
    out = torch.empty_like(q)
    q_start, q_len, ctx_len, tables, table_start = meta
    _, block_size, n_kv, head_dim = k_cache.shape
    rc = lib.lm_paged_attention(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_scales.data_ptr() if quantized else None, v_scales.data_ptr() if quantized else None,
        KV_TYPES[k_cache.dtype], q_len.numel(),
        q_start.data_ptr(), q_len.data_ptr(), ctx_len.data_ptr(), tables.data_ptr(), table_start.data_ptr(),
        block_size, q.shape[1], n_kv, head_dim, scale, n_swa,
        n_threads if n_threads is not None else threads())
    if rc:
        raise RuntimeError(f"native paged attention failed: {_ERRORS.get(rc, rc)}")
    return out


def row_bytes(kind: str, k: int) -> int | None:
    """The bytes of one row of k weights in ``kind`` (None when k does not divide into its blocks)."""
    if kind in SUPER_BYTES:
        return k // 256 * SUPER_BYTES[kind] if k % 256 == 0 else None
    return k // 32 * BLOCK_BYTES[kind] if k % 32 == 0 else None


class QMatmul:
    """native/qmatmul.c over one weight matrix W (N, K) given as its GGUF blocks (``blocks``:
    uint8 (N, row_bytes(kind, K)), ``kind`` one of BLOCK_TYPES, K_TYPES or PACKED_TYPES),
    checked once: called with x (M, K) it gives x W^T (M, N) float32, computed as llama.cpp
    does (x quantized to 8-bit blocks, integer block sums). A decode step makes about a hundred
    of these calls, so each does no more than it must."""

    def __init__(self, blocks: torch.Tensor, kind: str, k: int):
        n = blocks.shape[0]
        if not blocks.is_contiguous() or blocks.dim() != 2 or blocks.shape[1] != row_bytes(kind, k):
            raise ValueError(f"{kind} blocks of shape {tuple(blocks.shape)} do not hold a ({n}, {k}) matrix")
        if kind in ROWS8_TYPES and n % 8:
            raise ValueError(f"{kind} blocks hold 8 rows at a time: {n} rows do not make whole groups "
                             f"(keep such a matrix as {UNPACKED[kind]})")
        self.blocks, self.n, self.k = blocks, n, k  # (holding blocks keeps the pointer valid)
        self.code = BLOCK_TYPES.get(kind) or K_TYPES.get(kind) or PACKED_TYPES[kind]
        self.fn, self.w = _required().lm_qmatmul, blocks.data_ptr()

    def __call__(self, x: torch.Tensor, n_threads: int | None = None, force_scalar: bool = False) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"x of shape {tuple(x.shape)} does not multiply a ({self.n}, {self.k}) matrix")
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        rc = self.fn(x.data_ptr(), x.shape[0], self.k, self.w, self.code, self.n, y.data_ptr(),
                     n_threads if n_threads is not None else threads(), int(force_scalar))
        if rc:
            raise RuntimeError(f"native qmatmul failed: {_ERRORS.get(rc, rc)}")
        return y


def qmatmul(x: torch.Tensor, blocks: torch.Tensor, kind: str, n_threads: int | None = None,
            force_scalar: bool = False) -> torch.Tensor:
    """x (M, K) float32 times W^T, W (N, K) given as its blocks (see QMatmul) -> (M, N) float32.
    force_scalar: the portable C loop instead of the vector one (the tests compare them)."""
    return QMatmul(blocks, kind, x.shape[-1])(x, n_threads, force_scalar)


def wide_kernels() -> bool:
    """Whether the matmul's AVX-512 VNNI loops run here."""
    lib = library()
    return lib is not None and lib.lm_isa() == ISA_TIERS["avx512vnni"]


def vector_loops() -> bool:
    """Whether the matmul's vector loops run here (AVX2 and up), which read the K-quants
    (K_TYPES) and the pairs (PACKED_TYPES). The scalar tier computes the K-quants too (the same
    bits), but slower than torch's int4 / int8; it reads no pairs."""
    lib = library()
    return lib is not None and lib.lm_isa() >= ISA_TIERS["avx2"]


def isa() -> str | None:
    """The instruction-set tier the kernels run here ("scalar", "avx2", "avx512vnni", ...), after
    any LOCALLLM_NATIVE_ISA; None without the kernels."""
    lib = library()
    return None if lib is None else _ISA_NAMES[lib.lm_isa()]


def isa_tiers() -> list[str]:
    """Every tier this CPU has, lowest first (what LOCALLLM_NATIVE_ISA may force); [] without the kernels."""
    lib = library()
    return [] if lib is None else [name for name, t in ISA_TIERS.items() if lib.lm_isa_tiers() >> t & 1]


def isa_detected() -> str | None:
    """The CPU's own best tier, whatever LOCALLLM_NATIVE_ISA says; None without the kernels."""
    lib = library()
    return None if lib is None else _ISA_NAMES[lib.lm_isa_detected()]


def pairs_kind(kind: str) -> str | None:
    """The layout in pairs this tier's loops read ``kind``'s blocks from: "Q4_0P" for Q4_0;
    for Q5_0 "Q5_0P" with the AVX-512 loops, "Q5_0X" with the 256-bit ones; None for the
    other kinds (kept as the file's blocks)."""
    if kind == "Q4_0":
        return "Q4_0P"
    if kind == "Q5_0":
        return "Q5_0P" if wide_kernels() else "Q5_0X"
    return None


def rows8_kind(kind: str, n: int) -> str | None:
    """The layout of 8 rows interleaved for ``kind``'s blocks of a matrix of ``n`` rows: "Q4_0R",
    "Q5_0R", "Q8_0R", "Q4_KR" or "Q6_KR" where n is a multiple of 8, on every tier (their sums
    are one order everywhere); None otherwise (Q5_K keeps its super-blocks)."""
    return f"{kind}R" if f"{kind}R" in ROWS8_TYPES and n % 8 == 0 else None


def repack(blocks: torch.Tensor, kind: str, reverse: bool = False, packed: str | None = None) -> torch.Tensor:
    """A Q4_0, Q5_0, Q8_0, Q4_K or Q6_K matrix's blocks (N, row_bytes(kind, K)) in the layout
    ``packed``, or back from it with ``reverse`` (then ``blocks`` are the packed ones): Q4_0 / Q5_0
    in pairs, K a multiple of 64 (default: ``pairs_kind(kind)``, the one this tier unpacks
    fastest; the same bytes rearranged: the same products, bit for bit), or any of the five with 8
    rows interleaved, N a multiple of 8 (``rows8_kind``), over torch's threads."""
    packed = packed or pairs_kind(kind)
    n, row = blocks.shape
    given, made = (packed, kind) if reverse else (kind, packed)
    k = row // SUPER_BYTES[given] * 256 if given in SUPER_BYTES else row * 32 // BLOCK_BYTES[given]
    out = torch.empty(n, row_bytes(made, k) or 0, dtype=torch.uint8)
    rc = 1 if row != row_bytes(given, k) else _required().lm_repack(
        blocks.contiguous().data_ptr(), PACKED_TYPES[packed], n, k, out.data_ptr(), int(reverse),
        threads())
    if rc:
        raise ValueError(f"{kind} blocks of shape {tuple(blocks.shape)} cannot be repacked as {packed}")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """native/rows.c: x (..., n) float32, contiguous, normalized per row of n and times weight
    (n,), as llama.cpp computes it."""
    y = torch.empty_like(x)
    n = x.shape[-1]
    if _required().lm_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps):
        raise ValueError(f"rms_norm of rows of {n}")
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """native/rows.c: x (N, heads, hd) float32, contiguous, rotated with cos / sin (N, hd / 2)."""
    out = torch.empty_like(x)
    n, heads, hd = x.shape
    if _required().lm_rope(x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, heads, hd, int(neox)):
        raise ValueError(f"rope of heads of {hd}")
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """native/rows.c: silu(gate) * up for float32 (..., n) tensors of one shape, rows of each
    read at their stride (the halves of a joined gate | up output are not copied)."""
    n = gate.shape[-1]
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul of shapes {tuple(gate.shape)} and {tuple(up.shape)}")
    g, u = (t.reshape(-1, n) if t.dim() != 2 else t for t in (gate, up))
    g, u = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, u))
    out = torch.empty(gate.shape, dtype=torch.float32)
    if _required().lm_silu_mul(g.data_ptr(), u.data_ptr(), out.data_ptr(), g.shape[0], n, g.stride(0), u.stride(0)):
        raise ValueError(f"silu_mul of rows of {n}")
    return out


def dequantize(blocks: torch.Tensor, kind: str, k: int) -> torch.Tensor:
    """GGUF blocks (N, K / 32 * block bytes) -> the (N, K) float32 weights, as the matmul
    unpacks them (the tests hold this to the gguf package's dequantization)."""
    n = blocks.shape[0]
    out = torch.empty(n, k, dtype=torch.float32)
    rc = _required().lm_dequantize(blocks.contiguous().data_ptr(), BLOCK_TYPES[kind], n, k, out.data_ptr())
    if rc:
        raise RuntimeError(f"native dequantize failed: {_ERRORS.get(rc, rc)}")
    return out

