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

import torch

ABI_VERSION = 2  # native/localllm_native.h's LM_ABI_VERSION
# GGUF block formats the native matmul reads in place (GGML's type numbers).
BLOCK_TYPES = {"Q4_0": 2, "Q5_0": 6, "Q8_0": 8}
BLOCK_BYTES = {"Q4_0": 18, "Q5_0": 22, "Q8_0": 34}
_ERRORS = {1: "invalid arguments", 2: "out of memory"}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when the package was built without them."""
    spec = importlib.util.find_spec("localllm._native")
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError:
        return None
    lib.lm_abi_version.restype = ctypes.c_int
    if lib.lm_abi_version() != ABI_VERSION:
        return None
    vp, ci = ctypes.c_void_p, ctypes.c_int
    lib.lm_paged_attention.restype = ci
    lib.lm_paged_attention.argtypes = [vp, vp, vp, vp, ci, ci, vp, vp, vp, vp, vp, ci, ci, ci, ci,
                                       ctypes.c_float, ci, ci]
    lib.lm_qmatmul.restype = ci
    lib.lm_qmatmul.argtypes = [vp, ci, ci, vp, ci, ci, vp, ci, ci]
    lib.lm_dequantize.restype = ci
    lib.lm_dequantize.argtypes = [vp, ci, ci, ci, vp]
    lib.lm_pool_use_openmp.restype = None
    lib.lm_pool_use_openmp.argtypes = [vp, vp, vp]
    _share_torchs_threads(lib)
    return lib


def _share_torchs_threads(lib: ctypes.CDLL) -> None:
    """Run the kernels' parallel parts on torch's own OpenMP threads where torch has them (its
    workers spin after each operation, so threads of our own would find the cores taken);
    otherwise the kernels keep their own pool (native/pool.c)."""
    import re

    try:
        with open("/proc/self/maps") as maps:
            loaded = set(re.findall(r"(/\S*lib(?:g|i)?omp[^/\s]*\.so[.\d]*)$", maps.read(), re.M))
    except OSError:
        return
    for path in sorted(loaded):
        try:
            omp = ctypes.CDLL(path)
            funcs = [ctypes.cast(getattr(omp, name), ctypes.c_void_p).value
                     for name in ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")]
        except (OSError, AttributeError):
            continue
        lib.lm_pool_use_openmp(*funcs)
        return


def available() -> bool:
    return library() is not None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                    n_swa: int = 0, n_threads: int | None = None) -> torch.Tensor:
    """native/attention.c over one layer's pool: q (N, n_head, hd) float32 -> (N, n_head, hd).
    meta: the batch's int32 tensors (q_start, q_len, ctx_len, tables, table_start)."""
    lib = library()
    if k_cache.dtype not in (torch.float16, torch.float32) or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"the native attention reads contiguous float16 or float32 pools, not {k_cache.dtype}")
    q = q.contiguous()
    out = torch.empty_like(q)
    q_start, q_len, ctx_len, tables, table_start = meta
    _, block_size, n_kv, head_dim = k_cache.shape
    rc = lib.lm_paged_attention(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        1 if k_cache.dtype == torch.float16 else 0, q_len.numel(),
        q_start.data_ptr(), q_len.data_ptr(), ctx_len.data_ptr(), tables.data_ptr(), table_start.data_ptr(),
        block_size, q.shape[1], n_kv, head_dim, scale, n_swa,
        n_threads if n_threads is not None else torch.get_num_threads())
    if rc:
        raise RuntimeError(f"native paged attention failed: {_ERRORS.get(rc, rc)}")
    return out


def qmatmul(x: torch.Tensor, blocks: torch.Tensor, kind: str, n_threads: int | None = None,
            force_scalar: bool = False) -> torch.Tensor:
    """native/qmatmul.c: x (M, K) float32 times W^T, W (N, K) given as its GGUF blocks
    (``blocks``: uint8 (N, K / 32 * block bytes), ``kind`` one of BLOCK_TYPES) -> (M, N) float32,
    computed as llama.cpp does (x quantized to 8-bit blocks, integer block sums).
    force_scalar: the portable C loop instead of the vector one (the tests compare them)."""
    x = x.float().contiguous()
    m, k = x.shape
    n = blocks.shape[0]
    if not blocks.is_contiguous() or blocks.shape[1] * 32 != k * BLOCK_BYTES[kind]:
        raise ValueError(f"{kind} blocks of shape {tuple(blocks.shape)} do not hold a ({n}, {k}) matrix")
    y = torch.empty(m, n, dtype=torch.float32)
    rc = library().lm_qmatmul(x.data_ptr(), m, k, blocks.data_ptr(), BLOCK_TYPES[kind], n, y.data_ptr(),
                              n_threads if n_threads is not None else torch.get_num_threads(), int(force_scalar))
    if rc:
        raise RuntimeError(f"native qmatmul failed: {_ERRORS.get(rc, rc)}")
    return y


def dequantize(blocks: torch.Tensor, kind: str, k: int) -> torch.Tensor:
    """GGUF blocks (N, K / 32 * block bytes) -> the (N, K) float32 weights, as the matmul
    unpacks them (the tests hold this to the gguf package's dequantization)."""
    n = blocks.shape[0]
    out = torch.empty(n, k, dtype=torch.float32)
    rc = library().lm_dequantize(blocks.contiguous().data_ptr(), BLOCK_TYPES[kind], n, k, out.data_ptr())
    if rc:
        raise RuntimeError(f"native dequantize failed: {_ERRORS.get(rc, rc)}")
    return out

