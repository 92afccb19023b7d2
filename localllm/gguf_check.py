"""What llama.cpp needs of a model beyond a well-formed GGUF container, checked before it
sees the file.

localllm.gguf checks the container (header, key-value section, tensor table, sizes); a file
that passes it can still say things that make llama.cpp (llama-cpp-python 0.3.36) kill the
process with GGML_ASSERT / GGML_ABORT or a bad read instead of returning an error: a block
count of 0 or over 512, experts used but none defined, a negative or NaN norm epsilon, head
sizes its graph builder asserts equal, a vocabulary with a token twice, a norm weight stored
as F16, a matrix of integers, tensor data not 32-byte aligned in the file. Each rule below is
one such abort found by scripts/fuzz_gguf_llamacpp.py; each gives one ModelLoadError naming
the file, the key or tensor, and the fix.

The rules cover what the fuzz reaches (the qwen2, llama and gemma3 families and every
architecture's shared hyper-parameters); llama.cpp has some 600 asserts in its architecture
code, and a file lying about an architecture-specific key can still reach one.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

from localllm.errors import ModelLoadError
from localllm.gguf import GGUFInfo, _info, _read_part, _split_paths

MAX_LAYERS = 512  # LLAMA_MAX_LAYERS
MAX_EXPERTS = 1024  # LLAMA_MAX_EXPERTS
TENSOR_ALIGNMENT = 32  # ggml's TENSOR_ALIGNMENT: an mmap-ed tensor's address must be a multiple

# Architectures whose graph builder asserts head size (K and V) == rope dimensions
# (src/models/*.cpp: GGML_ASSERT(n_embd_head == n_rot) and n_embd_head_k == n_embd_head_v).
_EQUAL_HEAD_DIMS = frozenset((
    "apertus arcee arctic baichuan chameleon codeshell cogvlm cohere2moe dbrx deci deepseek dots1 "
    "dream ernie4_5 ernie4_5-moe exaone exaone-moe exaone4 falcon granite granite_swa grok grovemoe "
    "hunyuan-moe hunyuan_vl hy_v3 internlm2 jais2 llada llada-moe llama llama4 maincoder mellum "
    "minimax-01 minimax-m2 mistral3 nemotron olmo olmo2 olmoe orion paddleocr plamo pockettts "
    "qwen2 qwen2moe qwen2vl qwen3 qwen3moe qwen3vl qwen3vlmoe rnd1 seed_oss smallthinker smollm3 "
    "starcoder2 talkie xverse"
).split())
# ggml types no llama.cpp weight is stored in: the integer types and F64 (I8 .. I64, F64).
_NOT_WEIGHT_TYPES = frozenset({"I8", "I16", "I32", "I64", "F64"})


# The last single-file models that passed, by their header as read (localllm.gguf keeps it
# per file identity): a load checks its file where the runner is chosen and again in the runner.
_PASSED: dict[int, tuple[object, GGUFInfo]] = {}
_PASSED_LOCK = threading.Lock()  # models load on worker threads


def check_model(path: str | Path) -> GGUFInfo:
    """localllm.gguf.read_info, and the rules above. Raises ModelLoadError; returns the model's info."""
    path = Path(path)
    first = _read_part(path, keep_strings="tokenizer.ggml.tokens")
    with _PASSED_LOCK:
        passed = _PASSED.get(id(first))
    if passed is not None and passed[0] is first:
        return passed[1]
    info = _check(path, first)
    if info.split_count == 1:  # (a split model's other files are not in the header's identity)
        with _PASSED_LOCK:
            _PASSED[id(first)] = (first, info)  # (holding the header keeps its id its own)
            while len(_PASSED) > 8:
                del _PASSED[next(iter(_PASSED))]
    return info


def _check(path: Path, first) -> GGUFInfo:
    info = _info(path, first)
    meta, arch = info.metadata, info.architecture
    _check_hparams(path, meta, arch, info)
    part_paths = _split_paths(path, meta, info.split_count) if info.split_count > 1 else [path]
    for part_path in part_paths:
        _check_tensors(part_path, first if part_path == path else _read_part(part_path))
    if first.kept_strings is not None:
        _check_vocabulary(path, meta, first.kept_strings)
    if first.has_byte_tokens and meta.get("tokenizer.ggml.model") == "bert":
        # A WordPiece vocabulary's token_to_byte aborts while llama.cpp caches every token's
        # text at load (a gpt2 one with byte tokens is refused by llama.cpp itself, cleanly).
        raise _fail(path, "its 'bert' vocabulary marks tokens as bytes (token type 6), which only "
                          "SentencePiece vocabularies (tokenizer.ggml.model llama or t5) have")
    return info


def _fail(path: Path, problem: str) -> ModelLoadError:
    return ModelLoadError(f"{path} cannot be loaded: {problem}, which would crash llama.cpp; "
                          "the file is damaged or was written by a broken converter: download or "
                          "convert the model again")


