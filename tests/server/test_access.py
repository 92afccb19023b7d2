"""Who can reach `localllm serve`, and what a request can touch.

- It listens on 127.0.0.1 unless told otherwise.
- With --api-key, every route but /health needs the key: the API, /metrics, /openapi.json,
  /docs, /redoc and paths that do not exist (a stranger learns nothing, not even which routes
  there are). The key is compared in constant time, before any body is read.
- CORS is off unless --cors-origin names origins; a named origin's preflight passes without
  the key (browsers send none on a preflight), the request itself still needs it.
- No route reads or writes a file the request names: the routes are exactly those listed
  here, the only path parameter is a model name looked up among the served names, and a
  `model` that is a path (even the served file's own) is a 404 that opens nothing.

The live server (tests/server/conftest.py) is started without --host and with --api-key; the
CORS and file checks that need another configuration run the app in-process over a stub
engine, which these routes never reach.
"""

from __future__ import annotations

import hmac
import socket
import sys
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import httpx
import pytest
from fastapi.testclient import TestClient

from localllm.config import ServerConfig
from localllm.server import app as app_module
from localllm.server.app import create_app
from localllm.server.models import ServedModels

ERROR_KEYS = {"message", "type", "param", "code"}
# Every route of the server with its methods; a new route must be added here, and so audited.
ROUTES = {
    ("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET"),
    ("/v1/messages", "POST"), ("/v1/messages/count_tokens", "POST"), ("/infill", "POST"), ("/v1/embeddings", "POST"),
    ("/v1/responses", "POST"), ("/v1/responses/{response_id}", "GET"), ("/v1/responses/{response_id}", "DELETE"),
    ("/v1/models/{model_id}", "GET"), ("/health", "GET"), ("/metrics", "GET"),
    ("/openapi.json", "GET"), ("/openapi.json", "HEAD"), ("/docs", "GET"), ("/docs", "HEAD"),
    ("/docs/oauth2-redirect", "GET"), ("/docs/oauth2-redirect", "HEAD"), ("/redoc", "GET"), ("/redoc", "HEAD"),
    ("/tokenize", "POST"), ("/detokenize", "POST"),
    ("/api/ps", "GET"), ("/api/stop", "POST"),  # `localllm ps` and `localllm stop`
    # OpenAI's routes without /v1, as llama-server has them: the same handlers
    ("/chat/completions", "POST"), ("/completions", "POST"), ("/models", "GET"), ("/models/{model_id}", "GET"),
    ("/embeddings", "POST"), ("/responses", "POST"), ("/responses/{response_id}", "GET"),
    ("/responses/{response_id}", "DELETE"),
}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.request.url, response.text)
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    return body["error"]


# -- binding ----------------------------------------------------------------------------------


def test_the_default_address_is_loopback():
    assert ServerConfig().host == "127.0.0.1"
    from localllm.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "m.gguf"])
    assert args.host == "127.0.0.1" and args.cors_origin == [] and args.api_key is None


@pytest.mark.model
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket table")
def test_the_live_server_listens_on_127_0_0_1_only(live_server):
    """The fixture's server was started without --host: its one listening socket is bound to
    127.0.0.1 (in /proc/net/tcp: 0100007F), not to 0.0.0.0 or any other address."""
    port_hex = f"{live_server.port:04X}"
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port = fields[1].rsplit(":", 1)
            if port == port_hex and fields[3] == "0A":  # 0A: LISTEN
                listening.append(address)
    assert listening == ["0100007F"], listening
    other = _non_loopback_address()
    if other is not None:  # and from another address of this machine, nobody answers
        with pytest.raises(OSError):
            socket.create_connection((other, live_server.port), timeout=2).close()


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent, it only picks a route
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


# -- the key ----------------------------------------------------------------------------------


@pytest.mark.model
def test_every_route_but_health_needs_the_key(live_server):
    paths = ["/v1/models", f"/v1/models/{live_server.model_path.stem}", "/metrics", "/openapi.json", "/docs",
             "/redoc", "/docs/oauth2-redirect", "/no/such/route", "/"]
    wrong_keys = [None, "", "Bearer", f"Bearer {live_server.api_key}x", f"Bearer {live_server.api_key[:-1]}",
                  f"Basic {live_server.api_key}", live_server.api_key, "Bearer sk-tést"]
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        for wrong in wrong_keys:
            headers = {} if wrong is None else {"Authorization": wrong.encode("utf-8")}
            for path in paths:
                response = http.get(path, headers=headers)
                assert error_of(response, 401)["code"] == "invalid_api_key", (wrong, path)
                assert response.headers["www-authenticate"] == "Bearer"
            for path in ("/v1/chat/completions", "/v1/completions"):
                assert http.post(path, headers=headers, json={}).status_code == 401
        good = {"Authorization": f"Bearer {live_server.api_key}"}
        for path in paths[:6]:
            assert http.get(path, headers=good).status_code == 200, path
        assert http.get("/v1/models", headers={"Authorization": f"bearer {live_server.api_key}"}).status_code == 200
        assert error_of(http.get("/no/such/route", headers=good), 404)["code"] == "not_found"
        assert http.get("/health").json()["status"] == "ok"  # the one open route


