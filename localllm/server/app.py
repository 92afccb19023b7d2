"""The routes of `localllm serve`: OpenAI's chat and completions APIs over the AsyncEngine.

Every request is its own stream in the engine, so clients share each engine step and none
waits for another to finish. A client that goes away has its request aborted (its blocks
come back at the next step). Errors always have OpenAI's shape and status.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from localllm import __version__
from localllm.chat_template import TemplateLimitError
from localllm.config import ServerConfig
from localllm.engine.engine import AsyncEngine, RequestOutput
from localllm.engine.request import SamplingParams
from localllm.errors import ContextOverflowError, LocalLLMError, TemplateError, UsageError
from localllm.server import protocol as P
from localllm.server.limits import BodyGuard
from localllm.server.metrics import ServerMetrics


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_json(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorBody(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "none"}


def param_name(loc) -> str | None:
    """The request parameter a pydantic error location names, e.g. 'messages.0.content' for
    ('body', 'messages', 0, 'content', 'str'): pydantic adds which member of a union it tried
    (str, list[int], literal[...], a model's class name), which is no parameter."""
    def is_tag(x) -> bool:
        return isinstance(x, str) and (x in _TYPE_TAGS or "[" in x or x[:1].isupper())
    parts = [str(x) for x in loc if not is_tag(x)]
    if parts[:1] == ["body"]:
        parts = parts[1:]
    return ".".join(parts) or None


def has_key(request: Request, api_key: str) -> bool:
    """Whether the request carries 'Authorization: Bearer API_KEY', compared in constant time."""
    header = dict(request.scope["headers"]).get(b"authorization", b"")  # raw bytes: no decoding guesses
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode())


class KeyGuard:
    """ASGI middleware: every route but /health needs 'Authorization: Bearer API_KEY'
    (has_key), or gets OpenAI's 401 before any body is read. Plain ASGI rather than
    @app.middleware("http"): Starlette's BaseHTTPMiddleware raises "No response returned"
    into the log when a client leaves before its response starts."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" and not has_key(Request(scope), self.api_key):
            response = error_json(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' "
                                       "with the key given to `localllm serve --api-key`", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def sse(obj) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


@dataclass
class _Choice:
    """One generation stream of a request, as it accumulates."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    metrics: object = None


