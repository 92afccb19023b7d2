"""The errors of `localllm serve`, each in the shape of the protocol its route speaks: Anthropic's
`{"type": "error", "error": {"type", "message"}}` under /v1/messages, OpenAI's
`{"error": {"message", "type", "param", "code"}}` everywhere else. Middleware that answers before
any route (the key check, the body's limits) picks the shape by the same path rule."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel
from starlette.responses import JSONResponse


class APIError(Exception):
    """A request the server refuses: the status, a message that names the fix, and OpenAI's
    `type`, `param` and `code` (Anthropic's shape keeps the message and maps the status)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class AnthropicErrorBody(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorBody


# Anthropic's error types by status (docs.anthropic.com/en/api/errors); a busy server is its
# 529 overloaded_error, which the anthropic SDK retries.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_STATUS = {503: 529}


def speaks_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, status: int, message: str, type_: str = "invalid_request_error",
               param: str | None = None, code: str | None = None) -> tuple[int, dict]:
    """(status, body) of an error on ``path``, in that route's protocol."""
    if speaks_anthropic(path):
        kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        body = AnthropicErrorResponse(error=AnthropicErrorBody(type=kind, message=message))
        return ANTHROPIC_STATUS.get(status, status), body.model_dump()
    return status, ErrorResponse(error=ErrorBody(message=message, type=type_, param=param, code=code)).model_dump()


def error_response(path: str, status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None, headers: dict | None = None) -> JSONResponse:
    status, body = error_body(path, status, message, type_, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


def api_error_response(path: str, e: APIError) -> JSONResponse:
    return error_response(path, e.status, e.message, e.type, e.param, e.code, e.headers)
