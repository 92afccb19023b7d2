"""Tool calls in answers, by template family: the real answers of the test models
(tests/data/tool_answers.json, written by scripts/collect_tool_answers.py, expectations by
llama.cpp's parsers) whole and cut into stream chunks at every place, and the edge cases."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from localllm.tool_calls import Call, ToolCallParser, family_for, parse_tool_calls

DATA = Path(__file__).resolve().parents[1] / "data"
ANSWERS = json.loads((DATA / "tool_answers.json").read_text())
TOOLS = {"python", "get_weather", "search", "get_time"}


def streamed(text: str, cuts: list[int], names, family: str) -> tuple[str, list[Call]]:
    parser = ToolCallParser(names, family)
    content, calls = "", []
    for start, end in zip([0] + cuts, cuts + [len(text)]):
        piece, new = parser.feed(text[start:end])
        content, calls = content + piece, calls + new
    piece, new = parser.finish()
    return content + piece, calls + new


def plain(calls: list[Call]) -> list[dict]:
    return [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]


def test_the_table_holds_real_answers_of_both_models_calls_and_plain():
    by_model = {}
    for e in ANSWERS:
        by_model.setdefault(e["model"], []).append(bool(e["expected"]["calls"]))
    assert set(by_model) == {"qwen2.5-coder-0.5b", "gemma3-270m"}
    assert all(len(kinds) >= 16 for kinds in by_model.values())
    assert sum(len(kinds) for kinds in by_model.values()) >= 30
    assert any(by_model["qwen2.5-coder-0.5b"]) and not all(by_model["qwen2.5-coder-0.5b"])


def entry_id(entry: dict) -> str:
    return f"{ANSWERS.index(entry)}-{entry['model']}-t{entry['sampling']['temperature']}"


@pytest.mark.parametrize("entry", ANSWERS, ids=entry_id)
def test_real_answer_parses_to_the_expected_calls_and_content(entry):
    content, calls = parse_tool_calls(entry["answer"], entry["tools"], entry["family"])
    assert plain(calls) == entry["expected"]["calls"]
    assert content == entry["expected"]["content"]


@pytest.mark.parametrize("entry", ANSWERS, ids=entry_id)
def test_real_answer_streamed_in_any_cut_gives_the_same(entry):
    text, names, family = entry["answer"], entry["tools"], entry["family"]
    whole = parse_tool_calls(text, names, family)
    for cut in range(1, len(text)):
        assert streamed(text, [cut], names, family) == whole, cut
    assert streamed(text, list(range(1, len(text))), names, family) == whole


def test_content_goes_out_at_once_and_only_a_possible_call_is_held():
    parser = ToolCallParser({"python"}, "hermes")
    assert parser.feed("Sure, here") == ("Sure, here", [])
    assert parser.feed(" it is: <") == (" it is: ", [])
    assert parser.feed("b>bold</b> ") == ("<b>bold</b> ", [])
    assert parser.feed("{") == ("", [])
    assert parser.feed('"name": "pyt') == ("", [])
    assert parser.feed('hon", "arguments": {"code": "1"}}') == ("", [Call("python", '{"code": "1"}')])
    assert parser.feed("\n\nDone.") == ("Done.", [])
    assert parser.finish() == ("", [])


def test_plain_json_is_let_go_as_soon_as_its_first_key_or_name_says_so():
    parser = ToolCallParser({"python"}, "hermes")
    assert parser.feed('{"na') == ("", [])
    assert parser.feed('me": "John", "age": 3') == ('{"name": "John", "age": 3', [])
    parser = ToolCallParser({"python"}, "hermes")
    assert parser.feed('{"city": ') == ('{"city": ', [])


# -- Hermes (Qwen) --------------------------------------------------------------------------


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_several_tagged_calls_in_order_and_the_text_before_them_is_content():
    text = ("Let me look both up.\n"
            + block('{"name": "get_weather", "arguments": {"city": "Paris"}}') + "\n"
            + block('{"name": "get_time", "arguments": {"tz": "Europe/Paris", "h24": true}}'))
    assert parse_tool_calls(text, TOOLS, "hermes") == ("Let me look both up.\n", [
        Call("get_weather", '{"city": "Paris"}'), Call("get_time", '{"tz": "Europe/Paris", "h24": true}')])


def test_unclosed_tag_at_the_end_is_a_call():
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    assert parse_tool_calls(text, TOOLS, "hermes") == ("Checking.\n", [Call("get_weather", '{"city": "Oslo"}')])


def test_fenced_block_bare_object_and_array_of_calls():
    fenced = '```json\n{"name": "python", "arguments": {"code": "print(1)"}}\n```'
    assert parse_tool_calls(fenced, TOOLS, "hermes") == ("", [Call("python", '{"code": "print(1)"}')])
    bare = 'I will run it: {"name": "python", "arguments": {"code": "x"}} and tell you.'
    assert parse_tool_calls(bare, TOOLS, "hermes") == ("I will run it: and tell you.",
                                                        [Call("python", '{"code": "x"}')])
    array = ('```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
             ' {"name": "get_weather", "arguments": {"city": "Tokyo"}}]\n```\nBoth asked.')
    assert parse_tool_calls(array, TOOLS, "hermes") == ("Both asked.", [
        Call("get_weather", '{"city": "Paris"}'), Call("get_weather", '{"city": "Tokyo"}')])


def test_several_objects_in_one_tag_or_fence():
    text = ('<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n'
            '{"name": "search", "arguments": {"query": "b"}}\n</tool_call>')
    assert parse_tool_calls(text, TOOLS, "hermes") == ("", [Call("search", '{"query": "a"}'),
                                                            Call("search", '{"query": "b"}')])


def test_function_tags_and_the_other_hermes_tags():
    text = '<function=python>{"code": "print(2)"}</function> then <function name="search">{"query": "q"}</function>'
    assert parse_tool_calls(text, TOOLS, "hermes") == ("then ", [Call("python", '{"code": "print(2)"}'),
                                                                 Call("search", '{"query": "q"}')])
    text = '<function_call>{"name": "search", "arguments": {"query": "q"}}</function_call>'
    assert parse_tool_calls(text, TOOLS, "hermes") == ("", [Call("search", '{"query": "q"}')])


def test_arguments_as_json_text_are_kept_and_missing_ones_are_empty():
    text = block('{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}') + block('{"name": "get_time"}')
    assert parse_tool_calls(text, TOOLS, "hermes") == ("", [Call("python", '{"code": "1"}'),
                                                            Call("get_time", "{}")])
    _, calls = parse_tool_calls(block('{"name":"get_weather","parameters":{"city":"Zürich","n":[1,2]}}'),
                                TOOLS, "hermes")
    assert calls == [Call("get_weather", '{"city": "Zürich", "n": [1, 2]}')]


def test_what_is_not_a_call_stays_content_as_written():
    bad_json = block('{"name": "python", "arguments": {"code": "x"')
    unknown = block('{"name": "rm_rf", "arguments": {}}')
    no_name = block('{"arguments": {}}')
    name_not_first = block('{"arguments": {}, "name": "python"}')
    not_object = block('["python"]')
    text_arguments = block('{"name": "python", "arguments": "not json"}')
    list_arguments = block('{"name": "python", "arguments": [1]}')
    for text in (bad_json, unknown, no_name, name_not_first, not_object, text_arguments, list_arguments,
                 "```python\nprint(1)\n```", '{"name": "John"}', "a < b and c > {d}", "", "  Just an answer.\n"):
        assert parse_tool_calls(text, TOOLS, "hermes") == (text, []), text
    good = block('{"name": "python", "arguments": {}}')
    assert parse_tool_calls(f"A {unknown} B {good}", TOOLS, "hermes") == (f"A {unknown} B ",
                                                                          [Call("python", "{}")])


def test_whitespace_only_content_is_dropped_when_there_are_calls():
    text = "\n\n" + block('{"name": "python", "arguments": {}}') + "\n \n"
    assert parse_tool_calls(text, TOOLS, "hermes") == ("", [Call("python", "{}")])
    assert streamed(text, list(range(1, len(text))), TOOLS, "hermes") == ("", [Call("python", "{}")])


def test_the_grammar_forced_block_parses_in_every_family():
    text = block('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    for family in ("hermes", "llama3", "mistral", "generic"):
        assert parse_tool_calls(text, TOOLS, family) == ("", [Call("get_weather", '{"city": "Paris"}')])


# -- Llama 3.x, Mistral, Generic ------------------------------------------------------------


def test_llama3_objects_with_parameters_after_the_python_tag_separated_by_semicolons():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"type": "function", "name": "get_weather", "parameters": {"city": "Tokyo"}}')
    assert parse_tool_calls(text, TOOLS, "llama3") == ("", [Call("get_weather", '{"city": "Paris"}'),
                                                            Call("get_weather", '{"city": "Tokyo"}')])


def test_mistral_tool_calls_array_and_name_args_form():
    text = 'Sure.[TOOL_CALLS][{"name": "search", "arguments": {"query": "x"}, "id": "abc123def"}]'
    assert parse_tool_calls(text, TOOLS, "mistral") == ("Sure.", [Call("search", '{"query": "x"}')])
    text = '[TOOL_CALLS]search[ARGS]{"query": "y"}[TOOL_CALLS]get_time[ARGS]{}'
    assert parse_tool_calls(text, TOOLS, "mistral") == ("", [Call("search", '{"query": "y"}'),
                                                             Call("get_time", "{}")])
    assert parse_tool_calls("[TOOL_CALLS]rm[ARGS]{}", TOOLS, "mistral") == ("[TOOL_CALLS]rm[ARGS]{}", [])


def test_generic_envelopes():
    one = '{"tool_call": {"name": "search", "arguments": {"query": "z"}}}'
    many = '{"tool_calls": [{"name": "search", "arguments": {"query": "z"}, "id": "call_1___"}, {"name": "get_time"}]}'
    assert parse_tool_calls(one, TOOLS, "generic") == ("", [Call("search", '{"query": "z"}')])
    assert parse_tool_calls(many, TOOLS, "generic") == ("", [Call("search", '{"query": "z"}'), Call("get_time", "{}")])
    unknown = '{"tool_calls": [{"name": "tool_name", "arguments": {"arg1": "some_value"}}]}'
    assert parse_tool_calls(unknown, TOOLS, "generic") == (unknown, [])
    # Hermes has no envelope, but takes the call object in it, as llama.cpp does
    assert parse_tool_calls(one, TOOLS, "hermes") == ('{"tool_call": }', [Call("search", '{"query": "z"}')])


def test_family_from_the_template_source():
    qwen3 = (DATA / "chat_templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    assert family_for(qwen3) == "hermes"
    assert family_for("{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}") == "llama3"
    assert family_for("{%- if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") == "mistral"
    assert family_for("{{ '<start_of_turn>' + role }}") == family_for(None) == "generic"


def test_hostile_output_never_raises():
    names = {"python"}
    for text in ["[" * 5000, "{" * 5000 + "}" * 5000, '{"name": "python", "arguments": ' + "[" * 3000 + "]" * 3000 + "}",
                 "```json\n" * 100, "<tool_call>" * 100, '\\"{"name"', "\x00<\ud800>"]:
        for family in ("hermes", "llama3", "mistral", "generic"):
            content, calls = parse_tool_calls(text, names, family)
            assert calls == [] and content == text


# Written answers of every family: cut anywhere, they read as they read whole.
WRITTEN = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>'),
    ("hermes", 'x <function=python>{"code": "1"}</function> <function name="search">{"query": "q"}</function> <b>y</b>'),
    ("hermes", '```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "rm", "arguments": {}}]\n```'),
    ("hermes", '<tool_call>\n{"name": "python", "arguments": {"code": "x"'),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "search", '
               '"parameters": {"query": "b"}} and {"type": "object"}'),
    ("mistral", 'Ok [TOOL_CALLS][{"name": "search", "arguments": {"query": "x"}}] [TOOL_CALLS]get_time[ARGS]{} [TOOL'),
    ("generic", '```json\n{"tool_calls": [{"name": "search", "arguments": {"query": "z"}}]}\n```\n{"tool_call": 1}'),
]


@pytest.mark.parametrize("family, text", WRITTEN)
def test_written_answer_streamed_in_any_cut_gives_the_same(family, text):
    whole = parse_tool_calls(text, TOOLS, family)
    for cut in range(1, len(text)):
        assert streamed(text, [cut], TOOLS, family) == whole, cut
    assert streamed(text, list(range(1, len(text))), TOOLS, family) == whole


PIECES = ["<tool_call>", "</tool_call>", "```json\n", "```", "\n", " ", "hello", "<b>", "`", "[", "]", "{", "}", '"', "\\",
          ",", ";", '{"name": "python", "arguments": {"code": "1"}}', '{"name": "rm"}', '{"name": "search"',
          ', "arguments": {"query": "a]}"}}', "<function=python>", '<function name="search">', "</function>",
          '{"code": 2}', "<|python_tag|>", "[TOOL_CALLS]", "get_time[ARGS]", "{}", '{"tool_calls": [',
          '{"tool_call": ', '{"type": "function", ', '"name": "get_time"', '"arguments": "{\\"a\\": 1}"', "<tools>"]


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral", "generic"])
def test_random_pieces_streamed_in_any_cut_give_the_same(family):
    rng = random.Random(23)
    for _ in range(60):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 10)))
        whole = parse_tool_calls(text, TOOLS, family)
        assert whole[1] or whole[0] == text
        for cut in range(1, len(text)):
            assert streamed(text, [cut], TOOLS, family) == whole, (text, cut)
        assert streamed(text, list(range(1, len(text))), TOOLS, family) == whole, text
