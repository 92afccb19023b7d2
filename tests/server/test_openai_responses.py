"""OpenAI's Responses API through a real `localllm serve` process, driven by the official openai
SDK's `responses` unchanged (raw httpx where the wire is the point), on Qwen2.5-Coder-0.5B."""

from __future__ import annotations

import json

import openai
import pytest
from test_prefix_cache_restart import start, stop

pytestmark = pytest.mark.model

FRANCE = "What is the capital of France? Answer in one word."
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": True}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}






def test_create_answers_and_is_kept(client, served_model):
    r = client.responses.create(model=served_model, input=FRANCE, instructions="You are terse.", temperature=0,
                                max_output_tokens=16)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert "Paris" in r.output_text
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.usage.input_tokens > 10 and 1 <= r.usage.output_tokens <= 16
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    kept = client.responses.retrieve(r.id)
    assert kept.id == r.id and kept.output_text == r.output_text and kept.instructions == "You are terse."
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_stream_gives_the_same_answer_in_response_events(client, served_model):
    plain = client.responses.create(model=served_model, input=FRANCE, temperature=0, max_output_tokens=24, store=False)
    events = list(client.responses.create(model=served_model, input=FRANCE, temperature=0, max_output_tokens=24,
                                          stream=True, store=False))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    # The SDK's own stream helper assembles the same response.
    with client.responses.stream(model=served_model, input=FRANCE, temperature=0, max_output_tokens=24,
                                 store=False) as stream:
        assert stream.get_final_response().output_text == plain.output_text


def test_function_call_round_trip_by_previous_response_id(client, served_model):
    first = client.responses.create(model=served_model, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", temperature=0, max_output_tokens=60)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    answer = client.responses.create(
        model=served_model, previous_response_id=first.id, tools=[WEATHER], temperature=0, max_output_tokens=60,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"temp_c": 21, "sky": "sunny"})}])
    assert answer.previous_response_id == first.id
    assert "21" in answer.output_text or "sunny" in answer.output_text.lower(), answer.output_text


def test_streamed_function_call(client, served_model):
    events = list(client.responses.create(model=served_model, input="Weather in Oslo?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                          max_output_tokens=60, stream=True, store=False))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments and isinstance(json.loads(done.arguments)["city"], str)
    [call] = events[-1].response.output
    assert call.type == "function_call" and call.arguments == done.arguments


def test_json_schema_output_validates(client, served_model):
    r = client.responses.create(model=served_model, input="Invent a person.", temperature=0, max_output_tokens=80,
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    value = json.loads(r.output_text)
    assert set(value) == {"name", "age"} and type(value["age"]) is int


def test_max_output_tokens_makes_it_incomplete(client, served_model):
    r = client.responses.create(model=served_model, input="Count from 1 to 20, one per line.", temperature=0,
                                max_output_tokens=3, store=False)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_bad_input_is_an_openai_4xx(client, keyed_http, served_model):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=served_model, input="hi", previous_response_id="resp_nope")
    assert e.value.code == "previous_response_not_found"
    bad = {
        "function_call_output for no call": {"input": [{"type": "function_call_output", "call_id": "call_x",
                                                        "output": "21"}]},
        "image": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
        "function tool without a name": {"input": "hi", "tools": [{"type": "function", "parameters": {}}]},
        "unknown item": {"input": [{"type": "computer_call", "id": "x"}]},
        "wrong type": {"input": 5},
        "unknown field": {"input": "hi", "frobnicate": True},
        "schema missing": {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
        "over the context": {"input": "hi", "max_output_tokens": 5000},
    }
    for what, body in bad.items():
        response = keyed_http.post("/v1/responses", json={"model": served_model} | body)
        assert response.status_code == 400, (what, response.text)
        assert set(response.json()) == {"error"} and set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert keyed_http.get("/v1/responses/resp_nope").status_code == 404
    assert keyed_http.delete("/v1/responses/resp_nope").status_code == 404
    assert keyed_http.get("/health").json()["status"] == "ok"


def test_previous_response_id_survives_a_restart(qwen_path, tmp_path):
    home, log_path = tmp_path / "home", tmp_path / "serve.log"
    server = start(qwen_path, home, log_path)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        first = client.responses.create(model=qwen_path.stem, temperature=0, max_output_tokens=16,
                                        input="My name is Ada Lovelace. Reply with OK.")
    finally:
        stop(server)
    server = start(qwen_path, home, log_path)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        follow = client.responses.create(model=qwen_path.stem, temperature=0, max_output_tokens=16,
                                         previous_response_id=first.id, input="What is my name?")
    finally:
        stop(server)
    assert "Ada" in follow.output_text, follow.output_text
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_an_openai_agents_loop_calls_a_function_tool_and_answers(live_server, served_model):
    """A real agent framework (openai-agents, over /v1/responses) runs its loop: the model calls
    the tool, the framework runs it and sends the output back, the model answers."""
    agents = pytest.importorskip("agents")
    calls = []

    # Offered until called once: with the tool still offered, the 0.5B model answers the tool's
    # result with another call-shaped text instead of words (the protocol is not the matter).
    @agents.function_tool(is_enabled=lambda ctx, agent: not calls)
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return "21 degrees Celsius and sunny"

    client = openai.AsyncOpenAI(base_url=live_server.base_url, api_key=live_server.api_key, max_retries=0,
                                timeout=120)
    agent = agents.Agent(
        name="weather", instructions="Call get_weather once; then tell the user the weather in one sentence.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=served_model, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=80, tool_choice="required"))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4,
                                    run_config=agents.RunConfig(tracing_disabled=True))
    assert len(calls) == 1 and "Paris" in calls[0]
    assert "21" in result.final_output or "sunny" in result.final_output.lower(), result.final_output


def test_a_request_shaped_as_codex_sends_it(keyed_http, served_model):
    """Codex (0.171) sends developer messages, function tools grouped in a namespace, a hosted
    web_search tool (not offered: nothing here runs it), and fields of its own; all are taken."""
    body = {"model": served_model, "stream": True, "store": False, "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "s1",
            "client_metadata": {"session_id": "s1"}, "max_output_tokens": 16,
            "input": [{"type": "message", "role": "developer",
                       "content": [{"type": "input_text", "text": "You are a coding agent."}]},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "Reply with the single word: pong"}]}],
            "tools": [WEATHER, {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
                                "tools": [WEATHER | {"name": "close_agent"}]},
                      {"type": "web_search", "external_web_access": False}]}
    with keyed_http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    assert [t["type"] for t in events[-1]["response"]["tools"]] == ["function", "namespace", "web_search"]
