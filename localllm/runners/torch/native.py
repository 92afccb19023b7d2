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

ABI_VERSION = 1  # native/localllm_native.h's LM_ABI_VERSION
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
    return lib


def available() -> bool:
    return library() is not None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                    n_swa: int = 0, n_threads: int | None = None) -> torch.Tensor:
    """native/attention.c over one layer's pool: q (N, n_head, hd) float32 -> (N, n_head, hd).
    meta: the batch's int32 tensors (q_start, q_len, ctx_len, tables, table_start)."""
    lib = library()
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
