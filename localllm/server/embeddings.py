"""OpenAI's `/v1/embeddings` over an embedding model (engine/embedder.py), served beside the
chat model with `serve --embedding-model MODEL`: `input` as a string, a list of strings, token
ids or lists of token ids; `encoding_format` float or base64 (little-endian float32, as
OpenAI sends it); `dimensions` keeps a vector's first N components and scales them back to
length 1 (meaningful for models trained for it, Matryoshka-style: nomic-embed v1.5,
Qwen3-Embedding); usage. Pooling and normalization are the model's (its GGUF metadata).

An input longer than the model's context is cut to it at the end of its text, the model's
special tokens kept ([CLS] ... [SEP]; a last-token pooled model's EOS), as Ollama and
sentence-transformers cut it: Continue's `@codebase` chunks code by its own tokenizer's count
(500), which all-MiniLM-L6-v2's WordPiece makes longer than its 512. `truncate: false`
(Ollama's name) makes such an input a 400 naming the limit; usage counts the tokens embedded.

A chat model asked for embeddings is a 400 that names the embedding model to ask instead (or
says the server has none): localllm does not mean-pool a chat model's states for you (they make
poor embeddings), as vLLM and llama-server don't by default. `model` absent means the embedding
model. Errors have OpenAI's shape and, as every error of the server, say what the client can do
(no command-line flag: the client did not start the server).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from localllm.errors import UsageError
from localllm.server.errors import APIError
from localllm.server.models import ServedModels
from localllm.server.protocol import Int, KeepAlive

MAX_INPUTS = 2048  # OpenAI's limit for one request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None  # absent: the embedding model
    keep_alive: KeepAlive = None
    input: str | list[str] | list[Int] | list[list[Int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate: bool = True  # Ollama's: an input over the model's context is cut to it; false: a 400


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Embeddings:
    """One request's embeddings from the embedding model its lease holds (models.py checks
    that the model named is one; none named: the first served)."""

    def __init__(self, embedder, name: str):
        self.embedder, self.name = embedder, name

    async def embed(self, req: EmbeddingRequest) -> dict:
        embedder = self.embedder
        inputs = self.token_lists(req.input, embedder.n_ctx if req.truncate else None)
        if req.dimensions is not None and req.dimensions > embedder.dim:
            raise APIError(400, f"dimensions {req.dimensions} is more than the {embedder.dim} this model gives",
                           param="dimensions")
        try:
            vectors = await asyncio.to_thread(embedder.embed, inputs)
        except UsageError as e:
            raise APIError(400, str(e), param="input") from None
        data = []
        for i, vector in enumerate(vectors):
            v = np.asarray(vector, dtype=np.float32)
            if req.dimensions is not None and req.dimensions < v.size:
                v = v[:req.dimensions]
                v = v / max(float(np.linalg.norm(v)), 1e-12)
            value = base64.b64encode(v.astype("<f4").tobytes()).decode() if req.encoding_format == "base64" \
                else v.tolist()
            data.append(Embedding(index=i, embedding=value))
        num_tokens = sum(len(ids) for ids in inputs)
        return EmbeddingList(data=data, model=self.name,
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)).model_dump()

    def token_lists(self, value, max_tokens: int | None = None) -> list[list[int]]:
        """The request's inputs as token-id lists, each checked: not empty, in the vocabulary;
        with ``max_tokens``, each cut to that many (text around the model's special tokens)."""
        if isinstance(value, str):
            value = [value]
        elif value and isinstance(value[0], int):
            value = [value]
        if not value:
            raise APIError(400, "input is empty; give a string, a list of strings or token ids", param="input")
        if len(value) > MAX_INPUTS:
            raise APIError(400, f"{len(value)} inputs in one request, more than {MAX_INPUTS}; send them in parts",
                           param="input")
        lists = []
        for i, item in enumerate(value):
            ids = self.embedder.tokenize(item, max_tokens) if isinstance(item, str) else list(item)[:max_tokens]
            if not ids or (isinstance(item, str) and not item):
                raise APIError(400, f"input {i} is empty; every input needs some text", param=f"input.{i}")
            bad = next((t for t in ids if not 0 <= t < self.embedder.n_vocab), None)
            if bad is not None:
                raise APIError(400, f"input {i}: token id {bad} is outside the vocabulary of "
                                    f"{self.embedder.n_vocab}", param=f"input.{i}")
            lists.append(ids)
        return lists


def add_routes(app: FastAPI, models: ServedModels) -> None:
    @app.post("/v1/embeddings", response_model=EmbeddingList)
    async def embeddings(body: EmbeddingRequest, request: Request):
        if (upstream := models.upstream(body.model)) is not None:
            return await models.forwarder.forward(upstream, "/embeddings", request)
        async with models.lease(body.model, body.keep_alive, kind="embedding") as lease:
            return await Embeddings(lease.embedder, lease.model.entry.name).embed(body)
