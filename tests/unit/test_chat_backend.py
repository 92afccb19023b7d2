"""The chat backends' model-free parts: Figures with explicit clocks, GenerationSettings,
reserve_for, and the remote backend's SSE and HTTP-error parsing on real-looking wire text."""

from __future__ import annotations

import json
import math

import pytest

from localllm.errors import ContextOverflowError, EngineError, UsageError
from localllm.tui.backend import (Chunk, Figures, GenerationSettings, RemoteBackend, _http_error, _parse_event,
                                  reserve_for)

# -- Figures -------------------------------------------------------------------------------


def test_figures_of_a_streamed_answer():
    f = Figures(start=10.0)
    assert (f.ttft, f.tokens_per_s) == (None, None)
    f.observe(Chunk(prompt_tokens=40, cached_tokens=32), now=10.25)  # prompt figures, no token yet
    assert (f.first, f.ttft, f.num_tokens, f.prompt_tokens, f.cached_tokens) == (None, None, 0, 40, 32)
    f.observe(Chunk("Hel", 1), now=10.5)
    assert f.ttft == 0.5
    assert f.tokens_per_s is None  # one token gives no rate
    f.observe(Chunk("lo", 1), now=10.75)
    f.observe(Chunk(",", 1), now=11.0)
    f.observe(Chunk(" world", 1), now=11.5)
    assert f.num_tokens == 4
    assert f.tokens_per_s == 3.0  # 3 tokens after the first in 1.0 s
    f.observe(Chunk(finish_reason="stop"), now=11.6)  # a finish_reason before the end does not count
    assert f.finish_reason is None
    f.observe(Chunk(finished=True, finish_reason="stop"), now=12.0)
    assert f.last == 11.5  # a chunk without tokens does not move the rate's clock
    assert f.to_dict() == {"ttft": 0.5, "tokens_per_s": 3.0, "tokens": 4, "prompt_tokens": 40,
                           "cached_tokens": 32, "finish_reason": "stop", "draft_proposed": None,
                           "draft_accepted": None}
    assert json.loads(json.dumps(f.to_dict())) == f.to_dict()


def test_figures_count_every_token_of_a_chunk():
    f = Figures(start=0.0)
    f.observe(Chunk("ab", 2), now=1.0)
    f.observe(Chunk("cde", 3), now=2.0)
    assert (f.num_tokens, f.ttft, f.tokens_per_s) == (5, 1.0, 4.0)


def test_figures_of_an_answer_stopped_before_its_first_token():
    f = Figures(start=5.0)
    f.observe(Chunk(finished=True, finish_reason="abort", prompt_tokens=7, cached_tokens=0), now=5.5)
    assert f.to_dict() == {"ttft": None, "tokens_per_s": None, "tokens": 0, "prompt_tokens": 7,
                           "cached_tokens": 0, "finish_reason": "abort", "draft_proposed": None,
                           "draft_accepted": None}


def test_figures_take_the_draft_counts_of_the_last_chunk():
    f = Figures(start=0.0)
    f.observe(Chunk("a", 1), now=1.0)
    assert (f.num_draft_proposed, f.num_draft_accepted) == (None, None)  # not known while streaming
    f.observe(Chunk("bcd", 3, finished=True, finish_reason="stop", num_draft_proposed=430, num_draft_accepted=412),
              now=2.0)
    assert (f.num_tokens, f.num_draft_proposed, f.num_draft_accepted) == (4, 430, 412)
    assert (f.to_dict()["draft_proposed"], f.to_dict()["draft_accepted"]) == (430, 412)


def test_figures_later_prompt_figures_replace_earlier_ones():
    f = Figures(start=0.0)
    f.observe(Chunk(prompt_tokens=10, cached_tokens=None), now=0.1)
    f.observe(Chunk(prompt_tokens=12, cached_tokens=0), now=0.2)
    f.observe(Chunk(prompt_tokens=None, cached_tokens=None), now=0.3)
    assert (f.prompt_tokens, f.cached_tokens) == (12, 0)


