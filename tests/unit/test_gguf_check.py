"""localllm.gguf_check: the files that pass the container checks but crash llama.cpp (each one
found by scripts/fuzz_gguf_llamacpp.py) are refused with one ModelLoadError; real and tiny
models pass; and a property-based fuzz of well-formed but lying files (metadata values and
types, counts, tensor shapes, types and offsets) never gets anything but ModelLoadError out.

More examples: HYPOTHESIS_PROFILE=gguf-deep (2,000 per property)."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_mutations import ARRAY, F32, I32, KV, REPLACEMENTS, STRING, U32, Model, read_model, semantic_mutations
from localllm.errors import ModelLoadError
from localllm.gguf import GGUFInfo
from localllm.gguf_check import check_model
from tiny_gguf import write_tiny_gguf

settings.register_profile("gguf-deep", max_examples=2000)
DEEP = os.environ.get("HYPOTHESIS_PROFILE") == "gguf-deep"
EXAMPLES = 2000 if DEEP else 150


def _tiny(arch: str) -> Model:
    with tempfile.TemporaryDirectory() as d:
        return read_model(write_tiny_gguf(Path(d) / f"{arch}.gguf", arch))


QWEN, GEMMA = _tiny("qwen2"), _tiny("gemma3")


def write(tmp_path: Path, model: Model, **lies) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(model.to_bytes(**lies))
    return path


def refused(tmp_path: Path, model: Model, **lies) -> str:
    path = write(tmp_path, model, **lies)
    with pytest.raises(ModelLoadError) as e:
        check_model(path)
    message = str(e.value)
    assert str(path) in message and "\n" not in message
    return message


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3"])
def test_tiny_models_pass(tmp_path, arch):
    info = check_model(write_tiny_gguf(tmp_path / "t.gguf", arch))
    assert isinstance(info, GGUFInfo) and info.architecture == arch


def test_round_trip_is_exact(tmp_path):
    """read_model + to_bytes gives back the writer's bytes, so every edit is the only change."""
    original = write_tiny_gguf(tmp_path / "q.gguf", "qwen2").read_bytes()
    assert read_model(tmp_path / "q.gguf").to_bytes() == original


def test_real_models_pass(qwen_path, gemma_path):
    assert check_model(qwen_path).architecture == "qwen2"
    assert check_model(gemma_path).architecture == "gemma3"


def _kv(model: Model, key: str, value_type: int, value, item_type=None) -> Model:
    return model.with_kv(KV(key, value_type, value, item_type))


def _tensor(model: Model, name: str, **changes) -> Model:
    return replace(model, tensors=tuple(replace(t, **changes) if t.name == name else t for t in model.tensors))


# Each of these made llama.cpp abort (SIGABRT) or read out of bounds (SIGSEGV) in the fuzz.
CRASHERS = [
    ("no layers", lambda: _kv(QWEN, "qwen2.block_count", U32, 0), "qwen2.block_count is 0, not a layer count from 1 to 512"),
    ("513 layers", lambda: _kv(QWEN, "qwen2.block_count", U32, 513), "not a layer count from 1 to 512"),
    ("experts, none used", lambda: _kv(QWEN, "qwen2.expert_count", U32, 8), "it uses 0 of 8 experts per token"),
    ("used experts, none defined", lambda: _kv(QWEN, "qwen2.expert_used_count", U32, 1), "it uses 1 of 0 experts"),
    ("negative used experts", lambda: _kv(GEMMA, "gemma3.expert_used_count", ARRAY, (-1,) * 6, I32),
     "not a count or a list of counts"),
    ("bool used experts", lambda: _kv(GEMMA, "gemma3.expert_used_count", ARRAY, (True,) * 6, 7), "it uses 1 of 0 experts"),
    ("too many experts", lambda: _kv(_kv(QWEN, "qwen2.expert_count", U32, 2048), "qwen2.expert_used_count", U32, 2),
     "it claims 2048 experts (llama.cpp allows at most 1024)"),
    ("negative eps", lambda: _kv(QWEN, "qwen2.attention.layer_norm_rms_epsilon", F32, -1.0),
     "layer_norm_rms_epsilon is -1.0, not a small positive number"),
    ("nan eps", lambda: _kv(GEMMA, "gemma3.attention.layer_norm_rms_epsilon", F32, math.nan), "is nan"),
    ("key length", lambda: _kv(QWEN, "qwen2.attention.key_length", U32, 7),
     "its attention heads are 7 wide for keys, 16 for values and rotate 7 dimensions, which qwen2 models need equal"),
    ("rope dims", lambda: _kv(QWEN, "qwen2.rope.dimension_count", U32, 8), "rotate 8 dimensions"),
    ("gemma3 rope dims 0 (a hang)", lambda: _kv(GEMMA, "gemma3.rope.dimension_count", U32, 0),
     "key gemma3.rope.dimension_count is 0, not an even number of dimensions from 2 to the head size 32"),
    ("gemma3 rope dims odd", lambda: _kv(GEMMA, "gemma3.rope.dimension_count", U32, 7), "is 7, not an even number"),
    ("gemma3 rope dims over the head", lambda: _kv(GEMMA, "gemma3.rope.dimension_count", U32, 64), "is 64, not an even"),
    ("alignment 1", lambda: _kv(QWEN, "general.alignment", U32, 1), "not a multiple of 32 (general.alignment is too small)"),
    ("duplicate token", lambda: _kv(QWEN, "tokenizer.ggml.tokens", ARRAY,
                                    QWEN.get("tokenizer.ggml.tokens").value[:-1] + ("a",), STRING),
     "tokens 97 and 304 of its vocabulary are both b'a'"),
    ("token with NUL", lambda: _kv(QWEN, "tokenizer.ggml.tokens", ARRAY,
                                   ("b\0x",) + QWEN.get("tokenizer.ggml.tokens").value[1:], STRING),
     "tokens 0 and 98 of its vocabulary are both b'b'"),
    ("empty token named like its placeholder", lambda: _kv(
        QWEN, "tokenizer.ggml.tokens", ARRAY, ("", "[EMPTY_0]") + QWEN.get("tokenizer.ggml.tokens").value[2:], STRING),
     "tokens 0 and 1 of its vocabulary are both b'[EMPTY_0]'"),
    ("SentencePiece without byte tokens", lambda: _kv(QWEN, "tokenizer.ggml.model", STRING, "llama"),
     "has no token for byte 0x00 to fall back to"),
    ("RWKV vocabulary", lambda: _kv(QWEN, "tokenizer.ggml.model", STRING, "rwkv"), "an RWKV vocabulary"),
    ("bert over SentencePiece byte tokens", lambda: _kv(GEMMA, "tokenizer.ggml.model", STRING, "bert"),
     "its 'bert' vocabulary marks tokens as bytes (token type 6)"),
    ("bert with one byte token", lambda: _kv(_kv(QWEN, "tokenizer.ggml.model", STRING, "bert"),
                                             "tokenizer.ggml.token_type", ARRAY,
                                             (6,) + QWEN.get("tokenizer.ggml.token_type").value[1:], I32),
     "its 'bert' vocabulary marks tokens as bytes (token type 6)"),
    ("F16 norm", lambda: _tensor(QWEN, "output_norm.weight", ggml_type=1,
                                 data=next(t for t in QWEN.tensors if t.name == "output_norm.weight").data[:128]),
     "tensor 'output_norm.weight' is a vector (a norm or a bias) stored as F16, where llama.cpp needs F32"),
    ("I32 matrix", lambda: _tensor(QWEN, "blk.0.attn_q.weight", ggml_type=26),
     "tensor 'blk.0.attn_q.weight' is stored as I32, a type no model weight has"),
]


