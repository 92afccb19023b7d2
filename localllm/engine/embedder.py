"""Embedder: texts to vectors with an embedding model, below the doors.

Supported are the GGUF files llama.cpp runs as embedding models: BERT-family encoders
(all-MiniLM-L6-v2, bge, nomic-embed, ...) and decoders whose file asks for last-token
pooling (Qwen3-Embedding). Each input is a list of token ids, 1 to ``n_ctx`` long. Inputs
are packed in order into batches of at most ``n_ctx`` tokens and ``MAX_SEQS`` inputs, one
llama.cpp call a batch; each input is pooled on its own (by mean, its first or its last
token, as the file's ``{arch}.pooling_type`` says) and scaled to length 1. So a vector does
not depend on what else was in its batch, beyond float rounding (about 1e-6).

A GGUF file has no key for normalization; every vector is L2-normalized, as
sentence-transformers' Normalize module and llama.cpp's own server do by default.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from localllm.config import physical_cores
from localllm.errors import EngineError, UsageError
from localllm.gguf import embedding_pooling, read_info

MAX_INPUT_TOKENS = 8192  # an encoder attends over a whole batch at once: memory grows with its square
MAX_SEQS = 64  # inputs in one llama.cpp call
FA_TILE = 64  # GGML_FA_TILE_Q in the llama.cpp of llama-cpp-python 0.3.36 (ggml-cpu/common.h)
DEFAULT_CONTEXT = 512  # tokens per input for a file that names no context length


def is_embedding_model(path: str | Path) -> bool:
    """Whether the GGUF file at path is an embedding model, from its metadata alone (no
    llama.cpp load: its architecture and pooling type). Raises ModelLoadError for a file
    that is not a readable GGUF model."""
    return embedding_pooling(read_info(path)) is not None


class Embedder:
    """One embedding model, loaded: ``embed(inputs)`` from any thread (one lock)."""

    def __init__(self, model_path: Path, n_threads: int | None = None):
        from localllm.runners.llamacpp import LlamaEmbeddingModel

        path = Path(model_path)
        info = read_info(path)
        pooling = embedding_pooling(info)
        if pooling is None:
            raise UsageError(f"{path.name} is not an embedding model (architecture {info.architecture}, "
                             "no pooling type in its metadata); embed with a model such as "
                             "all-MiniLM-L6-v2, bge or Qwen3-Embedding")
        if n_threads is not None and n_threads < 1:
            raise UsageError(f"n_threads {n_threads} must be 1 or more (None: the physical cores)")
        self.name = path.stem
        self.pooling = pooling
        self.normalize = True
        self.n_threads = n_threads or physical_cores()
        # A multiple of MAX_SEQS: llama.cpp splits its token budget evenly between sequences.
        n_ctx = min(info.context_length or DEFAULT_CONTEXT, MAX_INPUT_TOKENS)
        self.n_ctx = max(MAX_SEQS, n_ctx - n_ctx % MAX_SEQS)
        self._model = LlamaEmbeddingModel(path, pooling, n_ctx=self.n_ctx, max_seqs=MAX_SEQS,
                                          threads=self.n_threads)
        self.dim = self._model.dim
        self.n_vocab = self._model.vocab.n_vocab
        self._lock = threading.Lock()

    def tokenize(self, text: str, max_tokens: int | None = None) -> list[int]:
        """The token ids of text with the special tokens the model adds ([CLS] ... [SEP] for
        BERT); special-token text inside it stays plain text. With ``max_tokens``, a longer
        text's own tokens are cut at the end to fit and the model's special tokens kept around
        them, as sentence-transformers truncates (a last-token pooled model keeps its EOS)."""
        if not isinstance(text, str):
            raise UsageError(f"an embedding input must be text, not {type(text).__name__}")
        data = text.encode("utf-8")
        with self._lock:
            vocab = self._open().vocab
            ids = vocab.tokenize(data, add_special=True, parse_special=False)
            if max_tokens is None or len(ids) <= max_tokens:
                return ids
            plain = vocab.tokenize(data, add_special=False, parse_special=False)
        extra = len(ids) - len(plain)  # the specials around the text: [CLS] and [SEP], or an EOS
        lead = next((k for k in range(extra + 1) if ids[k:k + len(plain)] == plain), 0)
        keep = max(1, max_tokens - extra)
        return ids[:lead] + plain[:keep] + ids[lead + len(plain):]

    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """One vector of ``dim`` floats (length 1) per input, in order. Raises UsageError for
        no inputs, an empty or over-long input, or a token id outside the vocabulary."""
        batch = self._checked(inputs)
        vectors = np.empty((len(batch), self.dim), dtype=np.float32)  # (n, dim)
        with self._lock:
            model = self._open()
            for start, stop in self._batches(batch):
                vectors[start:stop] = model.embed(batch[start:stop])
        if self.normalize:
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)  # (n, 1)
            vectors /= np.maximum(norms, 1e-12)
        return vectors.tolist()

    def close(self) -> None:
        with self._lock:
            if self._model is not None:
                self._model.close()
                self._model = None

    # -- helpers ------------------------------------------------------------------------

    def _open(self):
        if self._model is None:
            raise EngineError(f"the embedding model {self.name} was closed; load it again")
        return self._model

    def _checked(self, inputs) -> list[list[int]]:
        if not isinstance(inputs, (list, tuple)) or not inputs:
            raise UsageError("embeddings need at least one input; pass a list of token-id lists")
        checked = []
        for i, ids in enumerate(inputs):
            if not isinstance(ids, (list, tuple)):
                raise UsageError(f"input {i} is {type(ids).__name__}, not a list of token ids")
            if not ids:
                raise UsageError(f"input {i} is empty; each input needs at least 1 token")
            if len(ids) > self.n_ctx:
                raise UsageError(f"input {i} is {len(ids)} tokens long; {self.name} takes at most "
                                 f"{self.n_ctx} tokens per input; shorten or split it")
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < self.n_vocab:
                    raise UsageError(f"input {i} holds {t!r}, not a token id of {self.name} "
                                     f"(0..{self.n_vocab - 1})")
            checked.append([int(t) for t in ids])
        return checked

    def _batches(self, inputs: list[list[int]]):
        """(start, stop) ranges of inputs that go through llama.cpp together. An input of
        FA_TILE tokens or more goes alone; shorter ones share calls of fewer than FA_TILE
        tokens in all (and at most MAX_SEQS inputs), which llama.cpp's CPU flash attention
        computes one query at a time, skipping other inputs' keys: bit for bit what the input
        gets alone. From FA_TILE queries on it works in tiles of keys, whose rounding depends
        on where an input's keys fall, and the GELU's float16 table can turn that rounding
        into 1e-4 in the vector."""
        start, num_tokens = 0, 0
        for i, ids in enumerate(inputs):
            n = len(ids)
            if i > start and (n >= FA_TILE or num_tokens + n >= FA_TILE or i - start == MAX_SEQS):
                yield start, i
                start, num_tokens = i, 0
            num_tokens += n
        yield start, len(inputs)
