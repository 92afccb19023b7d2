"""A second server, on the Gemma file (no FIM tokens), with one sequence slot and no wait
queue: the 503 path, a 400 for fill-in-the-middle, and SIGTERM during a stream."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from conftest import STOP_TIMEOUT_S, LiveServer, _free_port, _wait_healthy


@pytest.fixture()
def gemma_server(gemma_path, tmp_path):
    port = _free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "localllm.cli", "serve", "--model", str(gemma_path), "--port", str(port),
             "--threads", "2", "--parallel", "1", "--max-queue", "0"],
            stdout=log, stderr=subprocess.STDOUT)
    server = LiveServer(port=port, process=process, log_path=log_path, model_path=gemma_path)
    _wait_healthy(server)
    yield server
    if process.poll() is None:
        process.kill()
        process.wait()


def body(server: LiveServer, **extra) -> dict:
    # A count the base model keeps going with, so a stream stays busy for its max_tokens.
    return {"model": server.model_path.stem, "prompt": ", ".join(str(i) for i in range(1, 40)) + ",",
            "max_tokens": 400, "temperature": 0} | extra


def test_full_queue_is_503_with_retry_after_and_fim_is_400(gemma_server):
    url = f"{gemma_server.base_url}/completions"
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url, json=body(gemma_server, stream=True)) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # the first stream holds the only slot
            busy = http.post(url, json=body(gemma_server, max_tokens=4))
            assert '"finish_reason":null' in next(line for line in lines if line)  # it was still running
        assert busy.status_code == 503
        assert busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "server_busy"
        fim = http.post(url, json=body(gemma_server, suffix="\nThe end.", max_tokens=4))
        assert fim.status_code == 400
        assert "fill-in-the-middle" in fim.json()["error"]["message"]
        assert fim.json()["error"]["param"] == "suffix"


def test_sigterm_ends_a_running_stream_with_an_error_event(gemma_server):
    events: list[str] = []
    started = threading.Event()

    def read() -> None:
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{gemma_server.base_url}/completions",
                             json=body(gemma_server, stream=True, max_tokens=2000)) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    gemma_server.process.send_signal(signal.SIGTERM)
    reader.join(STOP_TIMEOUT_S)
    assert not reader.is_alive(), "the stream hung after SIGTERM"
    assert gemma_server.process.wait(STOP_TIMEOUT_S) == 0
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2])