def test_figures_no_rate_when_all_tokens_come_at_once():
    f = Figures(start=0.0)
    f.observe(Chunk("a", 1), now=1.0)
    f.observe(Chunk("b", 1), now=1.0)
    assert (f.num_tokens, f.ttft, f.tokens_per_s) == (2, 1.0, None)


# -- settings ------------------------------------------------------------------------------


def test_generation_settings_defaults_and_greedy():
    assert GenerationSettings() == GenerationSettings(temperature=0.8, top_p=0.95, max_tokens=2048)
    assert GenerationSettings(temperature=0, top_p=1.0, max_tokens=1).temperature == 0


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
])
def test_generation_settings_reject_bad_values(kwargs, name):
    with pytest.raises(UsageError, match=f"^{name}=.* is invalid"):
        GenerationSettings(**kwargs)


def test_reserve_for():
    assert reserve_for(GenerationSettings(max_tokens=2048), 2048) == 256  # an eighth of the context
    assert reserve_for(GenerationSettings(max_tokens=100), 2048) == 100  # never more than asked
    assert reserve_for(GenerationSettings(max_tokens=2048), 128) == 16  # at least 16
    assert reserve_for(GenerationSettings(max_tokens=8), 128) == 8
    assert reserve_for(GenerationSettings(max_tokens=4096), 32768) == 4096


# -- SSE events ----------------------------------------------------------------------------

ROLE = ('data: {"id":"chatcmpl-a1","object":"chat.completion.chunk","created":1717000000,"model":"qwen",'
        '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}')
CONTENT = ('data: {"id":"chatcmpl-a1","object":"chat.completion.chunk","created":1717000000,"model":"qwen",'
           '"choices":[{"index":0,"delta":{"content":" Paris"},"finish_reason":null}],"usage":null}')
FINISH = ('data: {"id":"chatcmpl-a1","object":"chat.completion.chunk","created":1717000000,"model":"qwen",'
          '"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}')
USAGE = ('data: {"id":"chatcmpl-a1","object":"chat.completion.chunk","created":1717000000,"model":"qwen",'
         '"system_fingerprint":null,"choices":[],"usage":{"prompt_tokens":37,"completion_tokens":5,'
         '"total_tokens":42,"prompt_tokens_details":{"cached_tokens":32}}}')


def test_parse_event_content_delta():
    assert _parse_event(CONTENT) == Chunk(text=" Paris", num_tokens=1)


def test_parse_event_role_only_delta_has_no_token():
    assert _parse_event(ROLE) == Chunk()


def test_parse_event_finish_reason():
    assert _parse_event(FINISH) == Chunk(finish_reason="length")
    assert _parse_event(FINISH).finished is False  # the stream's own last chunk says finished


def test_parse_event_usage():
    assert _parse_event(USAGE) == Chunk(prompt_tokens=37, cached_tokens=32)


def test_parse_event_usage_without_details():
    line = 'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}'
    assert _parse_event(line) == Chunk(prompt_tokens=9, cached_tokens=None)


def test_parse_event_without_a_space_after_data():
    assert _parse_event('data:{"choices":[{"index":0,"delta":{"content":"x"}}]}') == Chunk("x", 1)


@pytest.mark.parametrize("line", ["data: [DONE]", "data:[DONE]", "", ": keep-alive", "event: message",
                                  "id: 7", "retry: 1000", "data: {not json", "data: [1, 2]", "data: \"text\""])
def test_parse_event_ignores_what_is_not_a_chunk(line):
    assert _parse_event(line) is None


def test_parse_event_error_event_raises():
    line = 'data: {"error":{"message":"the engine shut down","type":"server_error","param":null,"code":null}}'
    with pytest.raises(EngineError, match="^the server ended the answer with an error: the engine shut down$"):
        _parse_event(line)


