"""Anthropic's Messages API through a real `localllm serve` process, driven by the official
`anthropic` SDK unchanged (raw httpx where the wire itself is the point), on Qwen2.5-Coder-0.5B."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

pytestmark = pytest.mark.model

GREEDY = {"temperature": 0}  # the SDK (2.16) has no temperature argument; Claude Code and older SDKs send it
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(live_server) -> anthropic.Anthropic:
    with anthropic.Anthropic(base_url=live_server.url, api_key=live_server.api_key, max_retries=0,
                             timeout=120) as c:
        yield c




@pytest.fixture(scope="module")
def http(live_server) -> httpx.Client:
    with httpx.Client(base_url=live_server.url, headers={"x-api-key": live_server.api_key}, timeout=120) as c:
        yield c


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    """The message of an Anthropic error object, after checking the status and the shape."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert body["error"]["message"]
    return body["error"]["message"]


def test_create_answers_with_a_text_block_and_usage(client, served_model):
    message = client.messages.create(model=served_model, max_tokens=16, extra_body=GREEDY, messages=FRANCE,
                                      system=[{"type": "text", "text": "You are terse."}],
                                      metadata={"user_id": "tester"})
    assert message.type == "message" and message.role == "assistant" and message.model == served_model
    assert message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and "Paris" in block.text
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    count = client.messages.count_tokens(model=served_model, messages=FRANCE,
                                         system=[{"type": "text", "text": "You are terse."}])
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == count.input_tokens > 10
    assert 1 <= message.usage.output_tokens <= 16


def test_stream_gives_the_same_answer_in_anthropic_events(client, http, served_model):
    plain = client.messages.create(model=served_model, max_tokens=24, extra_body=GREEDY, messages=FRANCE)
    with client.messages.stream(model=served_model, max_tokens=24, extra_body=GREEDY, messages=FRANCE) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) >= 1 and "".join(pieces) == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason == "end_turn"
    assert final.usage.output_tokens == plain.usage.output_tokens

    # The wire: every event named, in Anthropic's order.
    body = {"model": served_model, "max_tokens": 24, "temperature": 0, "messages": FRANCE, "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line[len("event: "):] for line in lines[0::2]]
    payloads = [json.loads(line[len("data: "):]) for line in lines[1::2]]
    assert [p["type"] for p in payloads] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert payloads[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert "".join(p["delta"]["text"] for p in payloads[3:-3]) == plain.content[0].text


def test_tool_round_trip(client, served_model):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=served_model, max_tokens=60, extra_body=GREEDY, messages=messages,
                                   tools=[WEATHER_TOOL], tool_choice={"type": "any"})
    assert first.stop_reason == "tool_use"
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input, dict) and isinstance(call.input.get("city"), str)

    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": json.dumps({"temp_c": 21, "sky": "sunny"})}]}]
    answer = client.messages.create(model=served_model, max_tokens=60, extra_body=GREEDY, messages=messages,
                                    tools=[WEATHER_TOOL])
    # The 0.5B model calls get_weather again before it echoes the result: a whole call object
    # in the answer, which is a tool_use block here as it is in llama-server.
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert "21" in text or "sunny" in text.lower(), text


