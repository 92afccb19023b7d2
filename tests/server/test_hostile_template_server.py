"""A model whose chat template is hostile, served for real: a chat it stops is HTTP 500 in
OpenAI's error shape (type server_error, code chat_template_error: the model's fault, not the
request's), within the time limit; the server stays healthy, plain completions and other chats
still work. A template that does not compile lets the server start and fails each chat the
same way."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gguf_mutations import KV, STRING, read_model
from tiny_gguf import CHATML_TEMPLATE, write_tiny_gguf

LOOP = ("{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% endif %}")
FILE = "{% if messages[0].content == 'file' %}{% include '/etc/passwd' %}{% endif %}"
HUGE = "{% if messages[0].content == 'huge' %}{% for i in range(100000) %}{{ 'a' * 100000 }}{% endfor %}{% endif %}"


def _serve(tmp_path: Path, template: str):
    path = tmp_path / "hostile.gguf"
    write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2")
    model = read_model(tmp_path / "tiny.gguf").with_kv(KV("tokenizer.chat_template", STRING, template))
    path.write_bytes(model.to_bytes())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "localllm.cli", "serve", "--model", str(path), "--port",
                                str(port), "--threads", "1", "--ctx", "512"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if process.poll() is not None:
            pytest.fail(f"serve exited: {(tmp_path / 'serve.log').read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    pytest.fail("serve did not start")


def _stop(process) -> None:
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


def _chat(url: str, content: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "hostile", "max_tokens": 2, "messages": [{"role": "user", "content": content}]})


def _completion_works(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "hostile", "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_hostile_template_is_a_500_and_the_server_survives(tmp_path):
    process, url = _serve(tmp_path, LOOP + FILE + HUGE + CHATML_TEMPLATE)
    try:
        assert _chat(url, "hi").status_code == 200
        for content, problem in [("loop", "ran for more than 2 s"),
                                 ("file", "may not read other templates or files"),
                                 ("huge", "its output passed 8388608 characters")]:
            t0 = time.monotonic()
            r = _chat(url, content)
            assert r.status_code == 500, r.text
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "chat_template_error")
            assert error["message"].startswith("the chat template of model 'hostile.gguf' ")
            assert problem in error["message"], error["message"]
            assert time.monotonic() - t0 < 30
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert _chat(url, "hi").status_code == 200
        _completion_works(url)
    finally:
        _stop(process)


def test_template_that_does_not_compile(tmp_path):
    process, url = _serve(tmp_path, "{% for m in messages %}{{ m.content }")
    try:
        r = _chat(url, "hi")
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "chat_template_error"
        assert "does not compile (line 1" in r.json()["error"]["message"]
        _completion_works(url)
    finally:
        _stop(process)
