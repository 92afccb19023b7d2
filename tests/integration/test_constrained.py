"""Grammar-constrained decoding, fill-in-the-middle and tool calls on the real GGUF files."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from localllm.engine.request import SamplingParams
from localllm.errors import UsageError
from localllm.runners.llamacpp import JSON_OBJECT_GRAMMAR, json_schema_to_grammar
from localllm.tool_calls import family_for, parse_tool_calls

from test_engine import SMALL, long_text

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city name"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture
def qwen(engines, qwen_path):
    return engines.get(qwen_path)


def chat(engine, text: str, **kwargs) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], **kwargs)


def test_json_schema_output_always_validates(qwen):
    prompt = chat(qwen, "Describe a fictional person (name and age) as JSON.")
    grammar = json_schema_to_grammar(PERSON)
    for seed in range(5):
        out = qwen.generate([prompt], SamplingParams(temperature=0.8, max_tokens=64, seed=seed,
                                                     grammar=grammar))[0]
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert set(value) == {"name", "age"}
        assert isinstance(value["name"], str)
        assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert not qwen._constraints  # every grammar was freed


def test_json_object_output_parses(qwen):
    prompt = chat(qwen, "Give the capitals of France and Italy as a JSON object.")
    out = qwen.generate([prompt], SamplingParams(temperature=0.0, max_tokens=96,
                                                 grammar=JSON_OBJECT_GRAMMAR))[0]
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)


def test_tiny_grammar_yields_exactly_one_word_then_stops(qwen):
    prompt = chat(qwen, "Is Paris the capital of France?")
    for seed in range(3):
        out = qwen.generate([prompt], SamplingParams(temperature=0.8, max_tokens=16, seed=seed,
                                                     grammar='root ::= "yes" | "no"'))[0]
        assert out.text in ("yes", "no") and out.finish_reason == "stop"
        assert qwen.tokenizer.is_eog(out.token_ids[-1])
    # Unconstrained, the model says more than one word: the grammar is what made it stop.
    free = qwen.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert free.text not in ("yes", "no")


def test_invalid_grammar_is_refused_and_disturbs_nothing(qwen):
    for bad in ['root ::= foo', 'start ::= "x"', 'root ::= root "a" | "b"', 'root ::= "\\q"']:
        with pytest.raises(UsageError, match="cannot parse the grammar"):
            qwen.add_request("hi", SamplingParams(grammar=bad))
    with pytest.raises(UsageError, match="grammar"):
        SamplingParams(grammar="  ")
    with pytest.raises(UsageError, match="JSON schema"):
        json_schema_to_grammar({"$ref": "https://example.com/schema.json"})
    assert not qwen.has_unfinished and not qwen._constraints
    out = qwen.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.finished and len(out.token_ids) == 8


def test_abort_frees_the_grammar(qwen):
    seq = qwen.add_request(chat(qwen, "Hi"), SamplingParams(grammar=JSON_OBJECT_GRAMMAR))
    qwen.step()
    assert seq.request_id in qwen._constraints
    qwen.abort(seq.request_id)
    assert not qwen._constraints and not qwen.has_unfinished


def test_first_byte_prefilter_equals_the_full_vocabulary_mask(qwen):
    """The fast mask must be llama.cpp's full-vocabulary answer in every grammar state."""
    runner, rng = qwen.runner, np.random.default_rng(0)
    text = '{"name": "Zoë 東京 \\"Q\\"", "age": -42}'
    for grammar in (json_schema_to_grammar(PERSON), JSON_OBJECT_GRAMMAR):
        fast, full = runner.make_constraint(grammar), runner.make_constraint(grammar, prefilter=False)
        try:
            num_allowed = []
            for token in qwen.tokenizer.encode(text, add_special=False) + [qwen.tokenizer.eos_id]:
                logits = rng.standard_normal(runner.n_vocab).astype(np.float32)
                logits.flags.writeable = False  # like the runner's own rows
                masked = fast.apply(logits)
                assert np.array_equal(masked, full.apply(logits))
                allowed = np.isfinite(masked)
                assert np.array_equal(masked[allowed], logits[allowed])
                assert allowed[token]
                num_allowed.append(int(allowed.sum()))
                fast.accept(token)
                full.accept(token)
            # EOS only at the end, when the object is complete.
            assert num_allowed[0] < 100 and min(num_allowed) >= 1
        finally:
            fast.free()
            full.free()


def test_preempted_sequence_keeps_its_grammar_state(engines, qwen_path):
    engine = engines.get(qwen_path, **SMALL)
    prompts = [long_text(engine.tokenizer, 120, seed=i)[:120] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16,  # four 136-token sequences outgrow SMALL's 32 blocks
                            grammar='root ::= ("n" [0-9] [0-9]? "\\n"){30}')
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for out in outs:
        assert len(out.token_ids) == 16
        assert re.fullmatch(r"(n[0-9]{1,2}\n)*(n[0-9]{0,2})?", out.text), out.text
    alone = engine.generate([prompts[-1]], params)[0]
    assert alone.token_ids == outs[-1].token_ids
    assert not engine._constraints


def test_tool_call_from_the_chat_template(qwen):
    """The template renders the tool; the call is parsed from Qwen's <tool_call> block. The
    0.5B coder writes the call's JSON but leaves out the <tool_call> tags at greedy, so the
    block is constrained with a grammar, as the server would for tool_choice="required"."""
    prompt = chat(qwen, "What is the weather like in Paris right now?", tools=[WEATHER_TOOL])
    assert "get_weather" in qwen.tokenizer.decode(prompt)
    call_schema = {
        "type": "object",
        "properties": {"name": {"const": "get_weather"},
                       "arguments": WEATHER_TOOL["function"]["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    call_rules = re.sub(r"^root ::=", "call ::=", json_schema_to_grammar(call_schema), flags=re.MULTILINE)
    grammar = call_rules + '\nroot ::= "<tool_call>\\n" call "\\n</tool_call>"\n'
    out = qwen.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64, grammar=grammar))[0]
    assert out.finish_reason == "stop", out.text
    content, calls = parse_tool_calls(out.text, {"get_weather"}, family_for(qwen.tokenizer.template_source))
    assert len(calls) == 1, out.text
    assert calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert content == ""


# -- fill-in-the-middle ------------------------------------------------------------------------


def test_fim_prompt_and_completion(qwen):
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    ids = qwen.tokenizer.encode_fim(prefix, suffix)
    tok = qwen.tokenizer
    assert ids == ([151659] + tok.encode(prefix, add_special=False) + [151661]
                   + tok.encode(suffix, add_special=False) + [151660])
    out = qwen.generate([ids], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert "a + b" in out.text or "a+b" in out.text, out.text


def test_fim_on_a_model_without_fim_tokens_is_refused(engines, gemma_path):
    engine = engines.get(gemma_path)
    with pytest.raises(UsageError, match="no fill-in-the-middle tokens"):
        engine.tokenizer.encode_fim("def f():", "\n")
