"""Clients that stall, trickle or send too much, on raw sockets against a real `localllm serve`
(Qwen2.5-Coder-0.5B) started with a short --read-timeout. Each is cut off in time with OpenAI's
error object where HTTP still allows an answer, no request reaches the engine before its body
is whole, and a well-behaved client is served meanwhile."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import STOP_TIMEOUT_S, LiveServer, _free_port, _wait_healthy

pytestmark = pytest.mark.model

READ_TIMEOUT_S = 1.0
MAX_BODY = 8 * 1024 * 1024  # ServerConfig.max_body_bytes
KEY = "sk-slow"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(qwen_path, tmp_path_factory) -> LiveServer:
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve-slow") / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "localllm.cli", "serve", "--model", str(qwen_path), "--port", str(port),
             "--threads", "2", "--ctx", "1024", "--api-key", KEY, "--read-timeout", str(READ_TIMEOUT_S)],
            stdout=log, stderr=subprocess.STDOUT)
    live = LiveServer(port=port, process=process, log_path=log_path, model_path=qwen_path, api_key=KEY)
    _wait_healthy(live)
    yield live
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=STOP_TIMEOUT_S) == 0, live.log()[-4000:]


def head(path: str, length: int | None, extra: str = "") -> bytes:
    """A POST's request line and headers, with a Content-Length or chunked."""
    framing = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{framing}{extra}\r\n").encode()


def connect(server: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(READ_TIMEOUT_S * 10)
    return sock


def read_until_closed(sock: socket.socket, or_response: bool = False) -> bytes:
    """Everything the server sends until it closes the connection; with ``or_response``, also
    stop at one whole response (by its Content-Length), whether or not the server then closes."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
        if or_response:
            _, sep, body = data.partition(b"\r\n\r\n")
            length = parse(data)[1].get("content-length") if sep else None
            if length is not None and len(body) >= int(length):
                return data


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one HTTP/1.1 response with a Content-Length."""
    head_bytes, _, body = raw.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body[:int(headers["content-length"])]


def openai_error(raw: bytes, status: int) -> dict:
    got, headers, body = parse(raw)
    assert got == status, raw[:500]
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert set(error) == ERROR_KEYS and error["message"]
    return error


def engine_counts(server: LiveServer) -> tuple[float, float]:
    """(requests running, requests waiting) in the engine, from /metrics."""
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("localllm_requests_"))
    return float(values["localllm_requests_running"]), float(values["localllm_requests_waiting"])


def body_for(server: LiveServer, max_tokens: int = 2) -> bytes:
    return json.dumps({"model": server.model_path.stem, "prompt": "def add(a, b):", "max_tokens": max_tokens,
                       "temperature": 0}).encode()


