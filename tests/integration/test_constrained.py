"""Grammar-constrained decoding, fill-in-the-middle and tool calls on the real GGUF files."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from localllm.engine import constraint as C
from localllm.engine.request import SamplingParams
from localllm.errors import UsageError
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


JSON_OBJECT = C.json_grammar(None)


@pytest.fixture
def qwen(engines, qwen_path):
    return engines.get(qwen_path)


def chat(engine, text: str, **kwargs) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], **kwargs)


def test_json_schema_output_always_validates(qwen):
    prompt = chat(qwen, "Describe a fictional person (name and age) as JSON.")
    grammar = C.json_grammar(PERSON)
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
                                                 grammar=JSON_OBJECT))[0]
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
    for bad, message in [("root ::= foo", "Rule .foo. not found"), ('start: "x" | foo', 'unknown name: "foo"'),
                         ("(", "unclosed group")]:
        with pytest.raises(UsageError, match=message):
            qwen.add_request("hi", SamplingParams(grammar=bad if bad != "(" else C.regex_grammar(bad)))
    with pytest.raises(UsageError, match="grammar"):
        SamplingParams(grammar="  ")
    with pytest.raises(UsageError, match="https://example.com/schema.json"):
        qwen.check_grammar(C.json_grammar({"$ref": "https://example.com/schema.json"}))
    assert not qwen.has_unfinished and not qwen._constraints
    out = qwen.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.finished and len(out.token_ids) == 8


def test_abort_frees_the_grammar(qwen):
    seq = qwen.add_request(chat(qwen, "Hi"), SamplingParams(grammar=JSON_OBJECT))
    qwen.step()
    assert seq.request_id in qwen._constraints
    qwen.abort(seq.request_id)
    assert not qwen._constraints and not qwen.has_unfinished


def test_masks_on_the_real_vocabulary_follow_the_text_and_hold_control_tokens_back(qwen):
    """Every token of a JSON answer is allowed in its turn, the mask agrees with the grammar's
    own check of each token, and the end-of-generation tokens come only once it is complete;
    <tool_call> is the one token the tool-call grammar starts with."""
    grammars, tok, rng = qwen.grammars, qwen.tokenizer, np.random.default_rng(0)
    text = '{"name": "Zoë 東京 \\"Q\\"", "age": -42}'
    eog = [t for t in range(tok.n_vocab) if tok.is_eog(t)]
    for grammar in (C.json_grammar(PERSON), JSON_OBJECT):
        c = grammars.constraint(grammar)
        mask = c.new_masks(1)[0]
        for i, token in enumerate(tok.encode(text, add_special=False)):
            c.fill(mask)
            allowed = C.allowed_tokens(mask, tok.n_vocab)
            assert allowed[token] and not allowed[eog].any()
            sample = rng.choice(tok.n_vocab, 64, replace=False)
            assert [c.valid_prefix([int(t)]) == 1 for t in sample] == allowed[sample].tolist()
            if i == 0:
                assert allowed.sum() < 100  # after nothing: '{' and its tokens
            c.accept(token)
        c.fill(mask)
        assert C.allowed_tokens(mask, tok.n_vocab)[eog].all() and c.is_accepting
        c.free()
    c = grammars.constraint(C.tool_call_grammar([WEATHER_TOOL]))
    c.fill(mask)
    assert np.flatnonzero(C.allowed_tokens(mask, tok.n_vocab)).tolist() == tok.encode_special("<tool_call>")


def test_preempted_sequence_keeps_its_grammar_state(engines, qwen_path):
    engine = engines.get(qwen_path, **SMALL)
    prompts = [long_text(engine.tokenizer, 120, seed=i)[:120] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16,  # four 136-token sequences outgrow SMALL's 32 blocks
                            grammar='root ::= ("n" [0-9] [0-9]? "\\n"){30}')  # GBNF
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
    grammar = C.tool_call_grammar([WEATHER_TOOL])
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


# -- drafting and the greedy fast path under a grammar ------------------------------------------


@pytest.mark.parametrize("runner", ["llamacpp", "torch"])
def test_drafting_under_a_grammar_emits_what_undrafted_steps_do(engines, qwen_path, runner):
    """Drafts are cut where the grammar stops allowing them and each verified row is masked by
    the grammar's state after the drafts before it: greedy and seeded sampled answers are the
    same drafted or not, and drafts were taken. (The tool call's arguments repeat the prompt:
    prompt lookup has something to draft.)"""
    engine = engines.get(qwen_path, runner)
    city = "Llanfairpwllgwyngyll on the island of Anglesey, Wales, United Kingdom"
    prompt = chat(engine, f"What is the weather like in {city} right now?", tools=[WEATHER_TOOL])
    grammar = C.tool_call_grammar([WEATHER_TOOL])
    for temperature in (0.0, 0.7):
        answers = []
        for speculative in (False, True):
            before = engine.num_draft_accepted
            params = SamplingParams(temperature=temperature, seed=3, max_tokens=64, grammar=grammar,
                                    speculative=speculative)
            out = engine.generate([prompt], params)[0]
            answers.append(out.token_ids)
            accepted = engine.num_draft_accepted - before
        assert answers[0] == answers[1], engine.tokenizer.decode(answers[1])
        assert accepted > 0
        _, calls = parse_tool_calls(engine.tokenizer.decode(answers[0]), {"get_weather"},
                                    family_for(engine.tokenizer.template_source))
        assert len(calls) == 1
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER_TOOL["function"]["parameters"])
    assert not engine._constraints


def test_greedy_fast_path_gives_the_masked_argmax(qwen):
    """A greedy request takes the plain argmax where the grammar allows it; with logprobs it
    always masks first. Both give the same tokens."""
    prompt = chat(qwen, "Describe a fictional person (name and age) as JSON, on one line.")
    grammar = C.json_grammar(PERSON)
    fast = qwen.generate([prompt], SamplingParams(temperature=0.0, max_tokens=48, grammar=grammar))[0]
    masked = qwen.generate([prompt], SamplingParams(temperature=0.0, max_tokens=48, grammar=grammar,
                                                    logprobs=True))[0]
    assert fast.token_ids == masked.token_ids
    assert set(json.loads(fast.text)) == {"name", "age"}


def test_a_grammar_that_breaks_mid_answer_ends_only_its_own_request(qwen):
    """A constraint whose mask cannot be computed (llguidance in an error state) ends that
    request with finish reason "error"; the request beside it finishes as it would alone."""
    prompt = chat(qwen, "Describe a fictional person (name and age) as JSON.")
    params = SamplingParams(temperature=0.0, max_tokens=24, grammar=C.json_grammar(PERSON))
    alone = qwen.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))[0]
    broken = qwen.add_request(prompt, params)
    other = qwen.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=24))
    qwen.step()  # the prompts, and the first tokens

    def fail(mask):
        raise UsageError("the grammar is in an error state")

    qwen._constraints[broken.request_id].fill = fail
    outputs = {}
    while qwen.has_unfinished:
        for out in qwen.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert outputs[broken.request_id][-1].finish_reason == "error"
    assert [t for o in outputs[other.request_id] for t in o.token_ids] == alone.token_ids[1:]
    assert not qwen._constraints
