"""Weights and hyper-parameters from a GGUF file, as torch tensors.

GGUF stores a matrix with its dimensions fastest-first (``ne = [in, out]``), so its rows are
the output features: the ``(out, in)`` layout of ``torch.nn.functional.linear``. Quantized
tensors are dequantized with the `gguf` package (float32, exact to what llama.cpp's own
dequantization gives).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from localllm.errors import ModelLoadError


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float
    rope_base: float
    n_ctx_train: int
    n_swa: int = 0  # sliding window of the local layers; 0: none
    swa_layers: tuple[bool, ...] = ()  # per layer: True where attention slides
    rope_base_swa: float = 10000.0  # the local layers' rope base (gemma3)
    attn_scale: float | None = None  # None: 1 / sqrt(head_dim)

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]


class GGUFWeights:
    """The tensors of one GGUF file, by name, memory-mapped until asked for. The header is
    read (and checked) by localllm.gguf, which skips the vocabulary's strings: the `gguf`
    package's reader decodes every one of them, seconds for a 150k-token vocabulary."""

    def __init__(self, path: Path):
        from localllm.gguf import tensor_table

        self.path = Path(path)
        self._meta, self._data_start, tensors = tensor_table(self.path)
        self._tensors = {t.name: t for t in tensors}
        # Copy-on-write: torch takes the blocks as writable tensors; nothing writes them, so
        # every page stays the file's own (shared with the page cache, never copied).
        self._file = np.memmap(self.path, dtype=np.uint8, mode="c")

    def meta(self, key: str, default=None):
        return self._meta.get(key, default)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].type_name

    def _entry(self, name: str):
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path.name} has no tensor {name!r}; the file is incomplete or "
                                 "not of the architecture it names")
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        """(out, in) for a matrix, (n,) for a vector: torch's order, not GGUF's."""
        return tuple(int(n) for n in reversed(self._entry(name).shape))

    def raw(self, name: str) -> tuple[np.ndarray, int, int]:
        """A matrix's stored bytes, one row of the file's blocks per output row, with (rows, cols)."""
        t = self._entry(name)
        start = self._data_start + t.offset
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        return self._file[start:start + t.num_bytes].reshape(rows, -1), rows, int(t.shape[0])

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor ``name`` dequantized, shape (out, in) for matrices, (n,) for vectors."""
        import gguf

        t = self._entry(name)
        data, rows, cols = self.raw(name)
        if t.type_name == "F32":
            array = data.view(np.float32)
        elif t.type_name == "F16":
            array = data.view(np.float16).astype(np.float32)
        else:  # BF16 and the quantized types
            array = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[t.type_name])
        shape = tuple(int(n) for n in reversed(t.shape))  # (out, in)
        return torch.from_numpy(np.array(array.reshape(shape), dtype=np.float32)).to(dtype)

    @property
    def is_quantized(self) -> bool:
        """True when some matrix is stored below 16 bits (then the runner computes in bfloat16)."""
        return any(t.type_name not in ("F32", "F16", "BF16") for t in self._tensors.values())

    def config(self) -> ModelConfig:
        arch = self.meta("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path.name} does not say its architecture (general.architecture)")

        def need(key: str):
            value = self.meta(f"{arch}.{key}")
            if value is None:
                raise ModelLoadError(f"{self.path.name} lacks {arch}.{key}")
            return value

        n_embd, n_head = int(need("embedding_length")), int(need("attention.head_count"))
        n_head_kv = int(self.meta(f"{arch}.attention.head_count_kv", n_head))
        head_dim = int(self.meta(f"{arch}.attention.key_length", n_embd // n_head))
        n_layer = int(need("block_count"))
        n_swa = int(self.meta(f"{arch}.attention.sliding_window", 0) or 0)
        swa_layers: tuple[bool, ...] = ()
        if arch == "gemma3" and n_swa:
            swa_layers = tuple(i % 6 < 5 for i in range(n_layer))  # 5 local layers, then 1 global
        vocab = self._entry("token_embd.weight").shape[1]
        return ModelConfig(
            arch=arch, n_vocab=int(vocab), n_embd=n_embd, n_layer=n_layer, n_head=n_head,
            n_head_kv=n_head_kv, head_dim=head_dim, n_ff=int(need("feed_forward_length")),
            rms_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_base=float(self.meta(f"{arch}.rope.freq_base", 10000.0)),
            n_ctx_train=int(self.meta(f"{arch}.context_length", 4096)),
            n_swa=n_swa if swa_layers else 0, swa_layers=swa_layers,
        )
