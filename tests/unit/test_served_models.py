"""server/models.py and server/upstream.py below the model line: which entry a request's model
and door reach, the manager's errors as each door's APIError, and the upstreams' configuration. The manager loads stand-ins here; tests/server/test_models_served.py
runs the real models behind a real `localllm serve`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from localllm.errors import ModelBusy, UsageError
from localllm.manager import ModelEntry, ModelManager
from localllm.server.errors import APIError
from localllm.server.models import LoadedModel, ServedModels
from localllm.server.upstream import Upstream, load_upstreams, parse_upstream

ENTRIES = [ModelEntry("qwen", Path("/m/qwen-q4.gguf")), ModelEntry("base", Path("/m/base.gguf"), kind="completion"),
           ModelEntry("minilm", Path("/m/minilm.gguf"), kind="embedding")]


def served(load=None, need=lambda e: 1, free=lambda: None, upstreams=(), **kw) -> ServedModels:
    manager = ModelManager(ENTRIES, load or (lambda e: LoadedModel(e, owned=False)), need, free, **kw)
    return ServedModels(manager, upstreams=upstreams)


def error(fn) -> APIError:
    with pytest.raises(APIError) as e:
        fn()
    return e.value


def test_a_request_reaches_its_model_by_any_name_and_the_door_s_default_without_one():
    models = served()
    assert models.entry("qwen", "text").name == "qwen"
    assert models.entry("qwen-q4.gguf", "text").name == "qwen"  # the file's name, as llama-server's clients send
    assert models.entry("base", "text").name == "base"
    assert models.entry(None, "text").name == "qwen"
    base_first = ServedModels(ModelManager(ENTRIES[1::-1], lambda e: None, lambda e: 1, lambda: None))
    assert base_first.entry(None, "text").name == "qwen"  # a chat model before a base model listed first
    assert models.entry(None, "embedding").name == "minilm"


def test_a_model_of_the_wrong_kind_or_no_model_is_a_4xx_that_names_what_to_ask():
    models = served()
    e = error(lambda: models.entry("qwen", "embedding"))
    assert (e.status, e.code, e.param) == (400, "model_not_embedding", "model")
    assert "this server embeds with 'minilm'" in e.message
    e = error(lambda: models.entry("minilm", "text"))
    assert (e.status, e.code) == (400, "model_not_chat") and "qwen, base" in e.message
    e = error(lambda: models.entry("llama3:70b", "text"))
    assert (e.status, e.code) == (404, "model_not_found")
    assert e.message.startswith("The model 'llama3:70b' does not exist; this server serves 'qwen', 'base', 'minilm'")
    only_chat = ServedModels(ModelManager(ENTRIES[:1], lambda e: None, lambda e: 1, lambda: None))
    e = error(lambda: only_chat.entry(None, "embedding"))
    assert e.status == 404 and "serves no embeddings" in e.message and "--" not in e.message


def test_the_manager_s_errors_come_out_in_the_door_s_terms():
    async def lease(models, name="qwen", keep_alive=None):
        async with models.lease(name, keep_alive):
            pass

    def status(models, **kw) -> APIError:
        return error(lambda: asyncio.run(lease(models, **kw)))

    e = status(served(need=lambda e: 10, free=lambda: 5))
    assert (e.status, e.code, e.param) == (400, "model_too_large", "model") and "does not fit" in e.message
    e = status(served(), keep_alive="soon")
    assert (e.status, e.param) == (400, "keep_alive") and "is not a duration" in e.message

    def broken(entry):
        raise OSError("disk gone")
    e = status(served(load=broken))
    assert (e.status, e.code) == (500, "model_load_failed") and "disk gone" in e.message

    def busy(entry):
        raise ModelBusy("qwen holds it")
    e = status(served(load=busy))
    assert (e.status, e.code, e.headers) == (503, "server_busy", {"Retry-After": "5"})


def test_a_lease_handed_to_a_streamed_response_lasts_until_it_is_sent():
    from fastapi.responses import StreamingResponse

    models = served()

    async def main():
        async def body():
            yield b"x"

        async with models.lease("qwen") as lease:
            response = lease.hand_over(StreamingResponse(body()))
        during = models.manager.status()[0].in_flight
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return during, models.manager.status()[0].in_flight, sent

    during, after, sent = asyncio.run(main())
    assert (during, after) == (1, 0)
    assert sent[0]["type"] == "http.response.start" and sent[1]["body"] == b"x"


def test_upstreams_from_the_command_line_and_the_config_file(tmp_path, monkeypatch):
    assert parse_upstream("big=http://gpu:8000/v1/") == Upstream("big", "http://gpu:8000/v1", "big")
    assert parse_upstream("big=http://gpu:8000/v1#Qwen/Qwen2.5-72B").model == "Qwen/Qwen2.5-72B"
    for bad in ("big", "=http://x", "big=gpu:8000", "big=ftp://x"):
        with pytest.raises(UsageError, match="is not NAME=URL"):
            parse_upstream(bad)
    path = tmp_path / "upstreams.toml"
    assert load_upstreams(path) == []
    path.write_text('[big]\nurl = "http://gpu:8000/v1"\nmodel = "m"\napi_key_env = "GPU_KEY"\n')
    monkeypatch.delenv("GPU_KEY", raising=False)
    with pytest.raises(UsageError, match=r"takes its key from \$GPU_KEY, which is not set"):
        load_upstreams(path)
    monkeypatch.setenv("GPU_KEY", "s3cret")
    assert load_upstreams(path) == [Upstream("big", "http://gpu:8000/v1", "m", "s3cret")]
    path.write_text("[big\n")
    with pytest.raises(UsageError, match="cannot be read"):
        load_upstreams(path)
    path.write_text('[big]\nport = 8000\n')
    with pytest.raises(UsageError, match=r"\[big\] needs url"):
        load_upstreams(path)


def test_an_upstream_is_not_leased_through_a_door_that_does_not_forward():
    models = served(upstreams=[Upstream("big", "http://gpu:8000/v1", "big")])
    assert models.upstream("big").url == "http://gpu:8000/v1" and models.upstream("qwen") is None
    e = error(lambda: models.entry("big", "text"))
    assert (e.status, e.code) == (400, "model_is_upstream") and "/v1/chat/completions" in e.message
    with pytest.raises(UsageError, match="has the name of an installed model"):
        served(upstreams=[Upstream("qwen", "http://gpu:8000/v1", "qwen")])
