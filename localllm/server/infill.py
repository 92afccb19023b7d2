"""llama.cpp's `/infill` (fill-in-the-middle for editors: llama.vscode, llama.vim) over the shared
request path (core.Server), on the same FIM prompt as `/v1/completions`' `suffix`
(Tokenizer.encode_fim): `input_prefix`, `input_suffix`, `input_extra` (other files as context),
`prompt` (text already typed at the cursor), streaming as llama-server streams it.

Fields llama-server takes that mean nothing here (`cache_prompt`: the prefix cache always
caches; `samplers`, `id_slot`, ...) are accepted and ignored; a known field of the
wrong type is a 400. `response_fields` (llama.vim's) picks the fields of the answer, as in
llama-server: a flat object keyed by each path asked for ("timings/prompt_n"), the paths that
exist only. `t_max_predict_ms` ends the answer once that long has
passed since its first token and it holds a newline, and `n_indent` at a line indented less
than the cursor's, as llama-server does. Errors have
OpenAI's shape, as llama-server's do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, RootModel

from localllm.errors import LocalLLMError, UsageError
from localllm.server.core import Choice, Server, sse
from localllm.server.errors import APIError
from localllm.server.models import ServedModels
from localllm.server.protocol import Int, KeepAlive


class ExtraFile(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    filename: str = "tmp"
    text: str


class InfillRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    keep_alive: KeepAlive = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = Field(default_factory=list, max_length=256)
    prompt: str = ""
    n_predict: Int = Field(default=-1, ge=-1)  # -1: until the context is full
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_k: Int | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repeat_penalty: float | None = Field(default=None, ge=1e-3, le=1e3)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: Int | None = None
    stop: list[str] | None = None
    stream: bool = False
    t_max_predict_ms: Int | None = Field(default=None, ge=0)
    n_indent: Int | None = Field(default=None, ge=0)
    n_cmpl: Int = 1  # answers to the one prompt: above 1, a list of results (llama.vscode's alternatives)
    response_fields: list[str] | None = Field(default=None, max_length=64)


class InfillResult(BaseModel):
    """The end of an answer, as llama-server's /infill gives it (`content` is what editors read)."""

    model_config = ConfigDict(extra="allow")
    content: str
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    tokens_cached: int
    stop_type: str
    stopping_word: str
    truncated: bool
    timings: dict[str, Any]


class PickedFields(RootModel[dict[str, Any]]):
    """The answer with `response_fields`: each path asked for that it has ("timings/prompt_n"),
    flat."""


