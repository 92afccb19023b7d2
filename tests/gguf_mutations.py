"""Well-formed GGUF files that lie: a model read into plain values, edited, written back.

The byte-level damage of tests/unit/test_gguf.py is caught by the parser; these edits keep
the file a valid GGUF container and change what it says (a key's type or value, a vocabulary
with a duplicate token, a tensor of the wrong shape), which is what reaches llama.cpp's model
loader and graph builder, where some of it aborts the process.

    model = read_model(write_tiny_gguf(path, "qwen2"))
    for name, edited in semantic_mutations(model):
        data = edited.to_bytes()
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace

import gguf
import numpy as np

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12
_FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
            U64: "<Q", I64: "<q", F64: "<d"}


@dataclass(frozen=True)
class KV:
    key: str
    value_type: int
    value: object  # a scalar, a str, or (for ARRAY) a tuple of items
    item_type: int | None = None  # for ARRAY


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying first
    ggml_type: int
    data: bytes


@dataclass(frozen=True)
class Model:
    kvs: tuple[KV, ...]
    tensors: tuple[Tensor, ...]
    alignment: int = 32

    def get(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def with_kv(self, kv: KV) -> Model:
        """Replace the key (keeping its place) or add it at the end."""
        if self.get(kv.key) is None:
            return replace(self, kvs=self.kvs + (kv,))
        return replace(self, kvs=tuple(kv if k.key == kv.key else k for k in self.kvs))

    def without(self, key: str) -> Model:
        return replace(self, kvs=tuple(k for k in self.kvs if k.key != key))

    def to_bytes(self, *, num_tensors: int | None = None, num_kv: int | None = None,
                 offsets: dict[int, int] | None = None) -> bytes:
        """The file; num_tensors, num_kv and offsets (tensor index -> data offset) lie where given."""
        out = [b"GGUF", struct.pack("<IQQ", 3, len(self.tensors) if num_tensors is None else num_tensors,
                                    len(self.kvs) if num_kv is None else num_kv)]
        for kv in self.kvs:
            out += [_string(kv.key), struct.pack("<I", kv.value_type)]
            if kv.value_type == ARRAY:
                out.append(struct.pack("<IQ", kv.item_type, len(kv.value)))
                out += [_scalar(kv.item_type, v) for v in kv.value]
            else:
                out.append(_scalar(kv.value_type, kv.value))
        offset = 0
        for i, t in enumerate(self.tensors):
            written = (offsets or {}).get(i, offset)
            out += [_string(t.name), struct.pack("<I", len(t.shape)),
                    b"".join(struct.pack("<Q", n) for n in t.shape), struct.pack("<IQ", t.ggml_type, written)]
            offset += _padded(len(t.data), self.alignment)
        head = b"".join(out)
        body = [head, b"\0" * (-len(head) % self.alignment)]
        for t in self.tensors:
            body += [t.data, b"\0" * (-len(t.data) % self.alignment)]
        return b"".join(body)


def _padded(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _string(text: str | bytes) -> bytes:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _scalar(value_type: int, value) -> bytes:
    if value_type == STRING:
        return _string(value)
    return struct.pack(_FORMATS[value_type], value)


def read_model(path) -> Model:
    reader = gguf.GGUFReader(path)
    kvs = []
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue
        types = [int(t) for t in field.types]
        value = field.contents()
        if types[0] == ARRAY:
            kvs.append(KV(field.name, ARRAY, tuple(value), types[1]))
        else:
            kvs.append(KV(field.name, types[0], value))
    tensors = tuple(Tensor(t.name, tuple(int(n) for n in t.shape), int(t.tensor_type),
                           bytes(np.asarray(t.data).tobytes())) for t in reader.tensors)
    return Model(tuple(kvs), tensors, reader.alignment)


# -- the edits -------------------------------------------------------------------------------

# Values of every type, the edges llama.cpp's loader meets in counts, ids and sizes.
REPLACEMENTS: tuple[tuple[str, KV], ...] = tuple(
    (label, KV("", value_type, value, item_type)) for label, value_type, value, item_type in (
        ("u32 0", U32, 0, None), ("u32 1", U32, 1, None), ("u32 7", U32, 7, None),
        ("u32 513", U32, 513, None), ("u32 65536", U32, 65536, None),
        ("u32 2^31", U32, 2**31, None), ("u32 max", U32, 2**32 - 1, None),
        ("i32 -1", I32, -1, None), ("u64 2^40", U64, 2**40, None), ("i64 -1", I64, -1, None),
        ("f32 0", F32, 0.0, None), ("f32 -1", F32, -1.0, None), ("f32 nan", F32, float("nan"), None),
        ("f32 inf", F32, float("inf"), None), ("f32 1e30", F32, 1e30, None),
        ("bool true", BOOL, True, None), ("str empty", STRING, "", None), ("str x", STRING, "x", None),
        ("arr u32 []", ARRAY, (), U32), ("arr u32 [0]", ARRAY, (0,), U32),
        ("arr u32 [1]*3", ARRAY, (1, 1, 1), U32), ("arr u32 [2]*700", ARRAY, (2,) * 700, U32),
        ("arr i32 [-1]*6", ARRAY, (-1,) * 6, I32), ("arr f32 [1]*2", ARRAY, (1.0, 1.0), F32),
        ("arr str ['']", ARRAY, ("",), STRING), ("arr bool [t]*6", ARRAY, (True,) * 6, BOOL),
    )
)


def semantic_mutations(model: Model) -> Iterator[tuple[str, Model]]:
    """Every edit this module knows, as (label, edited model); deterministic order."""
    for kv in model.kvs:
        yield f"drop {kv.key}", model.without(kv.key)
        for label, template in REPLACEMENTS:
            yield f"{kv.key} = {label}", model.with_kv(replace(template, key=kv.key))
    arch = model.get("general.architecture").value
    for key in (f"{arch}.expert_count", f"{arch}.expert_used_count", f"{arch}.attention.key_length",
                f"{arch}.attention.value_length", f"{arch}.rope.dimension_count",
                f"{arch}.attention.sliding_window", f"{arch}.vocab_size", f"{arch}.embedding_length_per_layer_input",
                "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.precompiled_charsmap", "tokenizer.ggml.suppress_tokens",
                "general.alignment", "split.count"):
        if model.get(key) is None:
            for label, template in REPLACEMENTS:
                yield f"add {key} = {label}", model.with_kv(replace(template, key=key))
    yield from _vocab_mutations(model)
    yield from _tensor_mutations(model)


def _vocab_mutations(model: Model) -> Iterator[tuple[str, Model]]:
    tokens = model.get("tokenizer.ggml.tokens")
    n = len(tokens.value)
    list_kv = lambda values: replace(tokens, value=tuple(values))  # noqa: E731
    yield "duplicate token", model.with_kv(list_kv(tokens.value[:-1] + (tokens.value[0],)))
    yield "duplicate token at start", model.with_kv(list_kv((tokens.value[1],) + tokens.value[1:]))
    yield "empty tokens", model.with_kv(list_kv(("",) * 3 + tokens.value[3:]))
    yield "empty token named like its placeholder", model.with_kv(
        list_kv(("", "[EMPTY_0]") + tokens.value[2:]))
    yield "one token short", model.with_kv(list_kv(tokens.value[:-1]))
    yield "one token more", model.with_kv(list_kv(tokens.value + ("extra",)))
    yield "no tokens", model.with_kv(list_kv(()))
    yield "invalid utf-8 token", model.with_kv(list_kv((b"\xff\xfe",) + tokens.value[1:]))
    yield "token with NUL", model.with_kv(list_kv(("a\0b",) + tokens.value[1:]))
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        kv = model.get(key)
        if kv is not None:
            yield f"{key} one short", model.with_kv(replace(kv, value=kv.value[:-1]))
            yield f"{key} empty", model.with_kv(replace(kv, value=()))
    token_type = model.get("tokenizer.ggml.token_type")
    if token_type is not None:
        yield "token types all control", model.with_kv(replace(token_type, value=(3,) * n))
        yield "token types out of range", model.with_kv(replace(token_type, value=(99,) * n))
        yield "token types all unused", model.with_kv(replace(token_type, value=(5,) * n))
        yield "token types all byte", model.with_kv(replace(token_type, value=(6,) * n))
    merges = model.get("tokenizer.ggml.merges")
    if merges is not None:
        yield "merge empty", model.with_kv(replace(merges, value=("",) + merges.value[1:]))
        yield "merge without space", model.with_kv(replace(merges, value=("ab",) + merges.value[1:]))
        yield "merge of unknown pieces", model.with_kv(replace(merges, value=("zz qq",) + merges.value[1:]))
        yield "merge leading space", model.with_kv(replace(merges, value=(" a",) + merges.value[1:]))
        yield "no merges", model.with_kv(replace(merges, value=()))
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
                "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.eot_token_id"):
        for value in (n, n + 1000, 2**31 - 1, 2**32 - 1):
            yield f"{key} = {value}", model.with_kv(KV(key, U32, value))
    for model_name in ("llama", "gpt2", "bert", "t5", "rwkv", "plamo2", "none", "unknown-x"):
        yield f"tokenizer.ggml.model = {model_name}", model.with_kv(KV("tokenizer.ggml.model", STRING, model_name))
    for pre in ("default", "llama3", "deepseek-llm", "kimi-k2", "nonsense"):
        yield f"tokenizer.ggml.pre = {pre}", model.with_kv(KV("tokenizer.ggml.pre", STRING, pre))


def _tensor_mutations(model: Model) -> Iterator[tuple[str, Model]]:
    tensors = model.tensors

    def with_tensors(new) -> Model:
        return replace(model, tensors=tuple(new))

    for i, t in enumerate(tensors[:6]):
        yield f"drop tensor {t.name}", with_tensors(tensors[:i] + tensors[i + 1:])
        if len(t.shape) == 2:
            yield f"transpose {t.name}", with_tensors(
                tensors[:i] + (replace(t, shape=t.shape[::-1]),) + tensors[i + 1:])
            yield f"reshape {t.name} 3-d", with_tensors(
                tensors[:i] + (replace(t, shape=(t.shape[0], t.shape[1], 1)),) + tensors[i + 1:])
            half = replace(t, shape=(t.shape[0], t.shape[1] // 2), data=t.data[:len(t.data) // 2])
            yield f"halve {t.name}", with_tensors(tensors[:i] + (half,) + tensors[i + 1:])
        elif len(t.shape) == 1:
            yield f"{t.name} as 2-d", with_tensors(
                tensors[:i] + (replace(t, shape=(t.shape[0], 1)),) + tensors[i + 1:])
            yield f"{t.name} zero-sized", with_tensors(tensors[:i] + (replace(t, shape=(0,), data=b""),) + tensors[i + 1:])
        if t.ggml_type == 0:  # F32 -> F16 keeps the element count, halves the bytes
            yield f"{t.name} as F16", with_tensors(
                tensors[:i] + (replace(t, ggml_type=1, data=t.data[:len(t.data) // 2]),) + tensors[i + 1:])
            yield f"{t.name} as I32", with_tensors(tensors[:i] + (replace(t, ggml_type=26),) + tensors[i + 1:])
    yield "rename a tensor", with_tensors((replace(tensors[0], name="nonsense.weight"),) + tensors[1:])
    yield "extra tensor", with_tensors(tensors + (Tensor("blk.99.attn_q.weight", (8,), 0, b"\0" * 32),))
    yield "no tensors", with_tensors(())
