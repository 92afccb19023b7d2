"""The app of `localllm serve`: the middleware (CORS, the API key, the body's limits), the errors
in each protocol's shape, the model list, health and metrics; each protocol's routes come from
its own module over the shared request path (core.Server):

- openai_chat: OpenAI's `/v1/chat/completions` and `/v1/completions`;
- openai_responses: OpenAI's `/v1/responses` (and its kept responses, response_store.py);
- anthropic_messages: Anthropic's `/v1/messages` and `/v1/messages/count_tokens`;
- infill: llama.cpp's `/infill` (fill-in-the-middle for editors);
- tokens: llama.cpp's `/tokenize` and `/detokenize`;
- embeddings: OpenAI's `/v1/embeddings`, over the embedding model `serve --embedding-model` loads.

OpenAI's routes answer without their `/v1` too (`/chat/completions`, `/models`, ...), as
llama-server's do, for clients whose base URL has no `/v1`: the same handlers, left out of the
schema (so documented and fuzzed once).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pydantic import BaseModel, ConfigDict

from localllm import __version__
from localllm.config import ServerConfig
from localllm.engine.metrics import EngineStats
from localllm.errors import ContextOverflowError, LocalLLMError, ModelBusy, ModelNotFound
from localllm.manager import ModelEntry
from localllm.paths import responses_db
from localllm.server import anthropic_messages, embeddings, infill, openai_chat, openai_responses, tokens
from localllm.server import protocol as P
from localllm.server.models import LoadedModel, ServedModels, trained_context
from localllm.server.errors import (AnthropicErrorBody, APIError, ErrorBody, api_error_response, error_response,
                                    speaks_anthropic)
from localllm.server.limits import BodyGuard
from localllm.server.response_store import ResponseStore

_TYPE_TAGS = {"str", "int", "float", "bool", "none"}


class StopRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """The loaded models' engines as one: counts summed, thread figures the most of any."""
    if not stats:
        return EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)} | {"threads_adaptive": False})
    total = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        total[f.name] = any(values) if f.name == "threads_adaptive" else (
            max(values) if f.name.startswith("threads_") else sum(values))
    return EngineStats(**total)


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
    """Whether the request carries the key, as 'Authorization: Bearer API_KEY' (OpenAI's
    clients) or 'x-api-key: API_KEY' (Anthropic's), each compared in constant time."""
    headers = dict(request.scope["headers"])  # raw bytes: no decoding guesses
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    given = [token.strip()] if scheme.lower() == b"bearer" else []
    if b"x-api-key" in headers:
        given.append(headers[b"x-api-key"].strip())
    return any([hmac.compare_digest(t, api_key.encode()) for t in given])  # a list: every one compared


class KeyGuard:
    """ASGI middleware: every route but /health needs the key (has_key), or gets a 401 in its
    protocol's shape before any body is read. Plain ASGI rather than @app.middleware("http"):
    Starlette's BaseHTTPMiddleware raises "No response returned" into the log when a client
    leaves before its response starts."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" and not has_key(Request(scope), self.api_key):
            response = error_response(
                scope["path"], 401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' or "
                "'x-api-key: KEY' with the key this server was started with", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def model_card(models: ServedModels, entry: ModelEntry, loaded: LoadedModel | None) -> P.ModelCard:
    """A served model with its kind, whether it is loaded, and its context: `context_length`
    (the most tokens one request may hold, prompt and answer: the loaded engine's, else what
    its plan gives or its trained context), vLLM's `max_model_len` and llama-server's `meta`."""
    n_ctx_train = n_vocab = None
    if loaded is not None and loaded.server is not None:
        server = loaded.server
        ctx, n_ctx_train, n_vocab = server.max_model_len, server.n_ctx_train, server.tokenizer.n_vocab
    elif loaded is not None:
        ctx, n_vocab = loaded.embedder.n_ctx, loaded.embedder.n_vocab
    else:
        trained = trained_context(entry.path)
        ctx = models.ctx_of(entry) or trained or 0
        n_ctx_train = trained if entry.kind != "embedding" else None
    return P.ModelCard(id=entry.name, context_length=ctx, max_model_len=ctx, kind=entry.kind,
                       loaded=loaded is not None, meta=P.ModelMeta(n_ctx=ctx, n_ctx_train=n_ctx_train, n_vocab=n_vocab))


def upstream_card(upstream) -> P.ModelCard:
    """A model another server serves (upstream.py): its context is that server's to say."""
    return P.ModelCard(id=upstream.name, owned_by=upstream.url, context_length=None, max_model_len=None,
                       kind="chat", loaded=True, meta=P.ModelMeta(n_ctx=None, n_ctx_train=None, n_vocab=None))