class Server:
    def __init__(self, engine: AsyncEngine, model_path: Path, config: ServerConfig):
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.max_num_seqs = engine.engine.config.scheduler.max_num_seqs
        self.config = config
        self.model_id = Path(model_path).stem
        self.model_names = {self.model_id, Path(model_path).name}
        self.metrics = ServerMetrics()
        self.num_in_flight = 0

    # -- admission ------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}' "
                                f"(see GET /v1/models)", param="model", code="model_not_found")

    def check_capacity(self, n: int) -> None:
        if self.num_in_flight + n > self.max_num_seqs + self.config.max_queue:
            raise APIError(503, f"the server is busy: {self.num_in_flight} requests in flight; retry shortly",
                           type_="server_error", code="server_busy", headers={"Retry-After": "1"})

    def max_tokens_for(self, num_prompt: int, asked: int | None, param: str) -> int:
        room = self.max_model_len - num_prompt
        if asked is None:
            if room < 1:
                raise APIError(
                    400,
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                    f"prompt is {num_prompt} tokens, which leaves no room for a completion. Please reduce "
                    "the length of the prompt.", param="messages", code="context_length_exceeded")
            asked = room
        if num_prompt + asked > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt + asked} tokens ({num_prompt} in the prompt, {asked} for the "
                f"completion). Please reduce the length of the prompt or the completion.",
                param=param, code="context_length_exceeded")
        return asked

    def choice_params(self, req: P._Sampling, max_tokens: int, logprobs: bool, grammar: str | None,
                      top_logprobs: int) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i uses seed + i so the n differ."""
        kwargs = dict(max_tokens=max_tokens, stop=req.stop_list(), logprobs=logprobs, grammar=grammar,
                      top_logprobs=top_logprobs, speculative=req.speculative)
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                             ("min_p", "min_p"), ("repetition_penalty", "repeat_penalty"),
                             ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty")):
            value = getattr(req, theirs)
            if value is not None:
                kwargs[ours] = value
        if req.temperature is None:
            kwargs["temperature"] = 1.0  # OpenAI's default
        try:
            return [SamplingParams(seed=None if req.seed is None else req.seed + i, **kwargs) for i in range(req.n)]
        except UsageError as e:
            raise APIError(400, str(e)) from None

    # -- generation -----------------------------------------------------------------------

    async def _run_choices(self, prompt_ids: list[int], params: list[SamplingParams]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Stream (choice index, output) for n choices of one prompt. The first choice runs
        alone until its prompt is computed, so the others find its KV blocks and share them."""
        queue: asyncio.Queue = asyncio.Queue()
        prefilled = asyncio.Event()
        done = object()

        async def run(index: int) -> None:
            try:
                if index > 0:
                    await prefilled.wait()
                async for out in self.engine.generate(prompt_ids, params[index]):
                    prefilled.set()
                    await queue.put((index, out))
            except BaseException as e:  # delivered to the consumer, which re-raises it
                prefilled.set()
                await queue.put((index, e))
            finally:
                await queue.put((index, done))

        self.num_in_flight += len(params)
        tasks = [asyncio.create_task(run(i)) for i in range(len(params))]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            self.num_in_flight -= len(params)
            for t in tasks:
                t.cancel()  # a client that left: each stream's exit aborts its request
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(self, request: Request, prompt_ids: list[int], params: list[SamplingParams]) -> list[_Choice]:
        choices = [_Choice(i) for i in range(len(params))]

        async def consume() -> None:
            async for i, out in self._run_choices(prompt_ids, params):
                self._add(choices[i], out)

        async def client_left() -> None:
            # A blocking receive, not request.is_disconnected(): behind a BaseHTTPMiddleware
            # layer (the key check was one) its zero-timeout poll never saw the disconnect, and
            # a dropped request ran on to max_tokens; a receive sees it whatever wraps the app.
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task = asyncio.create_task(consume())
        listener = asyncio.create_task(client_left())
        try:
            await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and listener.exception() is None:
                task.cancel()  # the client left: the streams' exits abort the requests
            elif not task.done():  # the listener failed, which says nothing of the client
                await asyncio.wait({task})
        finally:
            listener.cancel()
            if not task.done():  # this handler itself was cancelled: the generation goes too
                task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
        return choices

    def _add(self, choice: _Choice, out: RequestOutput) -> None:
        choice.text += out.text
        choice.token_ids += out.token_ids
        if out.logprobs:
            choice.logprobs += out.logprobs
        if out.top_logprobs:
            choice.top_logprobs += out.top_logprobs
        if out.finished:
            choice.finish_reason = out.finish_reason
            choice.metrics = out.metrics
            self.metrics.observe(out.metrics)

    def usage(self, num_prompt: int, choices: list[_Choice]) -> P.Usage:
        completion = sum(len(c.token_ids) for c in choices)
        cached = choices[0].metrics.num_cached_tokens if choices and choices[0].metrics else 0
        return P.Usage(prompt_tokens=num_prompt, completion_tokens=completion,
                       total_tokens=num_prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))

    def token_logprobs(self, token_ids: list[int], logprobs: list[float],
                       tops: list[list[tuple[int, float]]] | None = None) -> list[P.TokenLogprob]:
        tops = tops or [[] for _ in token_ids]
        return [P.TokenLogprob(token=self.tokenizer.decode([t]), logprob=lp, top_logprobs=[
                    {"token": self.tokenizer.decode([i]), "logprob": v, "bytes": None} for i, v in top])
                for t, lp, top in zip(token_ids, logprobs, tops)]

    # -- chat -----------------------------------------------------------------------------

    async def chat(self, req: P.ChatCompletionRequest, request: Request):
        self.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported yet; leave it out", param="logit_bias")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
        grammar = self.grammar_for(req, tools)
        messages = [self.message_dict(m) for m in req.messages]
        try:
            prompt_ids = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, True, tools)
        except TemplateLimitError as e:  # the model's template is broken or hostile: not the request's fault
            raise APIError(500, str(e), type_="server_error", code="chat_template_error") from None
        except (TemplateError, UsageError) as e:
            raise APIError(400, str(e), param="messages") from None
        max_tokens = self.max_tokens_for(len(prompt_ids), req.max_completion_tokens or req.max_tokens, "messages")
        params = self.choice_params(req, max_tokens, req.logprobs, grammar, req.top_logprobs or 0)
        self.check_capacity(req.n)
        rid = P.new_id("chatcmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._chat_stream(rid, req, prompt_ids, params, include_usage, tools),
                                     media_type="text/event-stream")
        choices = await self._collect(request, prompt_ids, params)
        return P.ChatCompletion(
            id=rid, model=self.model_id,
            choices=[self._chat_choice(c, req, tools) for c in choices],
            usage=self.usage(len(prompt_ids), choices),
        ).model_dump(exclude_none=False)

    def message_dict(self, m: P.ChatMessage) -> dict:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg: dict = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            # Templates expect arguments as an object (they render it with tojson).
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in m.tool_calls]
        return msg

    def grammar_for(self, req: P.ChatCompletionRequest, tools: list[dict] | None) -> str | None:
        from localllm.runners.llamacpp import JSON_OBJECT_GRAMMAR, json_schema_to_grammar
        from localllm.tools import tool_call_grammar

        fmt = req.response_format
        try:
            if tools and (req.tool_choice == "required" or isinstance(req.tool_choice, P.NamedToolChoice)):
                name = req.tool_choice.function.get("name") if isinstance(req.tool_choice, P.NamedToolChoice) else None
                if name is not None and name not in {t["function"]["name"] for t in tools}:
                    raise APIError(400, f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
                return tool_call_grammar(tools, json_schema_to_grammar, name)
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return JSON_OBJECT_GRAMMAR
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
            return json_schema_to_grammar(fmt.json_schema.schema_)
        except UsageError as e:
            raise APIError(400, str(e), param="response_format") from None

    def _chat_choice(self, c: _Choice, req: P.ChatCompletionRequest, tools: list[dict] | None) -> P.ChatChoice:
        content, calls, finish = self.split_tool_calls(c.text, tools, c.finish_reason)
        return P.ChatChoice(
            index=c.index, message=P.ResponseMessage(content=content, tool_calls=calls), finish_reason=finish,
            logprobs=P.ChoiceLogprobs(content=self.token_logprobs(c.token_ids, c.logprobs, c.top_logprobs))
            if req.logprobs else None)

    def split_tool_calls(self, text: str, tools: list[dict] | None, finish: str | None):
        """(content, tool_calls, finish_reason) of a finished answer."""
        if not tools:
            return text, None, finish
        from localllm.tools import parse_bare_call, parse_tool_calls

        content, calls = parse_tool_calls(text)
        if not calls:
            bare = parse_bare_call(text, {t["function"]["name"] for t in tools})
            if bare is None:
                return text, None, finish
            content, calls = "", [bare]
        tool_calls = [P.ToolCall(id=P.new_id("call"), function=P.FunctionCall(**c)) for c in calls]
        return content or None, tool_calls, "tool_calls"

    async def _chat_stream(self, rid: str, req: P.ChatCompletionRequest, prompt_ids: list[int],
                           params: list[SamplingParams], include_usage: bool,
                           tools: list[dict] | None = None) -> AsyncIterator[str]:
        choices = [_Choice(i) for i in range(len(params))]

        def chunk(index: int, delta: P.ChunkDelta, finish: str | None = None, logprobs=None) -> str:
            c = P.ChatCompletionChunk(id=rid, model=self.model_id, choices=[
                P.ChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)])
            return sse(c.model_dump(exclude_none=True) | {"choices": [
                ch.model_dump(exclude_none=True) | {"finish_reason": finish} for ch in c.choices]})

        for i in range(len(params)):
            yield chunk(i, P.ChunkDelta(role="assistant", content=""))
        try:
            async for i, out in self._run_choices(prompt_ids, params):
                self._add(choices[i], out)
                lp = (P.ChoiceLogprobs(content=self.token_logprobs(out.token_ids, out.logprobs or [], out.top_logprobs))
                      if req.logprobs and out.token_ids else None)
                if tools:  # a tool call is only known whole: the answer is sent when it ends
                    if out.finished:
                        content, calls, finish = self.split_tool_calls(choices[i].text, tools, out.finish_reason)
                        delta = P.ChunkDelta(content=content, tool_calls=[
                            {"index": k, **c.model_dump()} for k, c in enumerate(calls)] if calls else None)
                        yield chunk(i, delta)
                        yield chunk(i, P.ChunkDelta(), finish=finish)
                    continue
                if out.text or lp is not None:
                    yield chunk(i, P.ChunkDelta(content=out.text), logprobs=lp)
                if out.finished:
                    yield chunk(i, P.ChunkDelta(), finish=out.finish_reason)
        except LocalLLMError as e:
            yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
            yield sse("[DONE]")
            return
        if include_usage:
            yield sse(P.ChatCompletionChunk(id=rid, model=self.model_id, choices=[],
                                            usage=self.usage(len(prompt_ids), choices)).model_dump())
        yield sse("[DONE]")

    # -- completions ----------------------------------------------------------------------

    async def completions(self, req: P.CompletionRequest, request: Request):
        self.check_model(req.model)
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported yet; leave it out", param="logit_bias")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "a list of several prompts is not supported; send one request per prompt",
                               param="prompt")
            prompt = prompt[0]
        if req.suffix is not None:
            if not isinstance(prompt, str):
                raise APIError(400, "suffix needs the prompt as text", param="suffix")
            encode_fim = getattr(self.tokenizer, "encode_fim", None)
            if encode_fim is None:
                raise APIError(400, "suffix (fill-in-the-middle) is not supported yet", param="suffix")
            try:
                prompt_ids = encode_fim(prompt, req.suffix)
            except UsageError as e:
                raise APIError(400, str(e), param="suffix") from None
        elif isinstance(prompt, str):
            prompt_ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
        else:
            n_vocab = self.tokenizer.n_vocab
            bad = next((t for t in prompt if not 0 <= t < n_vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary of {n_vocab}", param="prompt")
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise APIError(400, "the prompt is empty; give at least one token of text", param="prompt")
        max_tokens = self.max_tokens_for(len(prompt_ids), req.max_tokens, "prompt")
        want_logprobs = req.logprobs is not None
        params = self.choice_params(req, max_tokens, want_logprobs, None, req.logprobs or 0)
        self.check_capacity(req.n)
        rid = P.new_id("cmpl")
        echo = self.tokenizer.decode(prompt_ids) if req.echo and req.suffix is None else ""
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._completion_stream(rid, prompt_ids, params, echo, want_logprobs, include_usage),
                                     media_type="text/event-stream")
        choices = await self._collect(request, prompt_ids, params)
        return P.Completion(
            id=rid, model=self.model_id,
            choices=[P.CompletionChoice(index=c.index, text=echo + c.text, finish_reason=c.finish_reason,
                                        logprobs=self._completion_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
                                        if want_logprobs else None)
                     for c in choices],
            usage=self.usage(len(prompt_ids), choices),
        ).model_dump()

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[float],
                             tops: list[list[tuple[int, float]]] | None = None) -> P.CompletionLogprobs:
        tokens = [self.tokenizer.decode([t]) for t in token_ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top = [{self.tokenizer.decode([i]): v for i, v in step} for step in tops] if tops else None
        return P.CompletionLogprobs(tokens=tokens, token_logprobs=list(logprobs), top_logprobs=top,
                                    text_offset=offsets)

    async def _completion_stream(self, rid: str, prompt_ids: list[int], params: list[SamplingParams], echo: str,
                                 want_logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
        choices = [_Choice(i) for i in range(len(params))]

        def chunk(index: int, text: str, finish: str | None, logprobs=None) -> str:
            return sse(P.Completion(id=rid, model=self.model_id, choices=[
                P.CompletionChoice(index=index, text=text, finish_reason=finish, logprobs=logprobs)]).model_dump(exclude_none=True)
                | {"choices": [{"index": index, "text": text, "finish_reason": finish,
                                "logprobs": logprobs.model_dump() if logprobs else None}]})

        if echo:
            for i in range(len(params)):
                yield chunk(i, echo, None)
        try:
            async for i, out in self._run_choices(prompt_ids, params):
                self._add(choices[i], out)
                lp = (self._completion_logprobs(out.token_ids, out.logprobs or [], out.top_logprobs)
                      if want_logprobs else None)
                if out.text or out.finished:
                    yield chunk(i, out.text, out.finish_reason if out.finished else None, lp)
        except LocalLLMError as e:
            yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
            yield sse("[DONE]")
            return
        if include_usage:
            yield sse(P.Completion(id=rid, model=self.model_id, choices=[],
                                   usage=self.usage(len(prompt_ids), choices)).model_dump())
        yield sse("[DONE]")


def create_app(engine: AsyncEngine, model_path: Path, config: ServerConfig) -> FastAPI:
    server = Server(engine, model_path, config)
    app = FastAPI(title="localllm", version=__version__,
                  description="OpenAI-compatible API of localllm: chat and text completions on a local model.")
    app.state.server = server

    # Each middleware added wraps those before it, so a request meets them in the reverse order:
    # CORS (a browser's preflight carries no key), the key (checked before any body is read),
    # the body's size and time limits, then the routes.
    app.add_middleware(BodyGuard, max_bytes=config.max_body_bytes, read_timeout_s=config.read_timeout_s)

    if config.api_key:
        app.add_middleware(KeyGuard, api_key=config.api_key)

    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        return error_json(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        param = param_name(err.get("loc", ()))
        message = err.get("msg", "invalid request")
        if err.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        elif err.get("type") == "extra_forbidden":
            message = f"unknown parameter '{param}'; remove it"
        elif param:
            message = f"invalid value for '{param}': {message}"
        return error_json(400, message, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return error_json(404, f"no route {request.method} {request.url.path}; see /openapi.json",
                              code="not_found")
        if e.status_code == 405:
            allowed = (e.headers or {}).get("Allow", "")
            return error_json(405, f"{request.method} is not allowed on {request.url.path}; use {allowed}",
                              code="method_not_allowed", headers=e.headers)
        return error_json(e.status_code, str(e.detail), headers=e.headers)

    @app.exception_handler(ContextOverflowError)
    async def on_overflow(request: Request, e: ContextOverflowError):
        return error_json(400, str(e), code="context_length_exceeded")

    @app.exception_handler(LocalLLMError)
    async def on_local_error(request: Request, e: LocalLLMError):
        if e.exit_code == 2:
            return error_json(400, str(e))
        return error_json(500, str(e), type_="server_error")

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception):
        return error_json(500, f"internal error: {type(e).__name__}: {e}", type_="server_error")

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": P.ChatCompletion, "content": EVENT_STREAM}})
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    @app.post("/v1/completions", response_model=None,
              responses={200: {"model": P.Completion, "content": EVENT_STREAM}})
    async def completions(body: P.CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.get("/v1/models", response_model=P.ModelList)
    async def models():
        return P.ModelList(data=[P.ModelCard(id=server.model_id)])

    @app.get("/v1/models/{model_id}", response_model=P.ModelCard)
    async def model(model_id: str):
        server.check_model(model_id)
        return P.ModelCard(id=server.model_id)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.model_id}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        stats = await asyncio.wrap_future(engine.call(lambda e: e.stats()))
        body, content_type = server.metrics.render(stats, server.num_in_flight)
        return Response(body, media_type=content_type)

    app.openapi = partial(_openapi_with_errors, app.openapi)
    return app


EVENT_STREAM = {"text/event-stream": {}}  # with "stream": true: SSE events of the chunk objects
# The statuses any route may answer, always with an OpenAI error object (never FastAPI's 422).
ERROR_STATUSES = {"400": "Invalid request", "401": "Missing or wrong API key (with `serve --api-key`)",
                  "404": "Unknown route or model", "408": "Request not sent in time",
                  "413": "Request body too large"}


def _openapi_with_errors(make_openapi) -> dict:
    """FastAPI's schema with the error responses the server really gives."""
    spec = make_openapi()  # cached by FastAPI: the edits below are made once
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path_item in spec["paths"].values():
        for method, operation in path_item.items():
            responses = operation["responses"]
            responses.pop("422", None)
            for status, description in ERROR_STATUSES.items():
                responses.setdefault(status, {"description": description, "content": error})
            if method == "post":
                responses.setdefault("503", {"description": "Server busy; retry after Retry-After seconds",
                                             "content": error})
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    # All four keys are always sent (param and code may be null), and nothing else.
    schemas["ErrorBody"] = P.ErrorBody.model_json_schema() | {
        "required": list(P.ErrorBody.model_fields), "additionalProperties": False}
    schemas["ErrorResponse"] = {"title": "ErrorResponse", "type": "object", "required": ["error"],
                                "properties": {"error": {"$ref": "#/components/schemas/ErrorBody"}},
                                "additionalProperties": False}
    return spec