def test_parse_event_error_event_as_text_raises():
    with pytest.raises(EngineError, match="error: out of memory$"):
        _parse_event('data: {"error":"out of memory"}')


# -- HTTP errors ---------------------------------------------------------------------------


def body(**error) -> bytes:
    return json.dumps({"error": error}).encode()


def test_http_error_context_length_exceeded():
    message = ("This model's maximum context length is 4096 tokens. However, you requested 6000 tokens "
               "(5000 in the prompt, 1000 for the completion). Please reduce the length of the prompt or "
               "the completion.")
    e = _http_error(400, body(message=message, type="invalid_request_error", param="messages",
                              code="context_length_exceeded"))
    assert type(e) is ContextOverflowError
    assert str(e) == f"the server says: {message}"


def test_http_error_llama_server_context_error():
    e = _http_error(400, body(code=400, message="the request exceeds the available context size, try increasing it",
                              type="exceed_context_size_error"))
    assert type(e) is ContextOverflowError
    assert str(e) == "the server says: the request exceeds the available context size, try increasing it"


@pytest.mark.parametrize("status", [401, 403])
def test_http_error_refused_key_names_the_option(status):
    e = _http_error(status, body(message="Incorrect or missing API key", type="invalid_request_error",
                                 param=None, code="invalid_api_key"))
    assert type(e) is EngineError
    assert str(e) == f"the server refused the API key (HTTP {status}); pass it with --api-key"


def test_http_error_other_statuses_keep_the_server_s_message():
    e = _http_error(404, body(message="The model 'x' does not exist", type="invalid_request_error",
                              param="model", code="model_not_found"))
    assert type(e) is EngineError
    assert str(e) == "the server answered HTTP 404: The model 'x' does not exist"


def test_http_error_a_400_about_something_else_is_not_an_overflow():
    e = _http_error(400, body(message="invalid value for 'top_p': must be at most 1", code="invalid_value"))
    assert type(e) is EngineError
    assert str(e) == "the server answered HTTP 400: invalid value for 'top_p': must be at most 1"


def test_http_error_body_that_is_not_json():
    e = _http_error(502, b"<html>Bad Gateway</html>")
    assert type(e) is EngineError
    assert str(e) == "the server answered HTTP 502: <html>Bad Gateway</html>"


def test_http_error_other_error_shapes():
    ollama = _http_error(404, b'{"error":"model \\"llama3\\" not found, try pulling it first"}')
    assert str(ollama) == 'the server answered HTTP 404: model "llama3" not found, try pulling it first'
    vllm = _http_error(400, json.dumps({
        "object": "error", "type": "BadRequestError", "param": None, "code": 400,
        "message": "This model's maximum context length is 2048 tokens. However, you requested 3000 tokens."}).encode())
    assert type(vllm) is ContextOverflowError
    assert str(vllm) == ("the server says: This model's maximum context length is 2048 tokens. "
                         "However, you requested 3000 tokens.")


# -- RemoteBackend without a server ----------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["localhost:8000", "127.0.0.1:8000/v1", "ftp://host/v1", ""])
def test_remote_backend_rejects_an_endpoint_that_is_not_http(endpoint):
    with pytest.raises(UsageError, match=r"^--endpoint .* is not an http\(s\) URL; give one like "
                                         r"http://127\.0\.0\.1:8000/v1$"):
        RemoteBackend(endpoint)


@pytest.mark.parametrize("endpoint, base_url", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1"),
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
    ("https://example.com/v1/", "https://example.com/v1"),
])
def test_remote_backend_base_url(endpoint, base_url):
    backend = RemoteBackend(endpoint)
    assert (backend.base_url, backend.model_name, backend.n_ctx) == (base_url, "", None)
    assert backend.count_tokens([{"role": "user", "content": "hi"}]) is None


def test_remote_backend_stop_with_nothing_streaming_does_nothing():
    RemoteBackend("http://127.0.0.1:9").stop()