class Infill:
    def __init__(self, server: Server):
        self.server = server

    async def infill(self, req: InfillRequest, request: Request):
        server = self.server
        n = 1 if req.n_predict == 0 else req.n_cmpl
        if not 1 <= n <= server.max_num_seqs:  # llama-server's words, which llama.vscode reads
            raise APIError(400, f"Field 'n_cmpl': Value must be between 1 <= value <= {server.max_num_seqs}, "
                                f"but got {n}", param="n_cmpl")
        if n > 1 and req.stream:
            raise APIError(400, "n_cmpl above 1 is answered whole: send stream false", param="n_cmpl")
        # n_predict 0: the prompt only, into the prefix cache for the request to come (llama.vscode
        # sends its other files so as the person types); the one token it yields is dropped.
        n_predict = 1 if req.n_predict == 0 else req.n_predict if req.n_predict > 0 else None
        budget = server.max_model_len - (n_predict or 0)
        encode_fim = getattr(server.tokenizer, "encode_fim", None)
        if encode_fim is None:
            raise APIError(400, "fill-in-the-middle is not supported yet", param="input_prefix")
        try:
            prompt_ids = await asyncio.to_thread(
                encode_fim, req.input_prefix, req.input_suffix, [(f.filename, f.text) for f in req.input_extra],
                req.prompt, budget - 1)
        except UsageError as e:
            raise APIError(400, str(e), param="input_prefix") from None
        max_tokens = server.max_tokens_for(len(prompt_ids), n_predict, "n_predict")
        params = server.sampling_params(
            n=n, max_tokens=max_tokens, stop=tuple(req.stop or ()), seed=req.seed, top_p=req.top_p, top_k=req.top_k,
            temperature=req.temperature, min_p=req.min_p, repetition_penalty=req.repeat_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty)
        server.check_capacity(n)
        started = time.perf_counter()
        until = _limits(req.t_max_predict_ms, req.n_indent)
        if req.stream and req.n_predict != 0:
            return StreamingResponse(self.stream(prompt_ids, params, started, until, req.response_fields),
                                     media_type="text/event-stream")
        choices = await server.collect(request, prompt_ids, params, until)
        if req.n_predict == 0:
            choices[0].text, choices[0].token_ids, choices[0].finish_reason = "", [], "length"
        results = [self.result(c, prompt_ids, started, fields=req.response_fields) for c in choices]
        if req.stream:  # n_predict 0: nothing to stream but the end
            return StreamingResponse(iter([sse(results[0])]), media_type="text/event-stream")
        return results if req.n_cmpl > 1 and req.n_predict != 0 else results[0]

    def result(self, c: Choice, prompt_ids: list[int], started: float, content: str | None = None,
               fields: list[str] | None = None) -> dict:
        elapsed_ms = (time.perf_counter() - started) * 1000
        prompt_ms = (c.first_token_time - started) * 1000 if c.first_token_time is not None else elapsed_ms
        predicted_ms = max(elapsed_ms - prompt_ms, 0.0)
        num_prompt = len(prompt_ids) - c.num_cached_tokens
        stop_type = {"stop": "word" if c.stop_sequence is not None else "eos", "length": "limit"}.get(
            c.finish_reason or "", "none")
        result = InfillResult(
            content=c.text if content is None else content, stop=True, model=self.server.model_id,
            tokens_predicted=len(c.token_ids), tokens_evaluated=len(prompt_ids), tokens_cached=c.num_cached_tokens,
            stop_type=stop_type, stopping_word=c.stop_sequence or "", truncated=False,
            timings={"prompt_n": num_prompt, "prompt_ms": prompt_ms,
                     "prompt_per_token_ms": prompt_ms / num_prompt if num_prompt else 0.0,
                     "prompt_per_second": num_prompt / prompt_ms * 1000 if prompt_ms else 0.0,
                     "predicted_n": len(c.token_ids), "predicted_ms": predicted_ms,
                     "predicted_per_token_ms": predicted_ms / len(c.token_ids) if c.token_ids else 0.0,
                     "predicted_per_second": len(c.token_ids) / predicted_ms * 1000 if predicted_ms else 0.0}
        ).model_dump()
        return picked(result, fields) if fields else result

    async def stream(self, prompt_ids: list[int], params, started: float, until,
                     fields: list[str] | None = None) -> AsyncIterator[str]:
        """llama-server's stream: `{"content": piece, "stop": false}` per piece, then the result."""
        c, out, sent = Choice(0), None, 0
        try:
            async for _, out in self.server.run_choices(prompt_ids, params):
                self.server.add(c, out)
                cut = until is not None and c.finish_reason is None and until(c)
                if cut:
                    c.finish_reason = "length"
                if len(c.text) > sent and not out.finished:
                    yield sse({"content": c.text[sent:], "stop": False, "tokens": out.token_ids})
                    sent = len(c.text)
                if cut:
                    break
        except LocalLLMError as e:
            yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
            return
        yield sse(self.result(c, prompt_ids, started, content=c.text[sent:], fields=fields))


def picked(result: dict, fields: list[str]) -> dict:
    """llama-server's response_fields: {path: value} for each "a/b" path that the result has."""
    out = {}
    for path in fields:
        value, found = result, True
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                found = False
                break
            value = value[key]
        if found:
            out[path] = value
    return out


def _limits(t_max_predict_ms: int | None, n_indent: int | None) -> Callable[[Choice], bool] | None:
    """llama-server's ends of an editor's answer, as ``until`` for Server.collect: a line after
    the first whose indentation is below ``n_indent`` (the cursor line's: the block is done), its
    text cut away; or ``t_max_predict_ms`` since the first token with a newline written."""
    if not t_max_predict_ms and not n_indent:
        return None
    first: list[float] = []

    def over(c: Choice) -> bool:
        if not first:
            first.append(time.perf_counter())
        if n_indent:
            cut = indent_cut(c.text, n_indent)
            if cut is not None:
                c.text = c.text[:cut]
                return True
        return bool(t_max_predict_ms) and "\n" in c.text and (time.perf_counter() - first[0]) * 1000 > t_max_predict_ms

    return over


def indent_cut(text: str, n_indent: int) -> int | None:
    """Where llama-server's n_indent ends ``text``: at the first character of the first line after
    the first newline that has one, is indented by fewer than n_indent spaces or tabs (a blank
    line counts as 0); None when no line does yet."""
    start = text.find("\n")
    while start != -1:
        pos = start + 1
        while pos < len(text) and text[pos] in " \t":
            pos += 1
        if pos < len(text) and pos - start - 1 < n_indent:
            return pos
        start = text.find("\n", start + 1)
    return None


def add_routes(app: FastAPI, models: ServedModels) -> None:

    @app.post("/infill", response_model=None,
              responses={200: {"model": InfillResult | PickedFields | list[InfillResult | PickedFields],
                               "content": {"text/event-stream": {}}}})
    async def infill(body: InfillRequest, request: Request):
        async with models.lease(body.model, body.keep_alive, unknown_is_default=True) as lease:
            return lease.hand_over(await Infill(lease.server).infill(body, request))
