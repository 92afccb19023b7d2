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
import hmac
from functools import partial
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from localllm import __version__
from localllm.config import ServerConfig
from localllm.engine.engine import AsyncEngine
from localllm.errors import ContextOverflowError, LocalLLMError
from localllm.paths import responses_db
from localllm.server import anthropic_messages, embeddings, infill, openai_chat, openai_responses, tokens
from localllm.server import protocol as P
from localllm.server.core import Server
from localllm.server.errors import (AnthropicErrorBody, APIError, ErrorBody, api_error_response, error_response,
                                    speaks_anthropic)
from localllm.server.limits import BodyGuard
from localllm.server.response_store import ResponseStore

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


def model_card(server: Server) -> P.ModelCard:
    """The served model with its context: `context_length` (the most tokens one request may
    hold, prompt and answer), vLLM's `max_model_len` and llama-server's `meta`."""
    return P.ModelCard(id=server.model_id, context_length=server.max_model_len, max_model_len=server.max_model_len,
                       meta=P.ModelMeta(n_ctx=server.max_model_len, n_ctx_train=server.n_ctx_train,
                                        n_vocab=server.tokenizer.n_vocab))


def create_app(engine: AsyncEngine, model_path: Path, config: ServerConfig, embedder=None) -> FastAPI:
    """The app over ``engine`` (the chat model at ``model_path``) and, when given, ``embedder``
    (engine/embedder.py: the embedding model of /v1/embeddings)."""
    from localllm.gguf import read_info

    try:
        n_ctx_train = read_info(model_path).context_length
    except (OSError, LocalLLMError):  # the runner loaded it; only this figure is missing
        n_ctx_train = None
    server = Server(engine, model_path, config, n_ctx_train)
    app = FastAPI(title="localllm", version=__version__,
                  description="localllm's API on a local model: OpenAI's chat completions, completions "
                              "and responses, embeddings, Anthropic's messages, llama.cpp's infill, tokenize and "
                              "detokenize.")
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

    openai_chat.add_routes(app, server)
    openai_responses.add_routes(app, server, ResponseStore(responses_db()))
    anthropic_messages.add_routes(app, server)
    infill.add_routes(app, server)
    tokens.add_routes(app, server)
    embeddings.add_routes(app, server, embedder)

    cards = [model_card(server)]
    if embedder is not None:  # listed second: clients that take the first model get the chat model
        cards.append(P.ModelCard(id=embedder.name, context_length=embedder.n_ctx, max_model_len=embedder.n_ctx,
                                 meta=P.ModelMeta(n_ctx=embedder.n_ctx, n_ctx_train=None, n_vocab=embedder.n_vocab)))

    @app.get("/v1/models", response_model=P.ModelList)
    async def models():
        return P.ModelList(data=cards)

    @app.get("/v1/models/{model_id}", response_model=P.ModelCard)
    async def model(model_id: str):
        if embedder is not None and model_id in (embedder.name, embedder.name + ".gguf"):
            return cards[1]
        server.check_model(model_id)
        return cards[0]

    _add_unversioned_routes(app)

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