def _counts(path: Path, meta: dict, key: str) -> tuple[int, ...] | None:
    """A count given once or per layer, as whole numbers (llama.cpp reads a bool as 0/1)."""
    value = meta.get(key)
    if value is None:
        return None
    values = value if isinstance(value, tuple) else (value,)
    if not values or not all(isinstance(v, int) and v >= 0 for v in values):  # bool is an int here
        raise _fail(path, f"key {key} is {_short(value)}, not a count or a list of counts")
    return tuple(int(v) for v in values)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_hparams(path: Path, meta: dict, arch: str, info: GGUFInfo) -> None:
    block_count = _counts(path, meta, f"{arch}.block_count")
    if block_count is not None and not (len(block_count) == 1 and 0 < block_count[0] <= MAX_LAYERS):
        raise _fail(path, f"key {arch}.block_count is {_short(meta[f'{arch}.block_count'])}, not a layer "
                          f"count from 1 to {MAX_LAYERS}")
    n_layer = block_count[0] if block_count else 0
    nextn = _counts(path, meta, f"{arch}.nextn_predict_layers")
    if nextn is not None and max(nextn) > n_layer:
        raise _fail(path, f"key {arch}.nextn_predict_layers is {max(nextn)}, more than the {n_layer} layers")

    n_expert = max(_counts(path, meta, f"{arch}.expert_count") or (0,))
    n_used = max(_counts(path, meta, f"{arch}.expert_used_count") or (0,))
    n_groups = max(_counts(path, meta, f"{arch}.expert_group_count") or (0,))
    n_group_used = max(_counts(path, meta, f"{arch}.expert_group_used_count") or (0,))
    if n_expert > MAX_EXPERTS:
        raise _fail(path, f"it claims {n_expert} experts (llama.cpp allows at most {MAX_EXPERTS})")
    if n_used > n_expert or (n_expert and not n_used):
        raise _fail(path, f"it uses {n_used} of {n_expert} experts per token "
                          f"({arch}.expert_used_count must be 1 to {arch}.expert_count when there are experts, 0 when not)")
    if n_groups and (n_groups >= n_expert or (n_groups > 1 and (
            n_expert % n_groups or not 0 < n_group_used < n_groups))):
        raise _fail(path, f"its {n_expert} experts cannot form {n_groups} groups with {n_group_used} used")

    for key in (f"{arch}.attention.layer_norm_rms_epsilon", f"{arch}.attention.layer_norm_epsilon"):
        eps = meta.get(key)
        if isinstance(eps, float) and not (math.isfinite(eps) and eps >= 0):
            raise _fail(path, f"key {key} is {eps}, not a small positive number")

    rope = _counts(path, meta, f"{arch}.rope.dimension_count")
    if rope is not None and info.head_count:
        head_k = info.key_length or 0
        if len(rope) != 1 or not 0 < rope[0] <= head_k or rope[0] % 2:
            raise _fail(path, f"key {arch}.rope.dimension_count is {_short(meta[f'{arch}.rope.dimension_count'])}, "
                              f"not an even number of dimensions from 2 to the head size {head_k}")
    if arch in _EQUAL_HEAD_DIMS and info.head_count:
        n_embd = info.embedding_length or 0
        key_length = _counts(path, meta, f"{arch}.attention.key_length")
        value_length = _counts(path, meta, f"{arch}.attention.value_length")
        head_k = key_length[0] if key_length else n_embd // info.head_count
        head_v = value_length[0] if value_length else n_embd // info.head_count
        rope = _counts(path, meta, f"{arch}.rope.dimension_count")
        n_rot = rope[0] if rope else head_k
        if not (head_k == head_v == n_rot) or head_k == 0:
            raise _fail(path, f"its attention heads are {head_k} wide for keys, {head_v} for values "
                              f"and rotate {n_rot} dimensions, which {arch} models need equal and above 0")


def _check_tensors(path: Path, part) -> None:
    for t in part.tensors:
        if t.type_name in _NOT_WEIGHT_TYPES:
            raise _fail(path, f"tensor {t.name!r} is stored as {t.type_name}, a type no model weight has")
        if len(t.shape) == 1 and t.type_name != "F32":
            raise _fail(path, f"tensor {t.name!r} is a vector (a norm or a bias) stored as {t.type_name}, "
                              "where llama.cpp needs F32")
        if (part.data_start + t.offset) % TENSOR_ALIGNMENT:
            raise _fail(path, f"tensor {t.name!r} starts at byte {part.data_start + t.offset}, not a "
                              f"multiple of {TENSOR_ALIGNMENT} (general.alignment is too small)")


def _check_vocabulary(path: Path, meta: dict, tokens: tuple[bytes, ...]) -> None:
    """llama.cpp keys its vocabulary by each token's text as a C string (cut at a NUL byte; an
    empty one renamed [EMPTY_i]) and asserts no two are the same."""
    seen = set(tokens)
    if len(seen) != len(tokens) or b"" in seen or b"\0" in b"".join(tokens):
        first_at: dict[bytes, int] = {}  # the slow path, only for a vocabulary that needs it
        for i, raw in enumerate(tokens):
            text = raw.split(b"\0", 1)[0] or f"[EMPTY_{i}]".encode()
            j = first_at.setdefault(text, i)
            if j != i:
                raise _fail(path, f"tokens {j} and {i} of its vocabulary are both {text[:40]!r}")
        seen = set(first_at)
    model = meta.get("tokenizer.ggml.model")
    if model == "llama":  # SentencePiece: every byte must have a token to fall back to
        missing = [b for b in range(256)
                   if f"<0x{b:02X}>".encode() not in seen and bytes([b]) not in seen]
        if missing:
            raise _fail(path, f"its SentencePiece vocabulary (tokenizer.ggml.model llama) has no "
                              f"token for byte 0x{missing[0]:02X} to fall back to")
    if model == "rwkv" and not str(meta.get("general.architecture", "")).startswith("rwkv"):
        raise _fail(path, "it has an RWKV vocabulary (tokenizer.ggml.model rwkv) on a "
                          f"{meta.get('general.architecture')} model")
