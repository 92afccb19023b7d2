"""Several models behind one port: a real `localllm serve` with no --model, over the two real
test models installed in a home of the test's own (Qwen2.5-Coder-0.5B and Gemma 3 270M), and
`--memory` set so that either fits alone but not both together (server/models.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import LiveServer, _free_port, _wait_healthy  # tests/server/conftest.py

CTX = 1024
COUNT = {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 4, "temperature": 0}


def _need(path: Path) -> int:
    """What the server plans for a model of CTX tokens (weights + KV), as models.Loader does."""
    from localllm.gguf import read_info
    from localllm.memory import plan

    kv = plan(read_info(path), "f16", "llamacpp", CTX, None)
    return kv.weights_bytes + kv.kv_bytes


def _memory_for(budget: int) -> int:
    """The --memory that leaves ``budget`` for models after memory.py's headroom."""
    from localllm.memory import HEADROOM_BASE, HEADROOM_SHARE

    return int((budget + HEADROOM_BASE) / (1 - HEADROOM_SHARE)) + (1 << 20)


def _cli(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = os.environ | {"LOCALLLM_HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "localllm.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def _start(home: Path, log_path: Path, *args: str, key: str | None = "k") -> LiveServer:
    port = _free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "localllm.cli", "serve", "--port", str(port),
                                    "--threads", "2", "--ctx", str(CTX), *(["--api-key", key] if key else []), *args],
                                   stdout=log, stderr=subprocess.STDOUT,
                                   env=os.environ | {"LOCALLLM_HOME": str(home)})
    server = LiveServer(port=port, process=process, log_path=log_path, model_path=Path("-"), api_key="k")
    _wait_healthy(server)
    return server


