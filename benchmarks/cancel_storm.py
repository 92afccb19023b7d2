"""Streaming requests to a running `localllm serve`, cancelled at random points by clients that
close their sockets; afterwards the server must hold no KV block, no request, no runner slot,
and answer as it did before.

    nice -n 19 python benchmarks/cancel_storm.py [--requests 1000] [--concurrency 8] [--seed 1]

Without --url it starts its own server (Qwen2.5-Coder-0.5B, --ctx 4096, 2 threads). The clients
speak HTTP/1.1 over raw sockets, so they can leave at any byte: each request is one of

    before_response   sends the request and closes at once, before the status line
    prefill           a unique prompt of ~200-400 tokens (no prefix-cache hit), closed 0-1.5 s
                      after the stream opened: while it waits, or in its chunked prefill
    mid_stream        closes after 1-16 content chunks (of at most 24 tokens)
    complete          reads the stream to `data: [DONE]` and checks its shape (the control)

and closes either politely (FIN) or abortively (RST, SO_LINGER 0). tests/server/
test_cancel_storm.py runs 200 of these in CI; this script runs the full 1,000.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import struct
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

MODES = ("before_response", "prefill", "mid_stream", "complete")
WEIGHTS = (0.25, 0.3, 0.35, 0.1)
REQUEST_TIMEOUT_S = 300
WORDS = ("alpha", "river", "stone", "copper", "violet", "engine", "harbor", "lantern", "quartz", "meadow",
         "signal", "orbit", "cedar", "falcon", "ember", "tundra")


@dataclass
class Outcome:
    mode: str
    num_chunks: int = 0  # content chunks (tokens) read before leaving
    got_status: bool = False
    finished: bool = False  # the stream ended by itself ([DONE]) before we left
    error: str | None = None


@dataclass
class StormReport:
    num_requests: int
    seconds: float
    by_mode: dict[str, int]
    before_first_token: int  # closed with the stream open and no token read yet
    completed_early: int  # streams that ended by themselves before their planned cancel point
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def plan_requests(n: int, seed: int) -> list[tuple[str, float, int, bool]]:
    """(mode, delay after the stream opened, chunks to read, abortive close) per request."""
    rng = random.Random(seed)
    return [(rng.choices(MODES, WEIGHTS)[0], rng.uniform(0.0, 1.5), rng.randint(1, 16), rng.random() < 0.5)
            for _ in range(n)]


def request_bytes(i: int, mode: str, model: str, port: int, api_key: str, seed: int) -> bytes:
    rng = random.Random(seed * 100_003 + i)
    if mode == "prefill":  # unique from its first word, so no block of it is cached
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(150, 300)))
        content = f"Request {seed}-{i}. Summarize this list of words: {words}"
    else:
        content = f"Tell me a short fact about the number {i} ({seed})."
    body = json.dumps({"model": model, "stream": True, "max_tokens": 24, "temperature": 0.8, "seed": i,
                       "messages": [{"role": "user", "content": content}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def _events(reader: asyncio.StreamReader):
    """The SSE data payloads of a chunked HTTP/1.1 response body, as they arrive."""
    buffer = b""
    while True:
        size_line = await reader.readline()
        if not size_line:
            return
        size = int(size_line.strip() or b"0", 16)
        if size == 0:
            return
        buffer += await reader.readexactly(size)
        await reader.readexactly(2)
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[6:].decode()


async def one(port: int, api_key: str, model: str, i: int, plan: tuple[str, float, int, bool], seed: int) -> Outcome:
    mode, delay, num_chunks, abortive = plan
    out = Outcome(mode)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_bytes(i, mode, model, port, api_key, seed))
        await writer.drain()
        if mode == "before_response":
            return out
        status = await reader.readline()
        out.got_status = True
        if not status.startswith(b"HTTP/1.1 200"):
            out.error = f"status line {status!r}"
            return out
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        if not headers.get("content-type", "").startswith("text/event-stream"):
            out.error = f"headers {headers}"
            return out
        events = _events(reader)
        deadline = time.monotonic() + delay
        while True:
            timeout = deadline - time.monotonic() if mode == "prefill" else None
            if timeout is not None and timeout <= 0:
                return out
            try:
                data = await asyncio.wait_for(events.__anext__(), timeout)
            except asyncio.TimeoutError:
                return out
            except StopAsyncIteration:
                out.error = "the stream ended without data: [DONE]"
                return out
            if data == "[DONE]":
                out.finished = True
                return out
            event = json.loads(data)
            if "error" in event:
                out.error = f"error event {event['error']}"
                return out
            choice = event["choices"][0]
            if choice["delta"].get("content"):
                out.num_chunks += 1
            if mode == "mid_stream" and out.num_chunks >= num_chunks:
                return out
    except (OSError, asyncio.IncompleteReadError, ValueError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    finally:
        if abortive:  # RST instead of FIN
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass


async def storm(port: int, api_key: str, model: str, num_requests: int, concurrency: int = 8,
                seed: int = 1) -> StormReport:
    plans = plan_requests(num_requests, seed)
    gate = asyncio.Semaphore(concurrency)
    start = time.monotonic()

    async def gated(i: int) -> Outcome:
        async with gate:
            try:
                return await asyncio.wait_for(one(port, api_key, model, i, plans[i], seed), REQUEST_TIMEOUT_S)
            except asyncio.TimeoutError:
                return Outcome(plans[i][0], error=f"no end within {REQUEST_TIMEOUT_S} s: the server hangs")

    outcomes = await asyncio.gather(*(gated(i) for i in range(num_requests)))
    errors = [f"request {i} ({o.mode}): {o.error}" for i, o in enumerate(outcomes) if o.error]
    for i, o in enumerate(outcomes):
        if o.mode == "complete" and not o.finished and not o.error:
            errors.append(f"request {i} (complete): the stream did not end with [DONE]")
    return StormReport(
        num_requests=num_requests, seconds=time.monotonic() - start,
        by_mode=dict(Counter(o.mode for o in outcomes)),
        before_first_token=sum(1 for o in outcomes if o.got_status and o.num_chunks == 0 and not o.finished),
        completed_early=sum(1 for o in outcomes if o.finished and o.mode != "complete"),
        errors=errors)


def main() -> int:
    import httpx

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--url", help="a running server (http://127.0.0.1:PORT); else one is started")
    parser.add_argument("--api-key", default="sk-storm")
    args = parser.parse_args()
    from soak import free_port, idle_figures, start_server, stop_server

    server = None
    if args.url is None:
        port = free_port()
        server, log_path = start_server(port, args.api_key)
        url = f"http://127.0.0.1:{port}"
    else:
        url, log_path = args.url.rstrip("/"), None
        port = int(url.rsplit(":", 1)[1])
    headers = {"Authorization": f"Bearer {args.api_key}"}
    try:
        model = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        probe = {"model": model, "temperature": 0, "max_tokens": 8,
                 "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]}
        before = httpx.post(f"{url}/v1/chat/completions", json=probe, headers=headers, timeout=120).json()
        report = asyncio.run(storm(port, args.api_key, model, args.requests, args.concurrency, args.seed))
        idle_start = time.monotonic()
        idle = idle_figures(url, headers)
        idle_s = time.monotonic() - idle_start
        health = httpx.get(f"{url}/health", timeout=10).json()
        after = httpx.post(f"{url}/v1/chat/completions", json=probe, headers=headers, timeout=120).json()
    finally:
        if server is not None:
            stop_server(server)
    same = before["choices"][0]["message"] == after["choices"][0]["message"]
    log_problems = []
    if log_path is not None:
        text = log_path.read_text(errors="replace")
        log_problems = [line for line in text.splitlines() if "Traceback" in line or "ERROR" in line]
    ok = not report.errors and all(v == 0 for v in idle.values()) and health["status"] == "ok" and same \
        and not log_problems
    print(json.dumps(report.as_dict() | {"idle_after": idle, "seconds_to_idle": round(idle_s, 2),
                                         "health": health, "answer_before": before["choices"][0]["message"],
                                         "answer_after_unchanged": same, "log_problems": log_problems[:20],
                                         "passed": ok}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
