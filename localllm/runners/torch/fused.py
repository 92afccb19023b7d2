"""Every layer of a step in one native call (native/layer.c's lm_layers_forward): the torch
runner's forward on the CPU where each matrix is one the native matmul reads in place.

A decode step of a 0.5B model runs some twenty small operations a layer between its matmuls;
through torch and Python each costs a dispatch, about 6 ms a token on a 2-core laptop-class
CPU, a fifth of the step. ``FusedLayers.build`` describes a model's layers once (pointers to
its blocks, norms, biases and its KV pool, held here so they stay valid) and each step is one
call. It computes what the model's own forward computes on the CPU with the same kernels
(rms_norm, rope, the matmul, attention, SwiGLU's silu_mul, Gemma's GELU table), so the two
paths give the same bits (tests/integration/test_fused_layers.py), and a position decoded alone
still equals the same position checked among drafts."""

from __future__ import annotations

import ctypes
import functools
from typing import Callable

import torch

from localllm.runners.torch import native, quant
from localllm.runners.torch.attention import AttnBatch, KVPool
from localllm.runners.torch.layers import Parallel, Rope

_vp, _ci = ctypes.c_void_p, ctypes.c_int
ACT_SILU, ACT_GELU = 0, 1  # native/layer.c's LM_ACT_*


class _Mat(ctypes.Structure):
    _fields_ = [("w", _vp), ("wtype", _ci), ("n_out", _ci), ("bias", _vp)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _vp), ("q_norm", _vp), ("k_norm", _vp), ("post_attn_norm", _vp),
                ("ffn_norm", _vp), ("post_ffn_norm", _vp), ("qkv", _Mat * 3), ("n_qkv", _ci), ("o", _Mat),
                ("gate_up", _Mat * 2), ("n_gate_up", _ci), ("down", _Mat), ("k_cache", _vp), ("v_cache", _vp),
                ("k_scales", _vp), ("v_scales", _vp), ("k_smooth", _vp), ("rope", _ci), ("n_swa", _ci)]


class _Model(ctypes.Structure):
    _fields_ = [("n_layer", _ci), ("d", _ci), ("n_head", _ci), ("n_kv", _ci), ("hd", _ci), ("d_ff", _ci),
                ("neox", _ci), ("kv_type", _ci), ("block_size", _ci), ("act", _ci), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("act_table", _vp), ("layers", ctypes.POINTER(_Layer))]


@functools.cache
def _function():
    fn = native.library().lm_layers_forward
    fn.restype = _ci
    fn.argtypes = [ctypes.POINTER(_Model), _vp, _ci, _vp, _ci, _vp, _vp, _vp, _vp, _vp,
                   ctypes.POINTER(_vp), ctypes.POINTER(_vp), _ci]
    return fn


def _groups(layer) -> list[quant.BlockLinear] | None:
    """The block layers behind a Parallel (or one layer), or None where one is of another kind."""
    groups = [g for g, _ in layer.groups] if isinstance(layer, Parallel) else [layer]
    return groups if all(isinstance(g, quant.BlockLinear) for g in groups) else None


