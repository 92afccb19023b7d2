"""Gemma 3 (llama.cpp's ``gemma3``): embeddings scaled by sqrt(d), RMS norms before and after
attention and feed-forward, QK-norm, GELU-gated feed-forward, rope on halves, and layers
that alternate five sliding-window ones (local rope base 10,000) with one global one.

Norm weights are used as stored: llama.cpp's converter has already added Gemma's "+1"."""

from __future__ import annotations

import math

import torch

from localllm.runners.torch.attention import AttnBatch, KVPool
from localllm.runners.torch.fused import ACT_GELU, FusedLayers, FusedSlot
from localllm.runners.torch.layers import LayerSource, Parallel, Rope, gelu_table, gelu_ggml, rms_norm
from localllm.runners.torch.weights import ModelConfig


class Gemma3Model:
    rope_neox = True  # (rope on halves)

    def __init__(self, config: ModelConfig, weights: LayerSource, dtype: torch.dtype, device):
        self.config, self.dtype, self.device = config, dtype, device
        self.embed = weights.embedding("token_embd.weight", dtype)
        self.layers = [self._load_layer(weights, i) for i in range(config.n_layer)]
        self.norm = weights.vector("output_norm.weight")
        self.lm_head = weights.linear("output" if weights.has("output.weight") else "token_embd")
        self.rope_global = Rope(config.head_dim, config.rope_base, True, device)
        self.rope_local = Rope(config.head_dim, config.rope_base_swa, True, device)
        self.scale = config.attn_scale or 1.0 / math.sqrt(config.head_dim)
        # every layer of a step in one native call where they can compute this model: rope
        # table 1 and the window for the sliding-window layers
        swa = [config.is_swa(i) for i in range(config.n_layer)]
        self.fused = FusedSlot(lambda pool: FusedLayers.build(self, pool, ACT_GELU, gelu_table(), swa=swa,
                                                              post_norms=True))

    def _load_layer(self, w: LayerSource, i: int) -> dict:
        p = f"blk.{i}"
        return {
            "attn_norm": w.vector(f"{p}.attn_norm.weight"),
            "qkv": Parallel([w.linear(f"{p}.attn_{x}") for x in "qkv"]),
            "q_norm": w.vector(f"{p}.attn_q_norm.weight"),
            "k_norm": w.vector(f"{p}.attn_k_norm.weight"),
            "o": w.linear(f"{p}.attn_output"),
            "post_attn_norm": w.vector(f"{p}.post_attention_norm.weight"),
            "ffn_norm": w.vector(f"{p}.ffn_norm.weight"),
            "gate_up": Parallel([w.linear(f"{p}.ffn_gate"), w.linear(f"{p}.ffn_up")]),
            "down": w.linear(f"{p}.ffn_down"),
            "post_ffn_norm": w.vector(f"{p}.post_ffw_norm.weight"),
        }

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                pool: KVPool) -> torch.Tensor:
        c, dt = self.config, self.dtype
        x = self.embed[tokens].float() * math.sqrt(c.n_embd)
        fused = self.fused.get(pool, batch)
        if fused is not None:
            fused(x, positions, batch, [self.rope_global, self.rope_local])
            return rms_norm(x, self.norm, c.rms_eps)
        for i, layer in enumerate(self.layers):
            local = c.is_swa(i)
            rope = self.rope_local if local else self.rope_global
            h = rms_norm(x, layer["attn_norm"], c.rms_eps).to(dt)
            q, k, v = layer["qkv"](h, torch.float32)
            q = rms_norm(q.float().view(-1, c.n_head, c.head_dim), layer["q_norm"], c.rms_eps)
            k = rms_norm(k.float().view(-1, c.n_head_kv, c.head_dim), layer["k_norm"], c.rms_eps)
            v = v.float().view(-1, c.n_head_kv, c.head_dim)
            q, k = rope(q, positions), rope(k, positions)
            pool.write(i, batch.slots, k, v)
            a = batch.attend(q, pool, i, self.scale, c.n_swa if local else 0)
            o = layer["o"](a.reshape(-1, c.n_head * c.head_dim).to(dt)).float()
            x = x + rms_norm(o, layer["post_attn_norm"], c.rms_eps)
            h = rms_norm(x, layer["ffn_norm"], c.rms_eps).to(dt)
            gate, up = layer["gate_up"](h, torch.float32)
            f = layer["down"]((gelu_ggml(gate.float()) * up.float()).to(dt)).float()
            x = x + rms_norm(f, layer["post_ffn_norm"], c.rms_eps)
        return rms_norm(x, self.norm, c.rms_eps)

    def reserve_positions(self, n: int) -> None:
        """Rope tables for positions below n, made now (see Rope.reserve)."""
        self.rope_global.reserve(n)
        self.rope_local.reserve(n)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.to(self.dtype)).float()