def _stop(server: LiveServer) -> None:
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=20) == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def home(qwen_path: Path, gemma_path: Path, tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("home")
    for path in (qwen_path, gemma_path):
        _cli(home, "pull", str(path))
    return home


@pytest.fixture(scope="module")
def names(qwen_path: Path, gemma_path: Path) -> tuple[str, str]:
    return qwen_path.stem, gemma_path.stem  # `pull PATH` installs a file under its stem


@pytest.fixture(scope="module")
def one_fits(home, qwen_path, gemma_path, tmp_path_factory):
    budget = max(_need(qwen_path), _need(gemma_path)) + (8 << 20)
    assert budget < _need(qwen_path) + _need(gemma_path)  # the two together do not fit
    server = _start(home, tmp_path_factory.mktemp("serve") / "serve.log", "--memory", str(_memory_for(budget)))
    yield server
    _stop(server)


@pytest.fixture(scope="module")
def http(one_fits):
    with httpx.Client(base_url=one_fits.url, headers={"Authorization": "Bearer k"}, timeout=120) as c:
        yield c


def _loaded(http) -> dict[str, dict]:
    return {m["name"]: m for m in http.get("/api/ps").json()["models"] if m["state"] == "loaded"}


def test_every_installed_model_is_listed_and_none_is_loaded_before_a_request(http, names):
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert set(cards) == set(names)
    # The Gemma file is a base model: no chat template, so it is listed for completions.
    assert [cards[name]["kind"] for name in names] == ["chat", "completion"]
    assert all(c["loaded"] is False and c["context_length"] > 0 for c in cards.values())
    assert _loaded(http) == {}


def test_a_name_not_installed_is_a_404_that_lists_the_installed(http, names):
    r = http.post("/v1/completions", json={**COUNT, "model": "llama3:70b"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert all(name in error["message"] for name in names)


def test_eight_concurrent_requests_to_an_unloaded_model_load_it_once(one_fits, http, names):
    qwen = names[0]

    async def main():
        async with httpx.AsyncClient(base_url=one_fits.url, headers={"Authorization": "Bearer k"}, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json={**COUNT, "model": qwen}) for _ in range(8)))

    answers = asyncio.run(main())
    assert [r.status_code for r in answers] == [200] * 8
    assert {r.json()["choices"][0]["text"] for r in answers} == {answers[0].json()["choices"][0]["text"]}
    assert answers[0].json()["choices"][0]["text"].startswith(" 7")
    assert answers[0].json()["model"] == qwen
    assert _loaded(http)[qwen]["loads"] == 1


def test_requests_alternate_between_the_models_and_each_unloads_the_idle_other(http, names):
    for name in (*names, *names):
        r = http.post("/v1/completions", json={**COUNT, "model": name})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith(" 7"), (name, r.json())
        assert r.json()["model"] == name
        assert set(_loaded(http)) == {name}  # only one fits: the other was unloaded to make room
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert cards[names[1]]["loaded"] and not cards[names[0]]["loaded"]


def test_a_model_streaming_is_not_unloaded_under_its_stream(one_fits, http, names):
    streaming, other = names

    async def main():
        async with httpx.AsyncClient(base_url=one_fits.url, headers={"Authorization": "Bearer k"}, timeout=120) as c:
            async with c.stream("POST", "/v1/completions", json={
                    **COUNT, "model": streaming, "max_tokens": 48, "stream": True}) as stream:
                lines = stream.aiter_lines()
                first = await anext(lines)  # the stream runs: its model is loaded and held
                assert first.startswith("data: ")
                waiting = asyncio.create_task(c.post("/v1/completions", json={**COUNT, "model": other}))
                await asyncio.sleep(0.5)
                assert not waiting.done()  # it waits for the memory the stream's model holds
                rest = [line async for line in lines]
            assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
            assert any('"finish_reason":"length"' in line for line in rest)  # the stream ran to its end
            return await waiting

    after = asyncio.run(main())
    assert after.status_code == 200 and after.json()["choices"][0]["text"].startswith(" 7")
    assert set(_loaded(http)) == {other}


def test_keep_alive_0_unloads_the_model_after_its_request(http, names):
    r = http.post("/v1/completions", json={**COUNT, "model": names[1], "keep_alive": 0})
    assert r.status_code == 200
    assert _loaded(http) == {}
    r = http.post("/v1/completions", json={**COUNT, "model": names[1], "keep_alive": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
    assert "is not a duration" in r.json()["error"]["message"]


def test_ps_and_stop_talk_to_the_running_server(one_fits, http, home, names):
    qwen = names[0]
    assert http.post("/v1/completions", json={**COUNT, "model": qwen, "keep_alive": "1h"}).status_code == 200
    url = ["--url", one_fits.base_url, "--api-key", "k"]
    shown = _cli(home, "ps", *url).stdout
    assert qwen in shown and " chat " in shown and "59m" in shown  # keep_alive 1h, a few seconds gone
    assert _cli(home, "stop", qwen, *url).stdout.strip() == f"unloaded {qwen}"
    again = _cli(home, "stop", qwen, *url, check=False)
    assert again.returncode == 1 and f"{qwen} is not loaded" in again.stderr
    unknown = _cli(home, "stop", "nope", *url, check=False)
    assert unknown.returncode == 2 or unknown.returncode == 1
    assert "does not exist" in unknown.stderr
    metrics = http.get("/metrics").text
    loads = next(line for line in metrics.splitlines() if line.startswith(f'localllm_model_loads_total{{model="{qwen}"}}'))
    timed = next(line for line in metrics.splitlines()
                 if line.startswith(f'localllm_model_load_seconds_count{{model="{qwen}"}}'))
    assert float(loads.split()[-1]) == float(timed.split()[-1]) >= 2  # every load timed in the histogram
    assert f'localllm_model_loaded{{model="{qwen}"}} 0.0' in metrics


def test_a_model_that_cannot_fit_gets_its_sizes_and_the_other_still_answers(home, qwen_path, gemma_path, names,
                                                                            tmp_path_factory):
    small, large = sorted((qwen_path, gemma_path), key=_need)
    budget = _need(small) + (8 << 20)
    assert budget < _need(large)
    memory = str(_memory_for(budget))
    # Pinned, it stops the server from starting: exit 2, with the sizes.
    refused = _cli(home, "serve", "--model", str(large), "--memory", memory, "--ctx", str(CTX), "--port", "0",
                   check=False)
    assert refused.returncode == 2
    assert "does not fit" in refused.stderr and "GiB" in refused.stderr
    server = _start(home, tmp_path_factory.mktemp("serve") / "small.log", "--memory", memory)
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer k"}, timeout=120) as c:
            r = c.post("/v1/completions", json={**COUNT, "model": large.stem})
            assert r.status_code == 400
            error = r.json()["error"]
            assert error["code"] == "model_too_large" and "does not fit" in error["message"]
            assert "GiB" in error["message"] or "MiB" in error["message"]
            r = c.post("/v1/completions", json={**COUNT, "model": small.stem})
            assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(" 7")
    finally:
        _stop(server)


# -- a model served by another server -----------------------------------------------------------


def _gauge(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_an_upstream_model_streams_through_and_a_client_leaving_cancels_it(qwen_path, gemma_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("upstream")
    upstream = _start(tmp_path_factory.mktemp("home-up"), logs / "up.log", "--model", str(qwen_path), key=None)
    front = _start(tmp_path_factory.mktemp("home-front"), logs / "front.log", "--model", str(gemma_path),
                   "--upstream", f"remote=http://127.0.0.1:{upstream.port}/v1#{qwen_path.stem}",
                   "--upstream", "down=http://127.0.0.1:9/v1")
    headers = {"Authorization": "Bearer k"}
    try:
        with httpx.Client(base_url=front.url, headers=headers, timeout=120) as http, \
                httpx.Client(base_url=upstream.url, timeout=120) as up:
            cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
            assert list(cards) == [gemma_path.stem, "remote", "down"]
            assert cards["remote"]["owned_by"] == f"http://127.0.0.1:{upstream.port}/v1"
            direct = up.post("/v1/completions", json={**COUNT, "model": qwen_path.stem}).json()
            through = http.post("/v1/completions", json={**COUNT, "model": "remote"}).json()
            assert through["choices"][0]["text"] == direct["choices"][0]["text"]
            assert through["choices"][0]["text"].startswith(" 7")

            # A stream passes through; leaving it aborts the upstream's request.
            with http.stream("POST", "/v1/completions", json={**COUNT, "model": "remote", "max_tokens": 1000,
                                                              "stream": True}) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: {")
                assert _gauge(up.get("/metrics").text, "localllm_requests_in_flight") == 1
            deadline = time.monotonic() + 5
            while _gauge(up.get("/metrics").text, "localllm_requests_in_flight") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _gauge(up.get("/metrics").text, "localllm_requests_in_flight") == 0  # 1,000 tokens take far longer

            # An upstream that does not answer: a 503 in OpenAI's shape; the local model is unaffected.
            r = http.post("/v1/chat/completions", json={"model": "down", "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"
            assert "http://127.0.0.1:9/v1" in r.json()["error"]["message"]
            r = http.post("/v1/completions", json={**COUNT, "model": gemma_path.stem})
            assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(" 7")
            # Anthropic's door does not translate for an upstream: it says which routes reach it.
            r = http.post("/v1/messages", json={"model": "remote", "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"]
    finally:
        _stop(front)
        _stop(upstream)