class FusedLayers:
    """One model's layers over one KV pool, described for lm_layers_forward."""

    def __init__(self, model: _Model, layers, keep: list, pool: KVPool):
        self.model, self.layers, self.keep, self.pool = model, layers, keep, pool

    @classmethod
    def build(cls, model, pool: KVPool, act: int, act_table: torch.Tensor | None = None,
              swa: list[bool] | None = None, post_norms: bool = False) -> FusedLayers | None:
        """The description of ``model``'s layers (models/llama.py's or gemma3.py's dicts) over
        ``pool``, or None where the native path cannot compute them as the model does: no
        native kernels, a model off the CPU or not in float32, a matrix not in blocks the
        matmul reads, a pool of another dtype. swa: per layer, whether it is a sliding-window
        one (its rope table 1, its window the config's); post_norms: Gemma's norms after
        attention and feed-forward, and on q and k."""
        c = model.config
        if not native.available() or model.dtype != torch.float32 or torch.device(model.device).type != "cpu":
            return None
        if pool.dtype not in native.KV_TYPES or pool.k[0].device.type != "cpu":
            return None
        keep: list = [act_table]
        layers = (_Layer * c.n_layer)()

        def ptr(t: torch.Tensor | None):
            if t is None:
                return None
            t = t.detach().float().contiguous()
            keep.append(t)
            return t.data_ptr()

        def mats(layer, limit: int) -> list[_Mat] | None:
            """The matmuls of a layer (a Parallel's groups, in order), or None."""
            groups = _groups(layer)
            if groups is None or len(groups) > limit:
                return None
            keep.extend(groups)
            return [_Mat(g.blocks.data_ptr(), g.matmul.code, g.matmul.n, ptr(g.bias)) for g in groups]

        for i, src in enumerate(model.layers):
            dst = layers[i]
            qkv, gate_up, o, down = (mats(src[k], n) for k, n in (("qkv", 3), ("gate_up", 2), ("o", 1), ("down", 1)))
            if qkv is None or gate_up is None or o is None or down is None:
                return None
            dst.n_qkv, dst.n_gate_up, dst.o, dst.down = len(qkv), len(gate_up), o[0], down[0]
            for j, m in enumerate(qkv):
                dst.qkv[j] = m
            for j, m in enumerate(gate_up):
                dst.gate_up[j] = m
            dst.attn_norm, dst.ffn_norm = ptr(src["attn_norm"]), ptr(src["ffn_norm"])
            if post_norms:
                dst.q_norm, dst.k_norm = ptr(src["q_norm"]), ptr(src["k_norm"])
                dst.post_attn_norm, dst.post_ffn_norm = ptr(src["post_attn_norm"]), ptr(src["post_ffn_norm"])
            dst.k_cache, dst.v_cache = pool.k[i].data_ptr(), pool.v[i].data_ptr()
            if pool.is_quantized:
                dst.k_scales, dst.v_scales = pool.k_scales[i].data_ptr(), pool.v_scales[i].data_ptr()
                if pool.k_smooth is not None:
                    dst.k_smooth = ptr(pool.k_smooth[i])
            local = bool(swa and swa[i])
            dst.rope, dst.n_swa = int(local), c.n_swa if local else 0
        d_ff = model.layers[0]["down"].in_features
        if any(src["down"].in_features != d_ff for src in model.layers):
            return None
        desc = _Model(c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, d_ff, int(model.rope_neox),
                      native.KV_TYPES[pool.dtype], pool.block_size, act, c.rms_eps, model.scale,
                      act_table.data_ptr() if act_table is not None else None, layers)
        return cls(desc, layers, keep, pool)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, batch: AttnBatch, ropes: list[Rope]) -> None:
        """Run every layer on x (N, d) float32, contiguous, in place; ropes: the tables of the
        layers' rope 0 (and 1)."""
        rows = [rope.rows(positions) for rope in ropes]
        cos = (_vp * 2)(*[r[0].data_ptr() for r in rows] + [None] * (2 - len(rows)))
        sin = (_vp * 2)(*[r[1].data_ptr() for r in rows] + [None] * (2 - len(rows)))
        q_start, q_len, ctx_len, tables, table_start = batch.native_meta
        slots = batch.slots.contiguous()
        rc = _function()(ctypes.byref(self.model), x.data_ptr(), x.shape[0], slots.data_ptr(), q_len.numel(),
                         q_start.data_ptr(), q_len.data_ptr(), ctx_len.data_ptr(), tables.data_ptr(),
                         table_start.data_ptr(), cos, sin, native.threads())
        if rc:
            raise RuntimeError(f"native layers failed: {native._ERRORS.get(rc, rc)}")


class FusedSlot:
    """A model's native layers over the pool it runs on: built at its first step there
    (``build`` gives None where they cannot compute the model) and used for batches of the
    native attention. ``on`` False keeps the torch path (the tests compare the two)."""

    def __init__(self, build: Callable[[KVPool], FusedLayers | None]):
        self.build, self.on = build, True
        self.held: tuple[KVPool, FusedLayers | None] | None = None

    @property
    def computing(self) -> bool:
        """Whether the native layers computed the last pool's steps (built, and not None)."""
        return self.held is not None and self.held[1] is not None

    def get(self, pool: KVPool, batch) -> FusedLayers | None:
        if not self.on or batch.native_meta is None:
            return None
        if self.held is None or self.held[0] is not pool:
            self.held = (pool, self.build(pool))
        return self.held[1]
