"""engine/constraint.py over a small byte-level vocabulary: the grammars a door builds, their
errors, the masks and the checks of a draft. The real vocabularies are in
tests/integration/test_constrained.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from localllm.engine import constraint as C
from localllm.errors import UsageError

EOS, IM_END, TOOL_CALL = 256, 257, 258
WORDS = [b'{"', b'":', b"name", b"age", b"<tool_call>"]  # ids 259..263: multi-byte tokens


class ByteVocab:
    """Each byte is its own token (id = byte value); 256 and 257 are control tokens (EOS and
    <|im_end|>, both end generation), 258 a control token that does not; then WORDS."""

    n_vocab = 259 + len(WORDS)
    bos_id = None
    eos_id = EOS

    def control_ids(self) -> list[int]:
        return [EOS, IM_END, TOOL_CALL]

    def special_piece(self, token_id: int) -> bytes:
        if token_id < 256:
            return bytes([token_id])
        if token_id >= 259:
            return WORDS[token_id - 259]
        return {EOS: b"<|endoftext|>", IM_END: b"<|im_end|>", TOOL_CALL: b"<|fim_pad|>"}[token_id]

    def tokenize(self, text: bytes, add_special: bool, parse_special: bool) -> list[int]:
        ids, i = [], 0  # longest word first, as a BPE vocabulary's merges would give
        while i < len(text):
            word = next((w for w in sorted(WORDS, key=len, reverse=True) if text.startswith(w, i)), None)
            ids.append(259 + WORDS.index(word) if word else text[i])
            i += len(word) if word else 1
        return ids

    def is_eog(self, token_id: int) -> bool:
        return token_id in (EOS, IM_END)


@pytest.fixture(scope="module")
def grammars() -> C.Grammars:
    return C.Grammars(ByteVocab())


def allowed(constraint: C.Constraint) -> set[int]:
    mask = constraint.new_masks(1)[0]
    constraint.fill(mask)
    return set(np.flatnonzero(C.allowed_tokens(mask, ByteVocab.n_vocab)).tolist())


def walk(constraint: C.Constraint, text: bytes) -> list[int]:
    """Say ``text`` through the constraint, each step the longest allowed token it starts with."""
    vocab, said = ByteVocab(), []
    while text:
        options = [t for t in allowed(constraint) if text.startswith(vocab.special_piece(t))]
        assert options, (text, allowed(constraint))
        token_id = max(options, key=lambda t: len(vocab.special_piece(t)))
        constraint.accept(token_id)
        said.append(token_id)
        text = text[len(vocab.special_piece(token_id)):]
    return said


def test_a_regex_allows_exactly_its_next_bytes_and_ends_with_either_eog_token(grammars):
    c = grammars.constraint(C.regex_grammar(r"ab[0-9]"))
    assert allowed(c) == {ord("a")}
    walk(c, b"ab")
    assert allowed(c) == set(b"0123456789")
    c.accept(ord("7"))
    assert allowed(c) == {EOS, IM_END} and c.is_accepting


def test_control_tokens_are_never_spelled_out_but_words_are_whole_texts(grammars):
    c = grammars.constraint(C.json_grammar({"type": "object", "properties": {"name": {"type": "string"}},
                                            "required": ["name"], "additionalProperties": False}))
    first = allowed(c)
    assert ord("{") in first and 259 in first  # the token '{"' is the object's start and its key's quote
    assert not first & {EOS, IM_END, TOOL_CALL}
    c.accept(259)
    assert allowed(c) == {261}  # the one key, forced: as the tokenizer says it ("name", not n-a-m-e)
    assert walk(c, b'name": "x"}')[:2] == [261, 260]
    assert allowed(c) == {EOS, IM_END}


def test_the_tool_call_tag_is_text_and_its_arguments_follow_the_schema(grammars):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]
    c = grammars.constraint(C.tool_call_grammar(tools))
    assert allowed(c) == {263}  # the tag is forced text: the one token the tokenizer makes of it
    c.accept(263)
    walk(c, b'\n{"name": "f", "arguments": {"n": -12}}\n</tool_call>')
    assert allowed(c) == {EOS, IM_END}
    with pytest.raises(UsageError, match="not allowed by the request's grammar"):
        grammars.constraint(C.tool_call_grammar(tools)).accept(ord("{"))


@pytest.mark.parametrize("n", [1, 31, 32, 33, 262])
def test_allowed_tokens_and_is_allowed_read_the_same_bits(n):
    rng = np.random.default_rng(n)
    mask = rng.integers(-2**31, 2**31, size=(n + 31) // 32, dtype=np.int64).astype(np.int32)
    flags = C.allowed_tokens(mask, n)
    assert flags.shape == (n,) and flags.dtype == bool
    assert flags.tolist() == [C.is_allowed(mask, t) for t in range(n)]
    assert flags.tolist() == [bool((int(mask[t // 32]) >> (t % 32)) & 1) for t in range(n)]


def test_masked_keeps_allowed_logits_and_sets_the_rest_to_minus_infinity(grammars):
    c = grammars.constraint(C.regex_grammar("[xy]"))
    mask = c.new_masks(1)[0]
    c.fill(mask)
    logits = np.arange(ByteVocab.n_vocab, dtype=np.float32)
    logits.flags.writeable = False  # like a runner's own row
    out = c.masked(logits, mask)
    assert out.dtype == np.float32 and out[ord("x")] == ord("x") and out[ord("y")] == ord("y")
    assert np.isneginf(np.delete(out, [ord("x"), ord("y")])).all()


def test_a_draft_is_cut_where_the_grammar_stops_and_its_masks_leave_the_state_as_it_was(grammars):
    c = grammars.constraint(C.regex_grammar("[0-9]+;"))
    assert c.valid_prefix(list(b"12a;")) == 2
    assert c.valid_prefix([]) == 0
    draft = list(b"12;")
    masks = c.new_masks(4)
    c.fill_draft(draft, masks)
    digits = set(b"0123456789")
    rows = [set(np.flatnonzero(C.allowed_tokens(m, ByteVocab.n_vocab)).tolist()) for m in masks]
    assert rows == [digits, digits | {ord(";")}, digits | {ord(";")}, {EOS, IM_END}]
    assert allowed(c) == digits  # rolled back to the start
    walk(c, b"5;")


def test_gbnf_and_lark_are_both_read(grammars):
    for text in ['root ::= "yes" | "no"', 'start: "yes" | "no"']:
        c = grammars.constraint(C.text_grammar(text))
        assert allowed(c) == {ord("y"), ord("n")}
    # The engine's own parameter takes either text, or llguidance's JSON form as it is.
    assert C.from_text(C.regex_grammar("a")) == C.regex_grammar("a")
    assert json.loads(C.regex_grammar("a"))["grammars"]


@pytest.mark.parametrize("build, message", [
    (lambda: C.json_grammar({"type": "foo"}), "Invalid type: foo"),
    (lambda: C.json_grammar({"type": "string", "minLength": 5, "maxLength": 2}), "Unsatisfiable schema"),
    (lambda: C.json_grammar({"allOf": [{"type": "string"}, {"type": "number"}]}), "Unsatisfiable schema"),
    (lambda: C.json_grammar({"type": "array", "uniqueItems": True}),
     'the schema uses "uniqueItems", which localllm cannot enforce'),
    (lambda: C.json_grammar({"$ref": "https://example.com/schema.json"}), "https://example.com/schema.json"),
    (lambda: C.json_grammar({"oneOf": [{"type": "integer"}, {"type": "number"}]}),
     'the schema uses "oneOf", which localllm cannot enforce'),
    (lambda: C.json_grammar({"type": "string", "pattern": "^(?!aws:).*$"}),
     'a regular expression uses look-around (^(?!aws:).*$), which localllm cannot enforce'),
    (lambda: C.json_grammar(["not", "an", "object"]), "the JSON schema is a list"),
    (lambda: C.text_grammar("root ::= foo"), "foo"),
    (lambda: C.text_grammar("start: foo"), 'unknown name: "foo"'),
    (lambda: C.text_grammar("   "), "the grammar is empty"),
    (lambda: C.regex_grammar("("), "unclosed group"),
    (lambda: C.regex_grammar(""), "the regex is empty"),
])
def test_bad_grammars_are_usage_errors_that_name_the_problem(grammars, build, message):
    with pytest.raises(UsageError, match="(?s)" + __import__("re").escape(message)):
        grammars.check(build())


def test_a_format_json_schema_does_not_define_is_an_annotation_and_one_it_defines_is_enforced(grammars):
    schema = {"type": "object", "properties": {
        "role": {"type": "string", "format": "AWS::IAM::Role.Arn"},
        "when": {"type": "string", "format": "date"},
        "format": {"type": "string", "const": "x", "format": "my-format"}},  # a property called format
        "required": ["role", "when", "format"], "additionalProperties": False,
        "examples": [{"format": "AWS::IAM::Role.Arn"}]}
    c = grammars.constraint(C.json_grammar(schema))
    walk(c, b'{"role": "anything", "when": "2026-12-05", "format": "x"}')
    assert allowed(c) == {EOS, IM_END}
    c = grammars.constraint(C.json_grammar(schema))
    walk(c, b'{"role": "anything", "when": "2026-1')
    assert ord("x") not in allowed(c) and ord("2") in allowed(c)  # the date's format holds
    assert C._without_format(schema, "AWS::IAM::Role.Arn")["examples"] == schema["examples"]  # data is kept
    with pytest.raises(UsageError, match='the schema uses format "regex", which localllm cannot enforce'):
        grammars.check(C.json_grammar({"type": "string", "format": "regex"}))


@pytest.mark.parametrize("grammar", [C.regex_grammar(r"[^\s\S]"), C.text_grammar('start: a\na: a "x"')])
def test_a_grammar_with_no_answer_at_all_is_refused(grammars, grammar):
    with pytest.raises(UsageError, match="the grammar allows no answer at all"):
        grammars.check(grammar)


def test_a_grammar_compiles_once_and_each_constraint_is_its_own_copy():
    grammars = C.Grammars(ByteVocab())
    grammar = C.regex_grammar("ab|ac")
    first, second = grammars.constraint(grammar), grammars.constraint(grammar)
    assert len(grammars._compiled) == 1
    first.accept(ord("a"))
    first.accept(ord("b"))
    assert allowed(first) == {EOS, IM_END}
    assert allowed(second) == {ord("a")}  # untouched by the first's tokens
    for i in range(C.Grammars.KEEP + 1):
        grammars.check(C.regex_grammar(f"x{i}"))
    assert len(grammars._compiled) == C.Grammars.KEEP and grammar not in grammars._compiled
    with pytest.raises(UsageError):  # a refused grammar is not kept
        grammars.check(C.regex_grammar("("))
    assert C.regex_grammar("(") not in grammars._compiled
