"""Structured output, tool calls and fill-in-the-middle through the real server and the
official openai client."""

from __future__ import annotations

import json
import re

import openai
import pytest

# name is bounded so that a whole object always fits in the tests' 80 tokens (unbounded, a
# sampled name once ran on for 450 characters and the answer stopped at the length limit).
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url, api_key="sk-test", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_validates(client, model_id, seed):
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Invent a person."}], seed=seed, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"name", "age"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 40 and type(value["age"]) is int
    assert r.choices[0].finish_reason == "stop"


def test_json_object_output_parses(client, model_id):
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Describe a cat as JSON."}], temperature=0,
        max_tokens=80, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_tool_call_round_trip(client, model_id):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=model_id, messages=messages, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21, "sky": "sunny"})})
    r = client.chat.completions.create(model=model_id, messages=messages, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=60)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens > 60  # the call and its result were rendered into the prompt


def test_streamed_tool_call(client, model_id):
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=60,
        stream=True)
    chunks = list(stream)
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments)["city"] == "Oslo"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]


PYTHON_TOOL = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]


def test_call_written_without_tags_is_a_tool_call(client, model_id):
    """Unconstrained, the 0.5B coder writes its call as a fenced ```json block or a bare object,
    not in <tool_call> tags (tests/data/tool_answers.json): still a call, whole or streamed,
    and never content."""
    ask = dict(model=model_id, messages=[{"role": "user", "content": "Say hello world with python."}],
               tools=PYTHON_TOOL, temperature=0, max_tokens=60)
    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "python" and call.id.startswith("call")
    assert "print(" in json.loads(call.function.arguments)["code"]

    chunks = [ch for ch in client.chat.completions.create(**ask, stream=True) if ch.choices]
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "function", "python", call.function.arguments)]
    assert deltas[0].id.startswith("call")
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["tool_calls"]


def test_regex_and_lark_grammar_shape_the_answer(client, model_id):
    """localllm's regex and llama-server's grammar (Lark here; GBNF in test_llama_server_compat)."""
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "When was the Eiffel tower built?"}], seed=seed,
            max_tokens=30, extra_body={"regex": r"Built in (1[0-9]{3}|20[0-2][0-9])\."})
        assert re.fullmatch(r"Built in (1[0-9]{3}|20[0-2][0-9])\.", r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=model_id, prompt="Paris is in", max_tokens=20, temperature=0,
                                  extra_body={"grammar": 'start: " " COUNTRY "."\nCOUNTRY: /[A-Z][a-z]+/'})
    assert re.fullmatch(r" [A-Z][a-z]+\.", r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("schema, message", [
    ({"type": "strnig"}, "Invalid type: strnig"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength (5) is greater than maxLength (2)"),
    ({"type": "array", "uniqueItems": True}, '"uniqueItems", which localllm cannot enforce'),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
])
def test_schemas_it_cannot_follow_are_a_400_and_the_server_stays_well(client, model_id, live_server, schema, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format"
    assert message in e.value.body["message"], e.value.body["message"]
    assert "Traceback" not in live_server.log() and " 500 " not in live_server.log()


def test_unknown_tool_choice_is_400(client, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.status_code == 400 and "nope" in e.value.body["message"]


def test_fill_in_the_middle(client, model_id):
    r = client.completions.create(model=model_id, prompt="def add(a, b):\n    return ",
                                  suffix="\n\nprint(add(1, 2))\n", temperature=0, max_tokens=16)
    assert r.choices[0].text.replace(" ", "").startswith("a+b")


def test_chat_top_logprobs(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Say hello."}],
                                       temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_completion_top_logprobs(client, model_id):
    r = client.completions.create(model=model_id, prompt="def add(a, b):", temperature=0, max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 4
    assert all(len(step) <= 2 and lp.tokens[i] in step for i, step in enumerate(lp.top_logprobs))