def test_headers_then_half_a_body_then_a_stall_gets_408(server):
    body = body_for(server)
    sock = connect(server)
    start = time.monotonic()
    sock.sendall(head("/v1/completions", len(body)) + body[:len(body) // 2])
    time.sleep(READ_TIMEOUT_S / 2)
    assert engine_counts(server) == (0.0, 0.0)  # the half-sent request is nowhere in the engine
    raw = read_until_closed(sock)
    elapsed = time.monotonic() - start
    error = openai_error(raw, 408)
    assert error["code"] == "request_timeout" and f"{READ_TIMEOUT_S:g} s" in error["message"]
    assert parse(raw)[1]["connection"] == "close"
    assert READ_TIMEOUT_S <= elapsed < READ_TIMEOUT_S + 3, elapsed
    assert engine_counts(server) == (0.0, 0.0)


def test_a_trickling_body_is_cut_off_at_the_deadline_not_kept_alive_by_each_byte(server):
    body = body_for(server) + b" " * 200  # trailing spaces: still valid JSON when whole
    sock = connect(server)
    sock.sendall(head("/v1/completions", len(body)))
    start, sent = time.monotonic(), 0
    try:
        while sent < len(body):  # one byte every 50 ms: 12 s for the whole body
            sock.sendall(body[sent:sent + 1])
            sent += 1
            time.sleep(0.05)
    except (BrokenPipeError, ConnectionResetError):
        pass
    elapsed = time.monotonic() - start
    assert sent < len(body) and elapsed < READ_TIMEOUT_S + 3, (sent, elapsed)
    assert openai_error(read_until_closed(sock), 408)["code"] == "request_timeout"


def test_a_chunked_body_that_stalls_gets_408(server):
    body = body_for(server)
    sock = connect(server)
    sock.sendall(head("/v1/chat/completions", None) + f"{len(body):x}\r\n".encode() + body + b"\r\n")
    # ...and never the closing 0-length chunk.
    assert openai_error(read_until_closed(sock), 408)["code"] == "request_timeout"


def test_half_sent_headers_get_the_connection_closed(server):
    start = time.monotonic()
    socks = []
    for partial in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"GE"):  # at once
        socks.append(connect(server))
        socks[-1].sendall(partial)
    for sock in socks:
        assert read_until_closed(sock) == b""  # nothing to answer: no request was made
        assert READ_TIMEOUT_S - 0.1 <= time.monotonic() - start < READ_TIMEOUT_S + 3


def test_an_idle_kept_alive_connection_is_closed_and_a_second_request_head_is_timed_too(server):
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = b""
    while b"\r\n\r\n" not in first or not first.endswith(b"}"):
        first += sock.recv(65536)
    assert parse(first)[0] == 200
    sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next request's head, never finished
    start = time.monotonic()
    assert read_until_closed(sock) == b""
    assert time.monotonic() - start < READ_TIMEOUT_S + 3


def test_a_slow_but_steady_body_within_the_deadline_is_served(server):
    body = body_for(server)
    sock = connect(server)
    sock.sendall(head("/v1/completions", len(body), extra="Connection: close\r\n"))
    for i in range(0, len(body), 16):  # the whole body over about a quarter of the deadline
        sock.sendall(body[i:i + 16])
        time.sleep(READ_TIMEOUT_S / 4 / (len(body) / 16))
    status, _, answer = parse(read_until_closed(sock))
    assert status == 200, answer
    assert json.loads(answer)["usage"]["completion_tokens"] == 2


def test_stalled_clients_do_not_hold_up_others(server):
    """Eight clients stall mid-body while a ninth is served at once; then all eight get 408."""
    body = body_for(server)
    stalled = [connect(server) for _ in range(8)]
    for sock in stalled:
        sock.sendall(head("/v1/completions", len(body)) + body[:10])
    answer = httpx.post(f"{server.base_url}/completions", content=body, timeout=60,
                        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert answer.status_code == 200, answer.text
    results: list[int] = []

    def wait(sock: socket.socket) -> None:
        results.append(parse(read_until_closed(sock))[0])

    threads = [threading.Thread(target=wait, args=(sock,)) for sock in stalled]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=READ_TIMEOUT_S * 10)
    assert results == [408] * 8
    assert engine_counts(server) == (0.0, 0.0)


def test_body_over_the_limit_is_413_with_content_length_before_it_is_sent(server):
    sock = connect(server)
    sock.sendall(head("/v1/completions", MAX_BODY + 1))  # the header alone: no body follows
    error = openai_error(read_until_closed(sock, or_response=True), 413)
    assert error["code"] == "request_too_large"
    assert str(MAX_BODY + 1) in error["message"] and str(MAX_BODY) in error["message"]


def test_chunked_body_over_the_limit_is_413_once_the_limit_is_passed(server):
    sock = connect(server)
    sock.sendall(head("/v1/completions", None))
    piece = b"a" * (1024 * 1024)
    for _ in range(9):  # 9 MiB in 1 MiB chunks
        try:
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            break
    error = openai_error(read_until_closed(sock, or_response=True), 413)
    assert error["code"] == "request_too_large" and "at least" in error["message"]


def test_the_key_is_checked_before_a_body_is_read(server):
    """A client without the key gets its 401 from the headers alone: the server reads no
    body (here: none is ever sent) for anyone who may not use it."""
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n")
    start = time.monotonic()
    error = openai_error(read_until_closed(sock, or_response=True), 401)
    assert error["code"] == "invalid_api_key"
    assert time.monotonic() - start < READ_TIMEOUT_S


@pytest.mark.parametrize("junk", [b"NOT HTTP AT ALL\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
                                  b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"])
def test_malformed_http_gets_openai_error_and_a_close(server, junk):
    sock = connect(server)
    sock.sendall(junk)
    raw = read_until_closed(sock)
    assert openai_error(raw, 400)["code"] == "invalid_http"
    assert parse(raw)[1]["connection"] == "close"


def test_the_server_is_whole_after_the_slow_clients(server):
    assert server.process.poll() is None
    assert engine_counts(server) == (0.0, 0.0)
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log[-4000:]
