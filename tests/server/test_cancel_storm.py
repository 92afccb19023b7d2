"""Clients that leave at any point: streaming requests cancelled at random points (before the
response, during prefill, mid-stream; FIN or RST; 48 in the test command's run, 200 under
--full), a stream closed in a long prefill, and a plain request dropped mid-generation.
Afterwards: 0 KV blocks used, no request running, waiting or in flight, no llama.cpp slot held,
and the same answer as before. The full 1,000 run: benchmarks/cancel_storm.py."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cancel_storm import storm  # noqa: E402

pytestmark = pytest.mark.model

LEAK_GAUGES = ("localllm_kv_blocks_used", "localllm_requests_running", "localllm_requests_waiting",
               "localllm_requests_in_flight", "localllm_kv_runner_sequences")
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def http(live_server) -> httpx.Client:
    headers = {"Authorization": f"Bearer {live_server.api_key}"}
    with httpx.Client(base_url=live_server.url, headers=headers, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def gauges(http: httpx.Client) -> dict[str, float]:
    lines = http.get("/metrics").text.splitlines()
    return {name: float(line.split()[1]) for line in lines for name in LEAK_GAUGES if line.startswith(name + " ")}


def wait_idle(http: httpx.Client, timeout_s: float) -> dict[str, float]:
    """Poll the leak gauges until all are 0; fails with them as they stand after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = gauges(http)
        assert set(now) == set(LEAK_GAUGES)
        if all(v == 0 for v in now.values()):
            return now
        if time.monotonic() > deadline:
            pytest.fail(f"the server still holds work {timeout_s} s later: {now}")
        time.sleep(0.1)


def wait_running(http: httpx.Client, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while gauges(http)["localllm_requests_running"] < 1:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.05)


def france(http: httpx.Client, model_id: str) -> str:
    body = {"model": model_id, "messages": FRANCE, "temperature": 0, "max_tokens": 8}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def raw_post(port: int, path: str, body: dict, api_key: str) -> socket.socket:
    """Sends a request on a raw socket and returns the socket, unread."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {api_key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.heavy
def test_streams_cancelled_at_random_points_leave_nothing_behind(live_server, http, model_id, full):
    num_requests = 200 if full else 48
    before = france(http, model_id)
    log_start = len(live_server.log())

    report = asyncio.run(storm(live_server.port, live_server.api_key, model_id, num_requests,
                               concurrency=8, seed=20261130))

    assert report.errors == []
    assert sum(report.by_mode.values()) == num_requests
    assert all(report.by_mode[m] >= num_requests // 20 for m in ("before_response", "prefill", "complete"))
    assert report.before_first_token >= num_requests // 10  # streams left before their first token
    assert wait_idle(http, timeout_s=30) == dict.fromkeys(LEAK_GAUGES, 0.0)
    assert http.get("/health").json()["status"] == "ok"
    assert france(http, model_id) == before
    new_log = live_server.log()[log_start:]
    assert "Traceback" not in new_log and "ERROR" not in new_log, new_log[-4000:]


def test_stream_closed_in_a_long_prefill_stops_it_there(live_server, http, model_id):
    """A 1,536-token prompt takes 6 steps of 256 tokens to prefill; closed after its first
    one, the request must end within a step or two, which the prefix cache shows: only the
    blocks computed before it left are cached, and a second request finds just those."""
    rng = random.Random(time.time_ns())  # a prompt no earlier run left in the cache
    prompt = [rng.randrange(1000, 30000) for _ in range(1536)]
    sock = raw_post(live_server.port, "/v1/completions", {"model": model_id, "prompt": prompt, "max_tokens": 4,
                                                          "temperature": 0, "stream": True}, live_server.api_key)
    try:
        wait_running(http)
    finally:
        sock.close()
    wait_idle(http, timeout_s=30)

    again = http.post("/v1/completions", json={"model": model_id, "prompt": prompt, "max_tokens": 1,
                                               "temperature": 0}, timeout=600)
    assert again.status_code == 200, again.text
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 256 <= cached <= len(prompt) - 2 * 256, cached  # (at most 1,024)


def test_plain_request_dropped_mid_generation_is_aborted(live_server, http, model_id):
    """A non-streaming request whose client leaves stops at the next step. (It ran on to
    max_tokens before: Request.is_disconnected() never saw the disconnect behind the
    server's @app.middleware layer.)"""
    body = {"model": model_id, "max_tokens": 3000, "temperature": 0, "seed": 1,
            "messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]}
    sock = raw_post(live_server.port, "/v1/chat/completions", body, live_server.api_key)
    try:
        wait_running(http)
        time.sleep(0.5)  # decoding now
    finally:
        sock.close()
    wait_idle(http, timeout_s=20)  # 3,000 tokens would take a minute or more
    assert http.get("/health").json()["status"] == "ok"
