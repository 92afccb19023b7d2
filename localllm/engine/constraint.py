"""What a request may generate: JSON, a JSON schema, a Lark or GBNF grammar, a regex, a tool
call. One module of the engine's, over llguidance, the same for every runner.

A grammar is llguidance's text: the ``*_grammar`` functions build it from what a door was
given, and raise UsageError naming what is wrong with it. ``Grammars`` holds the model's
vocabulary as llguidance reads it (built on first use: ~0.6 s for Qwen's 152k tokens) and
gives each sequence a ``Constraint``: its grammar's state, its next-token masks (one bit per
token, computed with the GIL released, so the engine computes them while the step's forward
runs), and the checks of a draft.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance as lg
import llguidance.numpy as lgn
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from localllm.errors import UsageError
from localllm.tokenizer import Vocab

# llguidance marks a control token by a leading 0xFF byte: no text can spell one out.
_CONTROL = b"\xff"

# The schema keywords llguidance reads: anything else in a schema is a 400 naming it
# (llguidance's own "Unimplemented keys" message), never silently ignored.
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")

# The formats JSON Schema defines (2020-12, and draft 7's names): the rest are annotations.
_DEFINED_FORMATS = frozenset((
    "date-time date time duration email idn-email hostname idn-hostname ipv4 ipv6 uri uri-reference "
    "iri iri-reference uuid uri-template json-pointer relative-json-pointer regex").split())
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (.*)")
_MAX_FORMATS = 64  # distinct unknown formats read past in one schema
_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))

# llguidance's default limits, with errors that do not dump the parser's state and grammar.
_LIMITS = lg.LLParserLimits(verbose_errors=False)


# -- grammars from what a door was given ----------------------------------------------------------

def json_grammar(schema: dict | None) -> str:
    """Any JSON object (``schema`` None), or the JSON values ``schema`` allows. A ``format``
    that JSON Schema does not define ("AWS::IAM::Role.Arn") is an annotation, as JSON Schema
    has it and validators read it; one it defines that llguidance cannot enforce is refused
    (Grammars.check: a 400 naming it)."""
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise UsageError(f"the JSON schema is a {type(schema).__name__}; give a JSON object")
    try:
        grammar = lg.LLMatcher.grammar_from_json_schema(schema)
        for _ in range(_MAX_FORMATS):
            unknown = _UNKNOWN_FORMAT.match(lg.LLMatcher.validate_grammar(grammar, limits=_LIMITS))
            if not unknown or unknown.group(1) in _DEFINED_FORMATS:
                break
            schema = _without_format(schema, unknown.group(1))
            grammar = lg.LLMatcher.grammar_from_json_schema(schema)
        return grammar
    except (ValueError, TypeError) as e:
        raise UsageError(f"the JSON schema cannot be read: {e}") from None


def _without_format(node, name: str):
    """The schema with every ``"format": name`` gone; values (const, enum, default, examples)
    are data, kept as they are."""
    if isinstance(node, list):
        return [_without_format(item, name) for item in node]
    if not isinstance(node, dict):
        return node
    return {key: value if key in _DATA_KEYWORDS else _without_format(value, name)
            for key, value in node.items() if not (key == "format" and value == name)}


def text_grammar(text: str) -> str:
    """A grammar in Lark (llguidance's syntax) or GBNF (llama.cpp's, converted)."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError("the grammar is empty; give Lark or GBNF text")
    try:
        return lg.LLMatcher.grammar_from_lark(any_to_lark(text))
    except Exception as e:  # the GBNF converter raises whatever it meets: all of it is the text's fault
        raise UsageError(f"the grammar cannot be read as Lark or GBNF: {e}") from None


def regex_grammar(pattern: str) -> str:
    """Text that matches ``pattern`` whole (Rust's regex syntax, as Python's for the common part)."""
    if not isinstance(pattern, str) or not pattern:
        raise UsageError("the regex is empty; give a pattern the answer must match")
    return lg.LLMatcher.grammar_from_regex(pattern)


def tool_call_grammar(tools: list[dict], name: str | None = None) -> str:
    """One ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` block calling
    one of ``tools`` (or the named one) with arguments that follow its parameters schema: the
    Qwen2.5 / Hermes form, which the parser of every template family reads (tool_calls.py)."""
    calls = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools if name is None or t["function"]["name"] == name]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    lark = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'
    return lg.LLMatcher.grammar_from_lark(lark)


def from_text(grammar: str) -> str:
    """llguidance's grammar for SamplingParams.grammar: llguidance's own JSON form (what the
    functions above return) as it is, Lark or GBNF text converted."""
    return grammar if grammar.lstrip().startswith("{") else text_grammar(grammar)


def _reason(error: str) -> str:
    """llguidance's error, with the fix named where there is one."""
    error = error.strip()
    missing = _UNIMPLEMENTED.search(error)
    if missing:
        return (f"the schema uses {missing.group(1)}, which localllm cannot enforce; "
                "remove the keyword or express it another way")
    if error.startswith("oneOf constraints are not supported"):
        return ('the schema uses "oneOf", which localllm cannot enforce (exactly one branch, never two); '
                'use "anyOf" where any branch will do')
    if "look-around" in error:
        pattern = error.splitlines()[1].strip() if len(error.splitlines()) > 1 else ""
        return (f'a regular expression uses look-around ({pattern}), which localllm cannot enforce; '
                "write it without (?= (?! (?<= (?<!")
    unknown = _UNKNOWN_FORMAT.match(error)
    if unknown:
        return (f'the schema uses format "{unknown.group(1)}", which localllm cannot enforce; '
                "remove it or give a pattern instead")
    return error