@pytest.mark.parametrize("make, problem", [c[1:] for c in CRASHERS], ids=[c[0] for c in CRASHERS])
def test_files_that_crash_llamacpp_are_refused(tmp_path, make, problem):
    message = refused(tmp_path, make())
    assert problem in message, message
    assert message.endswith("which would crash llama.cpp; the file is damaged or was written by a "
                            "broken converter: download or convert the model again")


@pytest.mark.parametrize("lies, problem", [
    ({"num_tensors": 10**6}, "it claims 1000000 tensors, more than its"),
    ({"num_kv": 10**9}, "key-value pairs, more than its"),
    ({"num_kv": 3}, "tensor 'qwen2.context_length' has 405254745401949610419063"),  # keys read as tensors
    ({"offsets": {0: 16}}, "tensor 'token_embd.weight' has data offset 16, expected 0"),
    ({"offsets": {3: 0}}, "has data offset 0, expected"),  # overlaps the first tensor
    ({"offsets": {5: 2**63}}, "has data offset 9223372036854775808, expected"),
])
def test_lying_counts_and_offsets(tmp_path, lies, problem):
    message = refused(tmp_path, QWEN, **lies)
    assert problem in message, message


# -- property: lying files give ModelLoadError or pass, nothing else -------------------------

_MUTATIONS = {arch: list(semantic_mutations(model)) for arch, model in (("qwen2", QWEN), ("gemma3", GEMMA))}
_u64 = st.one_of(st.sampled_from([0, 1, 31, 32, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]),
                 st.integers(0, 2**64 - 1))


@st.composite
def _lying_model(draw):
    arch = draw(st.sampled_from(sorted(_MUTATIONS)))
    _, model = draw(st.sampled_from(_MUTATIONS[arch]))
    for _ in range(draw(st.integers(0, 3))):  # more edits on top: values, shapes, types
        kind = draw(st.sampled_from(["kv", "shape", "type"]))
        if kind == "kv" and model.kvs:
            key = draw(st.sampled_from([kv.key for kv in model.kvs]))
            _, template = draw(st.sampled_from(REPLACEMENTS))
            model = model.with_kv(replace(template, key=key))
        elif model.tensors:
            i = draw(st.integers(0, len(model.tensors) - 1))
            t = model.tensors[i]
            if kind == "shape":
                t = replace(t, shape=tuple(draw(st.lists(_u64, min_size=0, max_size=5))))
            else:
                t = replace(t, ggml_type=draw(st.integers(0, 45)))
            model = replace(model, tensors=model.tensors[:i] + (t,) + model.tensors[i + 1:])
    lies = {}
    if draw(st.booleans()):
        lies["num_tensors"] = draw(_u64)
    if draw(st.booleans()):
        lies["num_kv"] = draw(_u64)
    if model.tensors and draw(st.booleans()):
        lies["offsets"] = {draw(st.integers(0, len(model.tensors) - 1)): draw(_u64)}
    cut = draw(st.one_of(st.none(), st.integers(0, 1 << 16)))
    data = model.to_bytes(**lies)
    return data if cut is None else data[:cut]


@settings(max_examples=EXAMPLES, deadline=timedelta(seconds=10), derandomize=not DEEP,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=_lying_model())
def test_lying_files_give_model_load_error_or_pass(data):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "lying.gguf"
        path.write_bytes(data)
        try:
            info = check_model(path)
        except ModelLoadError as e:
            assert str(path) in str(e) and "\n" not in str(e)
        else:
            assert isinstance(info, GGUFInfo)
