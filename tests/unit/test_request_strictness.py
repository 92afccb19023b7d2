"""What the HTTP fuzzing found, pinned without a model: request types are strict as OpenAI's
are, a temperature or repetition penalty small enough to overflow float32 logits never
reaches the sampler as a division, and error parameters name the field, not pydantic's union
member."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from pydantic import ValidationError

from localllm.engine.request import SamplingParams, Sequence
from localllm.engine.sampler import Sampler
from localllm.errors import UsageError
from localllm.server import protocol as P
from localllm.server.app import param_name


def completion(**fields) -> P.CompletionRequest:
    return P.CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


@pytest.mark.parametrize("fields", [
    {"prompt": [False]},  # a boolean is no token id (it was read as token 0)
    {"prompt": [1, True]},
    {"n": "2"}, {"n": True}, {"n": 1.5},
    {"max_tokens": "16"}, {"seed": "7"}, {"stream": "true"}, {"echo": 1},
    {"temperature": "0.5"},
    {"repeat_penalty": 5e-324}, {"repeat_penalty": 1e-4}, {"repeat_penalty": 1e4},
])
def test_loose_types_and_values_are_refused(fields):
    with pytest.raises(ValidationError):
        completion(**fields)


def test_whole_floats_are_integers_as_in_json_schema():
    req = completion(prompt=[1.0, 2], n=2.0, max_tokens=16.0, top_k=40.0)
    assert req.prompt == [1, 2] and type(req.prompt[0]) is int
    assert (req.n, req.max_tokens, req.top_k) == (2, 16, 40)
    assert completion(temperature=1).temperature == 1.0  # and integers are numbers


@pytest.mark.parametrize("penalty", [5e-324, 1e-4, 1001.0])
def test_repetition_penalty_out_of_range_is_a_usage_error(penalty):
    with pytest.raises(UsageError, match=r"repetition_penalty.*\[0.001, 1000\]"):
        SamplingParams(repetition_penalty=penalty)


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e-7])
def test_a_vanishing_temperature_is_greedy_with_no_overflow(temperature):
    params = SamplingParams(temperature=temperature, logprobs=True)
    assert params.is_greedy
    logits = (np.random.default_rng(0).standard_normal(1000) * 30).astype(np.float32)  # (vocab,)
    seq = Sequence(prompt_token_ids=[0], params=params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an inf - inf would warn
        token, logprob = Sampler().sample(seq, logits)
    assert token == int(np.argmax(logits)) and np.isfinite(logprob)


def test_a_small_but_real_temperature_still_samples():
    assert not SamplingParams(temperature=1e-3).is_greedy


@pytest.mark.parametrize("loc, param", [
    (("body", "messages", 0, "content", "str"), "messages.0.content"),
    (("body", "messages", 0, "content", "list[TextPart]", 0, "text"), "messages.0.content.0.text"),
    (("body", "tool_choice", "literal['none','auto','required']"), "tool_choice"),
    (("body", "tool_choice", "NamedToolChoice", "function"), "tool_choice.function"),
    (("body", "prompt", "list[function-before[_whole(), int]]", 0), "prompt.0"),
    (("body", "model"), "model"),
    (("body",), None),
])
def test_param_names_drop_union_members(loc, param):
    assert param_name(loc) == param