def create_app(models: ServedModels, config: ServerConfig) -> FastAPI:
    """The app over ``models`` (server/models.py: every model it serves, loaded on demand)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await models.start()  # the pinned models (loaded already by `serve`, or on demand here)
        try:
            yield
        finally:
            await models.close()

    app = FastAPI(title="localllm", version=__version__, lifespan=lifespan,
                  description="localllm's API on local models: OpenAI's chat completions, completions "
                              "and responses, embeddings, Anthropic's messages, llama.cpp's infill, tokenize and "
                              "detokenize; every installed model by its name, loaded on demand.")
    app.state.models = models

    # Each middleware added wraps those before it, so a request meets them in the reverse order:
    # CORS (a browser's preflight carries no key), the key (checked before any body is read),
    # the body's size and time limits, then the routes.
    app.add_middleware(BodyGuard, max_bytes=config.max_body_bytes, read_timeout_s=config.read_timeout_s)

    if config.api_key:
        app.add_middleware(KeyGuard, api_key=config.api_key)

    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])

    def error_json(request: Request, status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None, headers: dict | None = None):
        return error_response(request.url.path, status, message, type_, param, code, headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        return api_error_response(request.url.path, e)

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
        return error_json(request, 400, message, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return error_json(request, 404, f"no route {request.method} {request.url.path}; see /openapi.json",
                              code="not_found")
        if e.status_code == 405:
            allowed = (e.headers or {}).get("Allow", "")
            return error_json(request, 405, f"{request.method} is not allowed on {request.url.path}; use {allowed}",
                              code="method_not_allowed", headers=e.headers)
        return error_json(request, e.status_code, str(e.detail), headers=e.headers)

    @app.exception_handler(ContextOverflowError)
    async def on_overflow(request: Request, e: ContextOverflowError):
        return error_json(request, 400, str(e), code="context_length_exceeded")

    @app.exception_handler(LocalLLMError)
    async def on_local_error(request: Request, e: LocalLLMError):
        if e.exit_code == 2:
            return error_json(request, 400, str(e))
        return error_json(request, 500, str(e), type_="server_error")

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception):
        return error_json(request, 500, f"internal error: {type(e).__name__}: {e}", type_="server_error")

    openai_chat.add_routes(app, models)
    openai_responses.add_routes(app, models, ResponseStore(responses_db()))
    anthropic_messages.add_routes(app, models)
    infill.add_routes(app, models)
    tokens.add_routes(app, models)
    embeddings.add_routes(app, models)

    def cards() -> list[P.ModelCard]:
        """Every served model: the default chat model first (clients that take the first model
        get it), embedding models after the others."""
        loaded = {model.entry.name: model for model in models.loaded()}
        entries = models.manager.entries
        first = models.entry(None, "text") if any(e.kind != "embedding" for e in entries) else None
        ordered = sorted(entries, key=lambda e: (e is not first, e.kind == "embedding"))
        return [model_card(models, e, loaded.get(e.name)) for e in ordered] + [
            upstream_card(u) for u in models.forwarder.upstreams.values()]

    @app.get("/v1/models", response_model=P.ModelList)
    async def list_models():
        await models.start()  # the pinned models are loaded (the lifespan starts it; TestClient may not)
        return P.ModelList(data=await asyncio.to_thread(cards))

    @app.get("/v1/models/{model_id}", response_model=P.ModelCard)
    async def model(model_id: str):
        if (upstream := models.upstream(model_id)) is not None:
            return upstream_card(upstream)
        try:
            entry = models.manager.resolve(model_id)
        except ModelNotFound:
            raise APIError(404, models.not_found(model_id), param="model", code="model_not_found") from None
        await models.start()
        loaded = {m.entry.name: m for m in models.loaded()}
        return await asyncio.to_thread(model_card, models, entry, loaded.get(entry.name))

    _add_unversioned_routes(app)

    @app.get("/health")
    async def health():
        loaded = [m.entry.name for m in models.loaded()]
        try:
            default = models.entry(None, "text").name
        except APIError:
            default = None
        return {"status": "ok", "model": default, "loaded": loaded}

    @app.get("/api/ps")
    async def ps():
        """The models loaded now (`localllm ps`), as Ollama's /api/ps lists them, with more."""
        cards_by_name = {m.entry.name: m for m in models.loaded()}
        out = []
        for s in models.manager.status():
            if s.state == "unloaded":
                continue
            loaded = cards_by_name.get(s.name)
            out.append({"name": s.name, "model": s.name, "kind": s.kind, "state": s.state, "size": s.bytes,
                        "pinned": s.pinned, "in_flight": s.in_flight, "idle_s": s.idle_s,
                        "keep_alive_left_s": s.keep_alive_left_s, "loads": s.num_loads, "unloads": s.num_unloads,
                        "last_load_s": s.last_load_s,
                        "context_length": models.ctx_of(loaded.entry) if loaded is not None else None})
        return {"models": out}

    @app.post("/api/stop")
    async def stop(body: StopRequest):
        """Unload a model now (`localllm stop NAME`); one serving requests is a 409."""
        if models.upstream(body.model) is not None:
            raise APIError(400, f"'{body.model}' is served by an upstream server; there is nothing here to unload",
                           param="model", code="model_is_upstream")
        try:
            entry = models.manager.resolve(body.model)
            unloaded = await models.manager.unload(entry.name)
        except ModelNotFound:
            raise APIError(404, models.not_found(body.model), param="model", code="model_not_found") from None
        except ModelBusy as e:
            raise APIError(409, str(e), param="model", code="model_busy") from None
        return {"model": entry.name, "unloaded": unloaded}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        servers = [m.server for m in models.loaded() if m.server is not None]
        stats = [await asyncio.wrap_future(s.engine.call(lambda e: e.stats())) for s in servers]
        body, content_type = models.metrics.render(sum_stats(stats), sum(s.num_in_flight for s in servers),
                                                   models.manager.status())
        return Response(body, media_type=content_type)

    app.openapi = partial(_openapi_with_errors, app.openapi)
    return app