def test_streamed_tool_use_arrives_as_input_json(client, served_model):
    with client.messages.stream(model=served_model, max_tokens=60, extra_body=GREEDY, tools=[WEATHER_TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Oslo?"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    [call] = [b for b in final.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input["city"], str)


def test_output_config_format_holds_the_answer_to_its_schema(http, served_model):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    r = http.post("/v1/messages", json={
        "model": served_model, "max_tokens": 60, "temperature": 0.7, "messages": FRANCE,
        "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert r.status_code == 200, r.text
    body = r.json()
    value = json.loads(body["content"][0]["text"])
    assert set(value) == {"city", "population"} and type(value["population"]) is int and value["population"] >= 0
    assert body["stop_reason"] == "end_turn"


def test_max_tokens_and_stop_sequences_end_the_answer(client, served_model):
    cut = client.messages.create(model=served_model, max_tokens=3, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": "Count from 1 to 20, one per line."}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    stopped = client.messages.create(model=served_model, max_tokens=60, extra_body=GREEDY, stop_sequences=["5"],
                                     messages=[{"role": "user", "content": "Count from 1 to 20, one per line."}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "5"
    assert "5" not in stopped.content[0].text and "4" in stopped.content[0].text


def test_errors_are_anthropic_errors(client, http, served_model, live_server):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=FRANCE)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=live_server.url, api_key="sk-wrong", max_retries=0).messages.create(
            model=served_model, max_tokens=4, messages=FRANCE)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=served_model, max_tokens=0, messages=FRANCE)
    assert e.value.body["error"]["type"] == "invalid_request_error"

    bad = {
        "max_tokens": {"messages": FRANCE},  # missing: Anthropic requires it
        "unknown block": {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
        "image": {"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]}]},
        "tool_result for no tool_use": {"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "21"}]}]},
        "tool_use from the user": {"messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]},
        "wrong type": {"messages": FRANCE, "temperature": "hot"},
        "temperature over 1": {"messages": FRANCE, "temperature": 1.5},
        "unknown field": {"messages": FRANCE, "frobnicate": True},
        "no messages": {"messages": []},
        "named tool without a name": {"messages": FRANCE, "tools": [WEATHER_TOOL], "tool_choice": {"type": "tool"}},
        "tool schema it cannot enforce": {"messages": FRANCE, "tool_choice": {"type": "any"}, "tools": [
            WEATHER_TOOL | {"input_schema": {"type": "object", "properties": {"days": {
                "type": "array", "uniqueItems": True}}}}]},
        "unsatisfiable output schema": {"messages": FRANCE, "output_config": {"format": {
            "type": "json_schema", "schema": {"type": "string", "minLength": 5, "maxLength": 2}}}},
    }
    for what, body in bad.items():
        body = {"model": served_model, "max_tokens": 8} | body
        if what == "max_tokens":
            body.pop("max_tokens")
        message = anthropic_error(http.post("/v1/messages", json=body), 400, "invalid_request_error")
        if what == "max_tokens":
            assert "max_tokens" in message
        if what == "image":
            assert "text only" in message
        if what == "tool_result for no tool_use":
            assert "toolu_nope" in message
        if what == "tool schema it cannot enforce":
            assert '"uniqueItems", which localllm cannot enforce' in message
        if what == "unsatisfiable output schema":
            assert "minLength (5) is greater than maxLength (2)" in message
    anthropic_error(http.post("/v1/messages", content=b"{not json"), 400, "invalid_request_error")
    anthropic_error(http.post("/v1/messages/count_tokens", json={"model": served_model}), 400, "invalid_request_error")
    anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")
    long = [{"role": "user", "content": "hello " * 5000}]
    message = anthropic_error(http.post("/v1/messages", json={"model": served_model, "max_tokens": 8, "messages": long}),
                              400, "invalid_request_error")
    assert "maximum context length is 4096 tokens" in message
    # Still healthy, and the OpenAI door still answers in OpenAI's shape.
    assert http.get("/health").json()["status"] == "ok"
    assert set(http.post("/v1/chat/completions", json={}).json()) == {"error"}


def test_a_request_shaped_as_claude_code_sends_it(http, served_model):
    """Claude Code (2.1) sends a system message in the middle of the conversation, asks 32,000
    tokens of any model, and adds fields of its own: all are taken; the answer's length is
    capped by the context (4,096 here), as Ollama caps it."""
    body = {"model": served_model, "max_tokens": 32000, "stream": True, "temperature": 0,
            "system": [{"type": "text", "text": "You are a CLI assistant.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [
                             {"type": "text", "text": "<system-reminder>Today is 2026-12-03.</system-reminder>"},
                             {"type": "text", "text": "Reply with the single word: pong",
                              "cache_control": {"type": "ephemeral"}}]},
                         {"role": "system", "content": "Available agent types: none."}],
            "tools": [WEATHER_TOOL | {"cache_control": {"type": "ephemeral"}, "eager_input_streaming": True}],
            "metadata": {"user_id": '{"device_id":"d","session_id":"s"}'}, "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"}}
    with http.stream("POST", "/v1/messages?beta=true", json=body,
                     headers={"anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07"}) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "tool_use", "max_tokens")
    count = http.post("/v1/messages/count_tokens", json={k: body[k] for k in (
        "model", "system", "messages", "tools", "thinking", "context_management", "output_config")}).json()
    assert count["input_tokens"] > 40
