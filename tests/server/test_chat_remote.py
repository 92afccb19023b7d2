"""The chat app's RemoteBackend against a real `localllm serve` process (the shared live_server,
Qwen2.5-Coder-0.5B, context 4096, API key "sk-test"): model discovery, the key, a greedy
stream, stop() mid-answer, and a prompt longer than the server's context."""

from __future__ import annotations

import asyncio
import re
import socket
import time

import httpx
import pytest

from localllm.errors import ContextOverflowError, EngineError, ModelLoadError
from localllm.tui.backend import Chunk, Figures, GenerationSettings, RemoteBackend

pytestmark = pytest.mark.model

SERVER_CTX = 4096  # the --ctx of conftest's live_server
WAIT_S = 60
GREEDY = GenerationSettings(temperature=0, top_p=1.0, max_tokens=16)
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture
def backend(live_server) -> RemoteBackend:
    backend = RemoteBackend(live_server.url, api_key=live_server.api_key, timeout_s=WAIT_S)
    backend.load()
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def http(live_server) -> httpx.Client:
    with httpx.Client(base_url=live_server.url, headers={"Authorization": f"Bearer {live_server.api_key}"},
                      timeout=WAIT_S) as c:
        yield c


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))


async def collect(backend: RemoteBackend, messages: list[dict], settings: GenerationSettings) -> list[Chunk]:
    return [chunk async for chunk in backend.stream(messages, settings)]