def test_the_key_is_compared_in_constant_time(monkeypatch):
    calls, compare = [], hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    request = SimpleNamespace(scope={"headers": [(b"authorization", b"Bearer sk-guess")]})
    assert not app_module.has_key(request, "sk-right")
    assert calls == [(b"sk-guess", b"sk-right")]


# -- CORS and files, in-process ---------------------------------------------------------------


def stub_app(tmp_path: Path, **config) -> tuple[TestClient, Path]:
    """The real app over an engine stub that only the routes below never call."""
    model_path = tmp_path / "served-model.gguf"
    engine = SimpleNamespace(engine=SimpleNamespace(
        tokenizer=SimpleNamespace(n_vocab=1000), max_model_len=1024, config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=4))))
    config = ServerConfig(**config)
    return TestClient(create_app(ServedModels.of(engine, model_path, config), config),
                      raise_server_exceptions=True), model_path


def test_cors_is_off_unless_origins_are_given(tmp_path):
    client, _ = stub_app(tmp_path)
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    response = client.options("/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in response.headers
    assert "access-control-allow-origin" not in client.get("/health", headers={"Origin": "http://evil.example"}).headers


@pytest.mark.model
def test_the_live_server_sends_no_cors_headers(live_server):
    headers = {"Origin": "http://evil.example", "Authorization": f"Bearer {live_server.api_key}"}
    response = httpx.get(f"{live_server.base_url}/models", headers=headers, timeout=30)
    assert response.status_code == 200
    assert not [h for h in response.headers if h.startswith("access-control-")]
    preflight = httpx.options(f"{live_server.base_url}/chat/completions", timeout=30, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert not [h for h in preflight.headers if h.startswith("access-control-")]


def test_a_named_origin_gets_cors_and_its_preflight_needs_no_key(tmp_path):
    client, _ = stub_app(tmp_path, api_key="sk-cors", cors_origins=("http://app.example",))
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = client.options("/v1/chat/completions", headers={"Origin": "http://app.example", **preflight})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://app.example"
    other = client.options("/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # The request itself still needs the key; the browser reads the 401 (CORS headers on it).
    response = client.get("/v1/models", headers={"Origin": "http://app.example"})
    assert error_of(response, 401)["code"] == "invalid_api_key"
    assert response.headers["access-control-allow-origin"] == "http://app.example"
    assert client.get("/v1/models", headers={"Authorization": "Bearer sk-cors"}).status_code == 200


def test_the_routes_are_exactly_the_audited_ones_with_no_path_like_parameter(tmp_path):
    client, _ = stub_app(tmp_path)
    routes = {(route.path, method) for route in client.app.routes for method in getattr(route, "methods", ())}
    assert routes == ROUTES
    spec = client.get("/openapi.json").json()
    parameters = [(path, p["name"], p["in"]) for path, item in spec["paths"].items()
                  for operation in item.values() for p in operation.get("parameters", [])]
    # A model's name, checked in memory; a response's id, a key of the response store (SQLite).
    assert sorted(parameters) == [("/v1/models/{model_id}", "model_id", "path"),
                                  ("/v1/responses/{response_id}", "response_id", "path"),
                                  ("/v1/responses/{response_id}", "response_id", "path")]


def test_no_route_opens_a_file_the_request_names(tmp_path):
    """Paths sent as the model, in a route's path, or in a body: every one is a 404 or a 400
    and not one file is opened while they are served (a Python audit hook sees every open)."""
    client, model_path = stub_app(tmp_path)
    model_path.write_bytes(b"GGUF")  # the served file itself, named by its full path
    secret = tmp_path / "secret.gguf"
    secret.write_bytes(b"GGUF")
    opened: list[str] = []
    watching = False

    def hook(event: str, args: tuple) -> None:
        if watching and event == "open" and isinstance(args[0], (str, bytes, Path)):
            opened.append(str(args[0]))

    sys.addaudithook(hook)  # cannot be removed; it records only while `watching`
    names = [str(secret), str(model_path), "../" * 8 + "etc/passwd", "/etc/passwd", "file:///etc/passwd",
             "~/.ssh/id_rsa", str(tmp_path), "secret", "secret.gguf"]
    # A route's first request opens modules (lazy imports; FastAPI reads the endpoint's source
    # file for its error context): not part of the check.
    client.get("/v1/models")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"):
        client.post(path, json={"model": "warm-up", "prompt": "", "messages": [{"role": "user", "content": ""}]})
    watching = True
    try:
        for name in names:
            for path in ("/v1/chat/completions", "/v1/completions"):
                body = {"model": name, "messages": [{"role": "user", "content": name}], "prompt": name}
                body.pop("prompt" if "chat" in path else "messages")
                error = error_of(client.post(path, json=body), 404)
                assert error["code"] == "model_not_found" and error["param"] == "model"
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                body = {"model": name, "messages": [{"role": "user", "content": name}]}
                response = client.post(path, json=body | ({"max_tokens": 4} if path == "/v1/messages" else {}))
                assert response.status_code == 404
                assert response.json()["error"]["type"] == "not_found_error"
            error_of(client.get(f"/v1/models/{quote(name, safe='')}"), 404)
            error_of(client.get(f"/{name.lstrip('/')}"), 404)
    finally:
        watching = False
    assert opened == []
    assert client.get(f"/v1/models/{model_path.name}").status_code == 200  # the file name, not a path