def _add_unversioned_routes(app: FastAPI) -> None:
    """Each OpenAI route under /v1 also without it (`/v1/models` as `/models`), the same handler."""
    for route in list(app.routes):
        if isinstance(route, APIRoute) and route.path.startswith("/v1/") and not speaks_anthropic(route.path):
            app.add_api_route(route.path[len("/v1"):], route.endpoint, methods=list(route.methods),
                              response_model=route.response_model, include_in_schema=False)


# The statuses any route may answer, always with its protocol's error object (never FastAPI's 422).
ERROR_STATUSES = {"400": "Invalid request", "401": "Missing or wrong API key (with `serve --api-key`)",
                  "404": "Unknown route or model", "408": "Request not sent in time",
                  "413": "Request body too large"}


def _openapi_with_errors(make_openapi) -> dict:
    """FastAPI's schema with the error responses the server really gives."""
    spec = make_openapi()  # cached by FastAPI: the edits below are made once
    for path, path_item in spec["paths"].items():
        name, busy = ("AnthropicErrorResponse", "529") if speaks_anthropic(path) else ("ErrorResponse", "503")
        error = {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}
        for method, operation in path_item.items():
            responses = operation["responses"]
            responses.pop("422", None)
            for status, description in ERROR_STATUSES.items():
                responses.setdefault(status, {"description": description, "content": error})
            if method == "post":
                responses.setdefault(busy, {"description": "Server busy; retry after Retry-After seconds",
                                            "content": error})
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    # All keys are always sent (OpenAI's param and code may be null), and nothing else.
    schemas["ErrorBody"] = ErrorBody.model_json_schema() | {
        "required": list(ErrorBody.model_fields), "additionalProperties": False}
    schemas["ErrorResponse"] = {"title": "ErrorResponse", "type": "object", "required": ["error"],
                                "properties": {"error": {"$ref": "#/components/schemas/ErrorBody"}},
                                "additionalProperties": False}
    schemas["AnthropicErrorBody"] = AnthropicErrorBody.model_json_schema() | {
        "required": ["type", "message"], "additionalProperties": False}
    schemas["AnthropicErrorResponse"] = {
        "title": "AnthropicErrorResponse", "type": "object", "required": ["type", "error"],
        "properties": {"type": {"const": "error", "type": "string"},
                       "error": {"$ref": "#/components/schemas/AnthropicErrorBody"}},
        "additionalProperties": False}
    return spec
