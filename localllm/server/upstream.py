"""Models served by another machine: an entry that names an upstream OpenAI-compatible server
(vLLM on a cluster, llama-server on a GPU box, another localllm) instead of a file. `localllm
serve` forwards that model's OpenAI requests there (chat completions, completions, embeddings),
streams included, so an editor keeps one base URL while the big models run elsewhere.

- The request is checked here first (the same schema as a local model's), then its body goes
  upstream as it came, with ``model`` replaced by the upstream's own name for it.
- A stream is passed through as its bytes arrive; the client leaving closes the upstream
  connection, which is how every OpenAI-compatible server learns to stop (vLLM, llama-server
  and localllm abort a request whose client left).
- The upstream's own error statuses and bodies are passed through; an upstream that does not
  answer is a 503 in OpenAI's shape naming it, and the other models are not touched.

Configured in ``upstreams.toml`` in the config folder (`localllm serve --upstream NAME=URL` adds
one for a run)::

    [big-coder]
    url = "http://gpu-box:8000/v1"      # the server's OpenAI base URL
    model = "Qwen/Qwen2.5-Coder-32B-Instruct"  # its name there (default: the entry's name)
    api_key_env = "GPU_BOX_KEY"         # the variable holding its key, if it needs one
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from localllm.errors import UsageError
from localllm.server.errors import APIError

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0  # a long prefill on the upstream may take minutes before its first byte


@dataclass(frozen=True)
class Upstream:
    name: str  # the name clients ask for here
    url: str  # the upstream's base URL, e.g. http://gpu-box:8000/v1
    model: str  # the name the upstream knows it by
    api_key: str | None = None


def parse_upstream(text: str) -> Upstream:
    """``NAME=URL`` (the model's name upstream is NAME too), or ``NAME=URL#MODEL``."""
    name, sep, rest = text.partition("=")
    url, _, model = rest.partition("#")
    name, url = name.strip(), url.strip()
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise UsageError(f"--upstream {text!r} is not NAME=URL; give e.g. big=http://gpu-box:8000/v1 "
                         "(add #MODEL when the server knows the model by another name)")
    return Upstream(name, url.rstrip("/"), model.strip() or name)


def load_upstreams(path: Path) -> list[Upstream]:
    """The upstreams of ``path`` (upstreams.toml); none when the file does not exist."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"{path} cannot be read ({e}); fix it or move it aside") from None
    out = []
    for name, table in data.items():
        if not isinstance(table, dict) or not isinstance(table.get("url"), str):
            raise UsageError(f"{path}: [{name}] needs url = \"http://HOST:PORT/v1\"")
        key_env = table.get("api_key_env")
        key = os.environ.get(key_env) if isinstance(key_env, str) else None
        if isinstance(key_env, str) and key is None:
            raise UsageError(f"{path}: [{name}] takes its key from ${key_env}, which is not set")
        upstream = parse_upstream(f"{name}={table['url']}")
        out.append(Upstream(upstream.name, upstream.url, str(table.get("model") or name), key))
    return out


class Forwarder:
    """One HTTP client for every upstream; ``forward`` answers a request for an upstream model."""

    def __init__(self, upstreams: list[Upstream]):
        self.upstreams = {u.name: u for u in upstreams}
        self._client: httpx.AsyncClient | None = None

    def get(self, name: str | None) -> Upstream | None:
        return self.upstreams.get(name) if name is not None else None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                                             limits=httpx.Limits(max_connections=256))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def forward(self, upstream: Upstream, route: str, request: Request) -> Response:
        """``request`` (already checked against ``route``'s schema) sent to the upstream's
        ``route`` (e.g. "/chat/completions"), its answer passed back."""
        import json

        body = json.loads(await request.body())
        body["model"] = upstream.model
        body.pop("keep_alive", None)  # this server's own field
        headers = {"Content-Type": "application/json", "Accept": request.headers.get("accept", "*/*")}
        if upstream.api_key:
            headers["Authorization"] = f"Bearer {upstream.api_key}"
        sent = self.client.build_request("POST", upstream.url + route, json=body, headers=headers)
        try:
            answer = await self.client.send(sent, stream=True)
        except httpx.HTTPError as e:
            raise _down(upstream, e) from None
        if not body.get("stream"):
            try:
                content = await answer.aread()
            except httpx.HTTPError as e:
                raise _down(upstream, e) from None
            finally:
                await answer.aclose()
            return Response(content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type", "application/json"))

        async def relay() -> AsyncIterator[bytes]:
            try:  # the client leaving ends this generator, and closing the answer tells the upstream
                async for chunk in answer.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                message = json.dumps({"error": {"message": f"the upstream {upstream.name} broke off its stream: "
                                                           f"{type(e).__name__}", "type": "server_error",
                                                "param": None, "code": "upstream_error"}})
                yield f"data: {message}\n\n".encode()
            finally:
                await answer.aclose()

        return StreamingResponse(relay(), status_code=answer.status_code,
                                 media_type=answer.headers.get("content-type", "text/event-stream"))


def _down(upstream: Upstream, e: Exception) -> APIError:
    return APIError(503, f"the model '{upstream.name}' is served by {upstream.url}, which is not answering "
                         f"({type(e).__name__}: {e or 'no answer'}); the other models here are unaffected",
                    type_="server_error", code="upstream_unavailable", headers={"Retry-After": "5"})
