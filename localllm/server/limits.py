"""What a client may cost the server before its request is whole: the body's size, the time it
takes to send the headers and the time it takes to send the body.

A request reaches the routes (and so the engine) only once its whole body is here. A client
that sends headers and half a body and then stalls, or trickles a byte at a time, is answered
408 when ``read_timeout_s`` has passed and its connection closed; one that never finishes its
headers has its connection closed (uvicorn has no timeout for either).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from localllm.server.errors import ErrorBody, ErrorResponse, error_response


class BodyGuard:
    """ASGI middleware: reads the whole request body, up to ``max_bytes``, within
    ``read_timeout_s`` of the headers, and only then hands the request on (with the body
    replayed). Over the size: 413, whether the body declares its length or comes chunked.
    Too slow: 408 and the connection closed."""

    def __init__(self, app, max_bytes: int, read_timeout_s: float):
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(int(length), scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read(receive), self.read_timeout_s)
        except asyncio.TimeoutError:
            response = error_response(scope["path"], 408, "the request body did not arrive within "
                                      f"{self.read_timeout_s:g} s of its headers; send it whole, without pauses",
                                      code="request_timeout", headers={"Connection": "close"})
            return await response(scope, receive, send)
        if body is None:  # the client left before the body ended: nobody to answer
            return
        if isinstance(body, int):
            return await self._too_large(body, scope, receive, send, at_least=True)
        replayed = False
        scope = as_json(scope, body)

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect a streaming route waits for
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes | int | None:
        """The body; or its size so far once that is over the limit; or None if the client left."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return size
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, size: int, scope, receive, send, at_least: bool = False) -> None:
        size_text = f"at least {size}" if at_least else f"{size}"
        response = error_response(scope["path"], 413, f"the request body of {size_text} bytes is over the limit of "
                                  f"{self.max_bytes} bytes; send a shorter request", code="request_too_large",
                                  headers={"Connection": "close"})
        await response(scope, receive, send)


# What `curl -d '{...}'` and other clients that name no JSON type send with a JSON body.
_NOT_NAMED_JSON = (b"", b"application/x-www-form-urlencoded", b"text/plain")


def as_json(scope: dict, body: bytes) -> dict:
    """scope with its content type set to JSON when the body is a JSON object or array sent
    without a JSON content type (curl's -d sends one as a form; llama-server and Ollama read it
    as JSON). A body that is not JSON keeps its type, and the route's own error says so."""
    kind = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
    if kind not in _NOT_NAMED_JSON or body.lstrip()[:1] not in (b"{", b"["):
        return scope
    others = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": others + [(b"content-type", b"application/json")]}


def header_timeout_protocol(read_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head
    within ``read_timeout_s`` of opening or of its last response (a request in progress is
    never cut here: its body is BodyGuard's business), and answering malformed HTTP with
    OpenAI's error object."""

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            cycle = self.cycle  # the request this timer waits to see followed by a new one
            self.loop.call_later(read_timeout_s, self._expire, cycle)

        def _expire(self, cycle) -> None:
            waiting = self.cycle is cycle and (cycle is None or cycle.response_complete)
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """Bytes that are no HTTP request get OpenAI's error object too (uvicorn: plain text)."""
            body = ErrorResponse(error=ErrorBody(
                message=f"{msg.rstrip('.')}: the bytes sent are not a well-formed HTTP/1.1 request",
                type="invalid_request_error", code="invalid_http")).model_dump_json().encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return HeaderTimeoutProtocol
