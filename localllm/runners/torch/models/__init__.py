"""Model families by the GGUF's ``general.architecture``: one file each."""

from __future__ import annotations

from localllm.runners.torch.weights import ModelConfig

# architecture -> "module:Class", imported when used
REGISTRY = {
    "llama": "localllm.runners.torch.models.llama:LlamaModel",
    "qwen2": "localllm.runners.torch.models.qwen2:Qwen2Model",
    "gemma3": "localllm.runners.torch.models.gemma3:Gemma3Model",
}


def supported(arch: str) -> bool:
    return arch in REGISTRY


def build(config: ModelConfig, source, dtype, device):
    """The model of ``config.arch`` with its tensors from ``source`` (a layers.LayerSource)."""
    import importlib

    module, name = REGISTRY[config.arch].split(":")
    return getattr(importlib.import_module(module), name)(config, source, dtype, device)