def wait_idle(http: httpx.Client, timeout_s: float = 5.0) -> None:
    """Poll /metrics until the server holds no KV block and runs no sequence."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = http.get("/metrics").text.splitlines()
        if "localllm_kv_blocks_used 0.0" in lines and "localllm_requests_running 0.0" in lines:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the server still holds work {timeout_s} s later:\n"
                        + "\n".join(x for x in lines if x.startswith(("localllm_kv", "localllm_requests_running"))))
        time.sleep(0.1)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- load ----------------------------------------------------------------------------------


def test_load_picks_the_served_model(live_server):
    backend = RemoteBackend(live_server.url + "/", api_key=live_server.api_key)
    assert backend.base_url == live_server.base_url
    backend.load()
    assert backend.model_name == live_server.model_path.stem == "qwen2.5-coder-0.5b-instruct-q4_k_m"
    assert backend.n_ctx == SERVER_CTX  # /v1/models' context_length: what a reply may fill


def test_load_keeps_a_model_named_by_the_person(live_server):
    backend = RemoteBackend(live_server.base_url, model=live_server.model_path.name, api_key=live_server.api_key)
    backend.load()
    assert backend.model_name == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


@pytest.mark.parametrize("api_key", ["sk-wrong", None])
def test_load_with_a_wrong_or_missing_key(live_server, api_key):
    backend = RemoteBackend(live_server.base_url, api_key=api_key)
    with pytest.raises(ModelLoadError) as e:
        backend.load()
    assert str(e.value) == (f"{live_server.base_url} refused the API key (HTTP 401); "
                            "pass the server's key with --api-key")
    assert backend.model_name == ""


def test_load_of_a_server_that_is_not_there():
    backend = RemoteBackend(f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(ModelLoadError, match=r"^cannot reach http://127\.0\.0\.1:\d+/v1 \(.*\); "
                                             r"start the server or fix --endpoint$"):
        backend.load()


# -- streaming -----------------------------------------------------------------------------


def test_greedy_stream(backend, http):
    chunks = run(collect(backend, FRANCE, GREEDY))
    assert chunks[-1] == Chunk(finished=True, finish_reason="stop")
    assert all(not c.finished for c in chunks[:-1])
    text = "".join(c.text for c in chunks)

    # The same request without streaming: the same greedy text and the same prompt length.
    reference = http.post("/v1/chat/completions", json={
        "model": backend.model_name, "messages": FRANCE, "temperature": 0, "top_p": 1.0, "max_tokens": 16})
    assert reference.status_code == 200, reference.text
    reference = reference.json()
    assert text == reference["choices"][0]["message"]["content"]
    assert text.strip().rstrip(".") == "Paris"
    num_prompt = reference["usage"]["prompt_tokens"]

    with_prompt = [c for c in chunks if c.prompt_tokens is not None]
    assert len(with_prompt) == 1  # the usage event
    assert with_prompt[0].prompt_tokens == num_prompt
    assert with_prompt[0].cached_tokens % 16 == 0
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop", "stop"]  # the server's, then ours

    figures = Figures()
    for c in chunks:
        figures.observe(c)
    assert (figures.prompt_tokens, figures.finish_reason) == (num_prompt, "stop")
    assert figures.num_tokens == sum(1 for c in chunks if c.text)
    assert figures.ttft is not None and figures.ttft > 0
    wait_idle(http)


def test_stream_with_a_wrong_key_names_the_option(live_server):
    backend = RemoteBackend(live_server.base_url, model=live_server.model_path.stem, api_key="sk-wrong")
    with pytest.raises(EngineError) as e:
        run(collect(backend, FRANCE, GREEDY))
    assert str(e.value) == "the server refused the API key (HTTP 401); pass it with --api-key"


def test_stream_of_a_model_the_server_does_not_serve(live_server, backend):
    backend.model_name = "no-such-model"
    with pytest.raises(EngineError, match=r"^the server answered HTTP 404: The model 'no-such-model' does not exist"):
        run(collect(backend, FRANCE, GREEDY))


def test_stop_mid_answer_and_the_server_stays_healthy(backend, http):
    messages = [{"role": "user", "content": "Count from 1 to 500, one number per line."}]
    # 1000 tokens take the server well over wait_idle's 5 s: idle at once means it aborted.
    settings = GenerationSettings(temperature=0, top_p=1.0, max_tokens=1000)

    async def main() -> list[Chunk]:
        chunks, num_text = [], 0
        async for chunk in backend.stream(messages, settings):
            chunks.append(chunk)
            num_text += bool(chunk.text)
            if num_text == 4 and chunk.text:
                backend.stop()
        return chunks

    chunks = run(main())
    assert chunks[-1] == Chunk(finished=True, finish_reason="abort")
    assert sum(1 for c in chunks if c.text) <= 6  # at most what was already on the wire
    assert all(not c.finished and c.finish_reason is None for c in chunks[:-1])
    assert backend._stopping is None
    wait_idle(http)  # leaving the stream closed the connection, and the server aborted the request

    backend.stop()  # nothing streams now: a no-op
    after = run(collect(backend, FRANCE, GREEDY))
    assert after[-1] == Chunk(finished=True, finish_reason="stop")
    assert "".join(c.text for c in after).strip().rstrip(".") == "Paris"
    health = http.get("/health").json()
    assert (health["status"], health["model"]) == ("ok", backend.model_name) and backend.model_name in health["loaded"]


def test_a_prompt_longer_than_the_server_s_context(backend, http):
    messages = [{"role": "user", "content": " ".join(["hello"] * (SERVER_CTX + 100))}]
    # What the server answers: 400 with OpenAI's code for it.
    raw = http.post("/v1/chat/completions", json={"model": backend.model_name, "messages": messages,
                                                  "max_tokens": 16, "stream": True})
    assert raw.status_code == 400
    error = raw.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith(f"This model's maximum context length is {SERVER_CTX} tokens.")

    async def main() -> list[Chunk]:
        chunks = []
        with pytest.raises(ContextOverflowError) as e:
            async for chunk in backend.stream(messages, GREEDY):
                chunks.append(chunk)
        # The backend asked again without max_tokens (as the local engine would answer until the
        # context is full); the prompt alone does not fit either.
        num_prompt = int(re.search(r"\((\d+) in the prompt", error["message"]).group(1))
        assert str(e.value) == (f"the server says: This model's maximum context length is {SERVER_CTX} "
                                f"tokens. However, your prompt is {num_prompt} tokens, which leaves no room "
                                "for a completion. Please reduce the length of the prompt.")
        return chunks

    assert run(main()) == []
    assert backend._stopping is None
    wait_idle(http)


def test_max_tokens_beyond_the_server_s_context_answers_until_it_is_full(backend, http):
    """A server refuses prompt + max_tokens beyond its context; the backend then asks without
    max_tokens, so a remote chat answers like a local one instead of failing."""
    messages = [{"role": "user", "content": "Reply with the single word: yes"}]
    too_much = GenerationSettings(temperature=0, top_p=1.0, max_tokens=SERVER_CTX)
    raw = http.post("/v1/chat/completions", json={"model": backend.model_name, "messages": messages,
                                                  "max_tokens": SERVER_CTX})
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "context_length_exceeded"
    expected = http.post("/v1/chat/completions", json={"model": backend.model_name, "messages": messages,
                                                       "temperature": 0}).json()

    async def main() -> list[Chunk]:
        return [chunk async for chunk in backend.stream(messages, too_much)]

    chunks = run(main())
    assert "".join(c.text for c in chunks) == expected["choices"][0]["message"]["content"]
    assert chunks[-1] == Chunk(finished=True, finish_reason="stop")
    wait_idle(http)


def test_the_model_picker_of_chat_endpoint_lists_the_server_s_models(live_server):
    from localllm.commands.chat import server_models

    model = live_server.model_path.stem
    assert server_models(live_server.base_url, live_server.api_key, "") == [(model, f"{model}   chat · loaded")]
    # The embedding model the server also serves is not offered for chat; a server that cannot
    # be asked leaves the current model alone.
    assert server_models("http://127.0.0.1:9/v1", None, "m") == [("m", "m")]
