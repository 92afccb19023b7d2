"""Llama 3.x and Mistral (llama.cpp's ``llama`` architecture): RMS norm, rope on adjacent
pairs, grouped-query attention, SwiGLU feed-forward, no biases."""

from __future__ import annotations

import math

import torch

from localllm.runners.torch.attention import AttnBatch, KVPool
from localllm.runners.torch.fused import ACT_SILU, FusedLayers, FusedSlot
from localllm.runners.torch.layers import LayerSource, Parallel, Rope, rms_norm, silu_mul
from localllm.runners.torch.weights import ModelConfig


class LlamaModel:
    rope_neox = False
    qkv_bias = False

    def __init__(self, config: ModelConfig, weights: LayerSource, dtype: torch.dtype, device):
        """dtype: what the matmuls take (float32, or bfloat16 for quantized weights); the
        residual stream, norms, rope and attention stay float32."""
        self.config, self.dtype, self.device = config, dtype, device
        self.embed = weights.embedding("token_embd.weight", dtype)  # (vocab, d)
        self.layers = [self._load_layer(weights, i) for i in range(config.n_layer)]
        self.norm = weights.vector("output_norm.weight")
        self.lm_head = weights.linear("output" if weights.has("output.weight") else "token_embd")
        self.rope = Rope(config.head_dim, config.rope_base, self.rope_neox, device)
        self.scale = config.attn_scale or 1.0 / math.sqrt(config.head_dim)
        # every layer of a step in one native call where they can compute this model
        self.fused = FusedSlot(lambda pool: FusedLayers.build(self, pool, ACT_SILU))

    def _load_layer(self, w: LayerSource, i: int) -> dict:
        p = f"blk.{i}"
        return {
            "attn_norm": w.vector(f"{p}.attn_norm.weight"),
            "qkv": Parallel([w.linear(f"{p}.attn_{x}", bias=self.qkv_bias) for x in "qkv"]),
            "o": w.linear(f"{p}.attn_output"),
            "ffn_norm": w.vector(f"{p}.ffn_norm.weight"),
            "gate_up": Parallel([w.linear(f"{p}.ffn_gate"), w.linear(f"{p}.ffn_up")]),
            "down": w.linear(f"{p}.ffn_down"),
        }

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                pool: KVPool) -> torch.Tensor:
        """Hidden states (N, d) after the final norm, for the flattened batch's tokens."""
        c, dt = self.config, self.dtype
        x = self.embed[tokens].float()
        fused = self.fused.get(pool, batch)
        if fused is not None:
            fused(x, positions, batch, [self.rope])
            return rms_norm(x, self.norm, c.rms_eps)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer["attn_norm"], c.rms_eps).to(dt)
            # (float32 + bfloat16 adds in float32, converting in the same kernel: as many
            # kernels fewer on a GPU, the same bits.)
            q, k, v = layer["qkv"](h, torch.float32)
            q = self.rope(q.view(-1, c.n_head, c.head_dim), positions)
            k = self.rope(k.view(-1, c.n_head_kv, c.head_dim), positions)
            v = v.view(-1, c.n_head_kv, c.head_dim)
            pool.write(i, batch.slots, k, v)
            a = batch.attend(q, pool, i, self.scale)
            x = x + layer["o"](a.reshape(-1, c.n_head * c.head_dim).to(dt))
            h = rms_norm(x, layer["ffn_norm"], c.rms_eps).to(dt)
            gate, up = layer["gate_up"](h, torch.float32)
            x = x + layer["down"](silu_mul(gate, up).to(dt))
        return rms_norm(x, self.norm, c.rms_eps)

    def reserve_positions(self, n: int) -> None:
        """Rope tables for positions below n, made now (see Rope.reserve)."""
        self.rope.reserve(n)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.to(self.dtype)).float()
