"""Gemma 3 (llama.cpp's ``gemma3``): embeddings scaled by sqrt(d), RMS norms before and after
attention and feed-forward, QK-norm, GELU-gated feed-forward, rope on halves, and layers
that alternate five sliding-window ones (local rope base 10,000) with one global one.

Norm weights are used as stored: llama.cpp's converter has already added Gemma's "+1"."""

from __future__ import annotations

import math

import torch

from localllm.runners.torch.attention import AttnBatch, KVPool, paged_attention
from localllm.runners.torch.layers import Rope, gelu_ggml, load_linear, rms_norm, vector
from localllm.runners.torch.weights import GGUFWeights, ModelConfig


class Gemma3Model:
    def __init__(self, config: ModelConfig, weights: GGUFWeights, dtype: torch.dtype, device):
        self.config, self.dtype, self.device = config, dtype, device
        self.embed = weights.get("token_embd.weight").to(device=device, dtype=dtype)
        self.layers = [self._load_layer(weights, i) for i in range(config.n_layer)]
        self.norm = vector(weights, "output_norm.weight", torch.float32, device)
        self.lm_head = load_linear(weights, "output" if weights.has("output.weight") else "token_embd",
                                   dtype, device)
        self.rope_global = Rope(config.head_dim, config.rope_base, True, device)
        self.rope_local = Rope(config.head_dim, config.rope_base_swa, True, device)
        self.scale = config.attn_scale or 1.0 / math.sqrt(config.head_dim)

    def _load_layer(self, w: GGUFWeights, i: int) -> dict:
        p, dt, dev, f32 = f"blk.{i}", self.dtype, self.device, torch.float32
        return {
            "attn_norm": vector(w, f"{p}.attn_norm.weight", f32, dev),
            "q": load_linear(w, f"{p}.attn_q", dt, dev),
            "k": load_linear(w, f"{p}.attn_k", dt, dev),
            "v": load_linear(w, f"{p}.attn_v", dt, dev),
            "q_norm": vector(w, f"{p}.attn_q_norm.weight", f32, dev),
            "k_norm": vector(w, f"{p}.attn_k_norm.weight", f32, dev),
            "o": load_linear(w, f"{p}.attn_output", dt, dev),
            "post_attn_norm": vector(w, f"{p}.post_attention_norm.weight", f32, dev),
            "ffn_norm": vector(w, f"{p}.ffn_norm.weight", f32, dev),
            "gate": load_linear(w, f"{p}.ffn_gate", dt, dev),
            "up": load_linear(w, f"{p}.ffn_up", dt, dev),
            "down": load_linear(w, f"{p}.ffn_down", dt, dev),
            "post_ffn_norm": vector(w, f"{p}.post_ffw_norm.weight", f32, dev),
        }

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                pool: KVPool) -> torch.Tensor:
        c, dt = self.config, self.dtype
        x = self.embed[tokens].float() * math.sqrt(c.n_embd)
        for i, layer in enumerate(self.layers):
            local = c.is_swa(i)
            rope = self.rope_local if local else self.rope_global
            h = rms_norm(x, layer["attn_norm"], c.rms_eps).to(dt)
            q = rms_norm(layer["q"](h).float().view(-1, c.n_head, c.head_dim), layer["q_norm"], c.rms_eps)
            k = rms_norm(layer["k"](h).float().view(-1, c.n_head_kv, c.head_dim), layer["k_norm"], c.rms_eps)
            v = layer["v"](h).float().view(-1, c.n_head_kv, c.head_dim)
            q, k = rope(q, positions), rope(k, positions)
            pool.write(i, batch.slots, k, v)
            a = paged_attention(q, pool, i, batch, self.scale, c.n_swa if local else 0)
            o = layer["o"](a.reshape(-1, c.n_head * c.head_dim).to(dt)).float()
            x = x + rms_norm(o, layer["post_attn_norm"], c.rms_eps)
            h = rms_norm(x, layer["ffn_norm"], c.rms_eps).to(dt)
            f = layer["down"]((gelu_ggml(layer["gate"](h).float()) * layer["up"](h).float()).to(dt)).float()
            x = x + rms_norm(f, layer["post_ffn_norm"], c.rms_eps)
        return rms_norm(x, self.norm, c.rms_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.to(self.dtype)).float()