# -- the vocabulary, and constraints over it ---------------------------------------------------

class Grammars:
    """A model's vocabulary as llguidance reads it, and constraints over it. Thread-safe:
    doors check grammars on their own threads while the engine steps. The latest grammars
    compiled are kept (``KEEP``), each new constraint a copy: a door's check and the engine's
    constraint compile a grammar once, and an agent's tool schemas, the same every turn, once."""

    KEEP = 32

    def __init__(self, vocab: Vocab) -> None:
        self._vocab = vocab
        self._tokenizer: lg.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, lg.LLMatcher] = OrderedDict()  # grammar -> its matcher, untouched

    @property
    def tokenizer(self) -> lg.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _lltokenizer(self._vocab)
            return self._tokenizer

    def check(self, grammar: str) -> None:
        """Raise UsageError when ``grammar`` (see from_text) does not compile, uses what cannot
        be enforced, or allows no answer at all."""
        self.constraint(grammar).free()

    def constraint(self, grammar: str) -> Constraint:
        """A fresh constraint for one sequence; UsageError as ``check``."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
        if compiled is None:
            compiled = self._compile(grammar)
            with self._lock:
                self._compiled[grammar] = compiled
                while len(self._compiled) > self.KEEP:
                    self._compiled.popitem(last=False)
        return Constraint(compiled.deep_copy(), self._vocab.n_vocab)

    def _compile(self, grammar: str) -> lg.LLMatcher:
        matcher = lg.LLMatcher(self.tokenizer, from_text(grammar), log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise UsageError(f"the grammar cannot be used: {_reason(matcher.get_error())}")
        first = Constraint(matcher.deep_copy(), self._vocab.n_vocab)
        first.fill(first.new_masks(1)[0])
        if first.error is not None:
            raise UsageError(f"the grammar allows no answer at all ({first.error}); loosen it")
        return matcher


def _lltokenizer(vocab: Vocab) -> lg.LLTokenizer:
    """llguidance's tokenizer over the model's own vocabulary: every token's bytes, control
    tokens marked (a grammar's text never matches them); the end-of-generation tokens are the
    ones a grammar allows once it is complete."""
    control = set(vocab.control_ids())
    tokens = [_CONTROL + vocab.special_piece(t) if t in control else vocab.special_piece(t)
              for t in range(vocab.n_vocab)]
    eog = [t for t in range(vocab.n_vocab) if vocab.is_eog(t)] or [vocab.eos_id or 0]

    class _Tokens:  # llguidance's TokenizerWrapper reads these
        eos_token_id = eog[0]
        bos_token_id = vocab.bos_id
        special_token_ids = sorted(control)

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: bytes) -> list[int]:
            return vocab.tokenize(text, False, False)

    return lg.LLTokenizer(lg.TokenizerWrapper(_Tokens()), n_vocab=vocab.n_vocab, eos_token=eog)


class Constraint:
    """One sequence's grammar state. A mask is a row of int32 words, bit t of it set when token
    t is allowed; ``masked`` applies one to a logits row."""

    def __init__(self, matcher: lg.LLMatcher, n_vocab: int) -> None:
        self._matcher = matcher
        self.n_vocab = n_vocab

    def new_masks(self, n: int) -> np.ndarray:
        """(n, words) int32, to fill."""
        return lgn.allocate_token_bitmask(n, self.n_vocab)

    def fill(self, mask: np.ndarray) -> None:
        """The next token's mask into ``mask`` (words,), a C-contiguous row (GIL released)."""
        self._matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

    def masked(self, logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """A float32 copy of logits (vocab,) with every token the mask forbids at -inf;
        logits may be read-only (a view into the runner's memory)."""
        allowed = allowed_tokens(mask, logits.shape[-1])
        return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def accept(self, token_id: int) -> None:
        """Advance past a token the mask allowed."""
        if not self._matcher.consume_token(token_id):
            raise UsageError(f"token {token_id} is not allowed by the request's grammar: "
                             f"{self._matcher.get_error()}")

    def valid_prefix(self, draft: Sequence[int]) -> int:
        """How many of draft's first tokens the grammar allows, one after the other."""
        return self._matcher.validate_tokens(list(draft)) if draft else 0

    def fill_draft(self, draft: Sequence[int], masks: np.ndarray) -> None:
        """masks[i] (len(draft) + 1 rows): the mask after draft's first i tokens, which the
        grammar must allow (valid_prefix). The state is left as it was."""
        self.fill(masks[0])
        for i, token_id in enumerate(draft):
            self.accept(token_id)
            self.fill(masks[i + 1])
        if draft and not self._matcher.rollback(len(draft)):
            raise UsageError(f"the grammar could not step back over a draft: {self._matcher.get_error()}")

    @property
    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the grammar cannot go on (its first line), or None. A mask computed in error
        allows only the end-of-generation tokens."""
        if not self._matcher.is_error():
            return None
        lines = self._matcher.get_error().strip().splitlines()
        return lines[0] if lines else "an error without a message"

    def free(self) -> None:
        self._matcher = None


def allowed_tokens(mask: np.ndarray, n: int) -> np.ndarray:
    """(n,) bool: which of the first n tokens a mask (words,) allows."""
    return np.unpackbits(mask.view(np.uint8), bitorder="little", count=n).view(bool)


def is_allowed(mask: np.ndarray, token_id: int) -> bool:
    return bool((int(mask[token_id >> 5]) >> (token_id & 31)) & 1)
