"""A real `localllm serve` process on a loopback port, shared by the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "sk-test"
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 15


@dataclass(frozen=True)
class LiveServer:
    port: int
    process: subprocess.Popen
    log_path: Path
    model_path: Path
    api_key: str = API_KEY

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: LiveServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"localllm serve exited with {server.process.returncode} while starting:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    server.process.kill()
    pytest.fail(f"localllm serve did not answer /health within {START_TIMEOUT_S} s:\n{server.log()}")


def start_serve(path: Path, home: Path, log_path: Path, *args: str) -> LiveServer:
    """A `localllm serve --model path` of its own, with LOCALLLM_HOME=home (its prefix cache),
    appending to log_path, answering /health; stop it with stop_serve."""
    port = _free_port()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "localllm.cli", "serve", "--model", str(path), "--port", str(port),
             "--threads", "2", *args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "LOCALLLM_HOME": str(home)})
    server = LiveServer(port=port, process=process, log_path=log_path, model_path=path)
    _wait_healthy(server)
    return server


def stop_serve(server: LiveServer) -> None:
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=STOP_TIMEOUT_S) == 0, server.log()[-3000:]


SERVER_CTX = 4096  # the tests' server holds this many tokens of KV (its default would depend on free memory)


@pytest.fixture(scope="session")
def live_server(qwen_path: Path, minilm_path: Path, tmp_path_factory) -> LiveServer:
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "localllm.cli", "serve", "--model", str(qwen_path), "--port", str(port),
             "--threads", "2", "--api-key", API_KEY, "--ctx", str(SERVER_CTX),
             "--embedding-model", str(minilm_path)],
            stdout=log, stderr=subprocess.STDOUT)
    server = LiveServer(port=port, process=process, log_path=log_path, model_path=qwen_path)
    _wait_healthy(server)
    yield server
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"localllm serve did not exit within {STOP_TIMEOUT_S} s of SIGTERM:\n{server.log()[-4000:]}")
    assert code == 0, f"localllm serve exited with {code} on SIGTERM:\n{server.log()[-4000:]}"


@pytest.fixture(scope="session")
def served_model(live_server) -> str:
    """The chat model's id, as /v1/models lists it (the GGUF file's stem)."""
    return live_server.model_path.stem


@pytest.fixture(scope="session")
def keyed_http(live_server) -> httpx.Client:
    """Raw HTTP to the live server, with its key (for what the wire itself shows)."""
    with httpx.Client(base_url=live_server.url, headers={"Authorization": f"Bearer {live_server.api_key}"},
                      timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def client(live_server):
    """The official openai client on the live server (test_anthropic.py has its own `client`)."""
    import openai

    with openai.OpenAI(base_url=live_server.base_url, api_key=live_server.api_key, max_retries=0, timeout=120) as c:
        yield c
