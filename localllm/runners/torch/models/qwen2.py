"""Qwen2 / Qwen2.5 / Qwen2.5-Coder (llama.cpp's ``qwen2``): Llama's layout with biases on the
Q, K and V projections and rope on halves (NEOX)."""

from __future__ import annotations

from localllm.runners.torch.models.llama import LlamaModel


class Qwen2Model(LlamaModel):
    rope_neox = True
    qkv_bias = True
