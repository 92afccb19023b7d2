"""llama-server's `/tokenize` and `/detokenize`: text to the served model's token ids and back,
as llama-server's clients (token counters, prompt builders) call them.

`/tokenize` takes `content`, `add_special` (BOS and the like, default false) and
`parse_special` (control-token text such as `<|im_start|>` read as that token, default true,
as llama-server reads it; a plain prompt to /v1/completions never is: send its ids for that);
with `with_pieces` each token comes with its piece, text where the token's bytes are whole
UTF-8 and their byte values where not (a token that holds part of a character). Fields
llama-server takes that mean nothing here are ignored, as in `/infill`; a token id outside the
vocabulary is a 400. Errors have OpenAI's shape, as llama-server's do.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from localllm.errors import UsageError
from localllm.server.core import Server
from localllm.server.errors import APIError
from localllm.server.models import ServedModels
from localllm.server.protocol import Int, KeepAlive


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    keep_alive: KeepAlive = None
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class TokenPiece(BaseModel):
    id: int
    piece: str | list[int]  # the token's text, or its bytes where they are not whole UTF-8


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[TokenPiece]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    keep_alive: KeepAlive = None
    tokens: list[Int]


class DetokenizeResponse(BaseModel):
    content: str


class Tokens:
    def __init__(self, server: Server):
        self.server = server
        self.tokenizer = server.tokenizer

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        tok = self.tokenizer
        try:
            if req.parse_special:
                ids = await asyncio.to_thread(tok.encode_special, req.content, req.add_special)
            else:
                ids = await asyncio.to_thread(tok.encode, req.content, req.add_special)
        except UsageError as e:
            raise APIError(400, str(e), param="content") from None
        if not req.with_pieces:
            return TokenizeResponse(tokens=ids)
        return TokenizeResponse(tokens=[TokenPiece(id=t, piece=_piece(tok.piece(t, special=True))) for t in ids])

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        n_vocab = self.tokenizer.n_vocab
        bad = next((t for t in req.tokens if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary of {n_vocab} (ids 0..{n_vocab - 1})",
                           param="tokens")
        data = b"".join(self.tokenizer.piece(t, special=True) for t in req.tokens)
        return DetokenizeResponse(content=data.decode("utf-8", errors="replace"))


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def add_routes(app: FastAPI, models: ServedModels) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest):
        async with models.lease(body.model, body.keep_alive) as lease:
            return await Tokens(lease.server).tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest):
        async with models.lease(body.model, body.keep_alive) as lease:
            return await Tokens(lease.server).detokenize(body)
