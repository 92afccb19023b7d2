"""parse_tool_calls on Qwen2.5 / Hermes-style <tool_call> blocks."""

from __future__ import annotations

from localllm.tools import parse_tool_calls


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_several_blocks_in_order_and_the_rest_is_content():
    text = ("Let me look both up.\n"
            + block('{"name": "get_weather", "arguments": {"city": "Paris"}}') + "\n"
            + block('{"name": "get_time", "arguments": {"tz": "Europe/Paris", "h24": true}}'))
    content, calls = parse_tool_calls(text)
    assert content == "Let me look both up."
    assert calls == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "get_time", "arguments": '{"tz": "Europe/Paris", "h24": true}'},
    ]


def test_arguments_object_is_reserialised_as_json_text():
    content, calls = parse_tool_calls(block('{"name":"f","arguments":{"city":"Zürich","n":[1,2]}}'))
    assert content == ""
    assert calls == [{"name": "f", "arguments": '{"city": "Zürich", "n": [1, 2]}'}]
    assert isinstance(calls[0]["arguments"], str)


def test_arguments_given_as_json_text_are_kept_and_missing_ones_are_empty():
    _, calls = parse_tool_calls(block('{"name": "f", "arguments": "{\\"a\\": 1}"}') + block('{"name": "g"}'))
    assert calls == [{"name": "f", "arguments": '{"a": 1}'}, {"name": "g", "arguments": "{}"}]


def test_malformed_blocks_stay_in_the_content():
    bad_json = block('{"name": "f", "arguments": {"city": "Paris"')
    no_name = block('{"arguments": {}}')
    not_object = block('["f"]')
    bad_text_arguments = block('{"name": "f", "arguments": "not json"}')
    good = block('{"name": "ok", "arguments": {}}')
    text = f"A {bad_json} B {no_name} {not_object} {bad_text_arguments} {good}"
    content, calls = parse_tool_calls(text)
    assert calls == [{"name": "ok", "arguments": "{}"}]
    assert content == f"A {bad_json} B {no_name} {not_object} {bad_text_arguments}"


def test_unclosed_block_and_no_tool_calls_leave_the_text_unchanged():
    for text in ["  Just an answer.\n", "", '<tool_call>\n{"name": "f", "arguments": {}}']:
        assert parse_tool_calls(text) == (text, [])
