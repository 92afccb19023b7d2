"""A GGUF file's header, metadata and tensor table, read in pure Python.

llama.cpp aborts the whole process on some malformed files, so a model is read here first:
every count, length and offset is checked against the file's size and against the limits
llama.cpp's own reader (ggml/src/gguf.cpp, llama-cpp-python 0.3.36) enforces, and any
problem becomes one ``ModelLoadError`` naming the file and the problem. Only the header,
the key-value section and the tensor table are read; large arrays (the vocabulary) are
skipped over, and tensor data is never touched.

Layout (little-endian)::

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv times:      string key, u32 type, value  (an array: u32 item type, u64 count, items)
    n_tensors times: string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset
    padding to general.alignment (default 32), then the tensor data, each tensor at its offset

A string is a u64 byte length and that many UTF-8 bytes.
"""

from __future__ import annotations

import array as pyarray
import mmap
import re
import stat
import struct
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from localllm.errors import ModelLoadError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_STRING_LENGTH = 1 << 30  # llama.cpp's GGUF_MAX_STRING_LENGTH
MAX_ARRAY_ELEMENTS = 1 << 30  # GGUF_MAX_ARRAY_ELEMENTS
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME - 1 (the C string's NUL)
MAX_DECODED_ARRAY = 4096  # numeric arrays up to this long are decoded (per-layer values)
INT64_MAX = (1 << 63) - 1

# GGUF value types: id -> (name, struct format); strings and arrays are read apart.
_TYPE_UINT8, _TYPE_BOOL, _TYPE_STRING, _TYPE_ARRAY = 0, 7, 8, 9
_SCALARS = {
    0: ("uint8", "<B"), 1: ("int8", "<b"), 2: ("uint16", "<H"), 3: ("int16", "<h"),
    4: ("uint32", "<I"), 5: ("int32", "<i"), 6: ("float32", "<f"), 7: ("bool", "<B"),
    10: ("uint64", "<Q"), 11: ("int64", "<q"), 12: ("float64", "<d"),
}
_INTEGER_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
_TYPE_NAMES = {**{t: name for t, (name, _) in _SCALARS.items()}, 8: "string", 9: "array"}

# ggml tensor types: id -> (name, elements per block, bytes per block), as libggml reports
# them; the ids llama.cpp removed (4, 5, 31-33, 36-38) are absent.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18), 42: ("Q2_0", 64, 18),
}

# general.file_type: llama.cpp's LLAMA_FTYPE enum, by the names quantized files carry.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 4: "Q4_1_SOME_F16", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
    16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
    22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0", 41: "Q2_0",
}

_SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


@dataclass(frozen=True)
class GGUFArray:
    """An array value that was skipped, not decoded (strings, or too long to be useful)."""

    item_type: str
    length: int


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the table: where its bytes are (from the data section's start)."""

    name: str
    type_name: str  # "F32", "Q4_K", ...
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    offset: int
    num_bytes: int


@dataclass(frozen=True)
class _Part:
    """What one file of a model holds."""

    version: int
    metadata: dict
    size_bytes: int
    num_tensors: int
    num_parameters: int
    tensor_bytes: int
    data_start: int = 0
    tensors: tuple[TensorEntry, ...] = ()
    kept_strings: tuple[bytes, ...] | None = None
    has_byte_tokens: bool = False  # a token of tokenizer.ggml.token_type is BYTE (6)


TOKEN_TYPE_BYTE = 6  # llama.cpp's LLAMA_TOKEN_TYPE_BYTE


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    size_bytes: int  # all split parts together
    version: int
    architecture: str
    name: str | None
    parameters: int  # elements of every tensor, in all parts
    num_tensors: int
    tensor_bytes: int  # the weights as llama.cpp holds them (llama_model_size), in all parts
    context_length: int | None  # the context the model was trained for
    file_type: str | None  # "Q4_K_M", "Q8_0", "F16", ...
    block_count: int | None
    embedding_length: int | None
    head_count: int | None  # the largest, where it is given per layer
    head_count_kv: int | None
    key_length: int | None  # per head; embedding_length / head_count when the file omits it
    value_length: int | None
    sliding_window: int | None
    chat_template: str | None = field(repr=False)
    license: str | None
    split_count: int
    layer_kv_heads: tuple[int, ...] | None = None  # per-layer KV heads, where the file lists them
    metadata: dict = field(default_factory=dict, repr=False)  # every key; skipped arrays as GGUFArray

    @property
    def head_dim(self) -> int | None:
        return self.key_length

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int | None:
        """KV-cache bytes one token takes in every layer: K and V, each kv heads x head dim
        values. Qwen2.5-0.5B at f16: 24 layers x 2 KV heads x (64 + 64) x 2 bytes = 12288.
        None when the file does not describe attention (not a transformer), or no layer has
        KV heads."""
        if self.key_length is None or self.value_length is None:
            return None
        if self.layer_kv_heads is not None:
            num_kv_heads = sum(self.layer_kv_heads)
        elif self.block_count is not None and self.head_count_kv is not None:
            num_kv_heads = self.block_count * self.head_count_kv
        else:
            return None
        return num_kv_heads * (self.key_length + self.value_length) * bytes_per_value or None


# llama.cpp's llama_pooling_type, as a model's {arch}.pooling_type stores it.
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
# Architectures llama.cpp runs as bidirectional text encoders: embedding models all.
ENCODER_ARCHITECTURES = frozenset({
    "bert", "modern-bert", "nomic-bert", "nomic-bert-moe", "neo-bert", "jina-bert-v2",
    "jina-bert-v3", "eurobert",
})


def embedding_pooling(info: GGUFInfo) -> str | None:
    """How an embedding model pools its token vectors into one: "mean", "cls" or "last", as
    {arch}.pooling_type says (Qwen3-Embedding: "last"); None for a model that is not one (a
    chat model, a reranker's "rank"). An encoder whose file names no pooling, or "none",
    pools by mean, as sentence-transformers does by default."""
    value = _get_int(info.path, info.metadata, f"{info.architecture}.pooling_type")
    pooling = POOLING_TYPES.get(value) if value is not None else None
    if pooling in ("mean", "cls", "last"):
        return pooling
    if info.architecture in ENCODER_ARCHITECTURES and pooling in (None, "none"):
        return "mean"
    return None


def read_info(path: str | Path) -> GGUFInfo:
    """The model described by the GGUF file at path (the first part of a split model).

    Raises ModelLoadError for anything that is not a well-formed GGUF model file.
    """
    path = Path(path)
    return _info(path, _read_part(path))


def _info(path: Path, first: _Part) -> GGUFInfo:
    """read_info, from the first part already read."""
    meta = first.metadata
    split_count = _get_count(path, meta, "split.count") or 1
    parts = _split_paths(path, meta, split_count) if split_count > 1 else [path]
    arch = _get_str(path, meta, "general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path} has no general.architecture key, so it is not a model "
                             "llama.cpp can load; use a GGUF model file")
    size_bytes, num_tensors = first.size_bytes, first.num_tensors
    parameters, tensor_bytes = first.num_parameters, first.tensor_bytes
    if split_count > 1:
        for i, part_path in enumerate(parts[1:], start=1):
            part = _read_part(part_path)
            size_bytes += part.size_bytes
            if (_get_int(part_path, part.metadata, "split.no") != i
                    or _get_int(part_path, part.metadata, "split.count") != split_count):
                raise ModelLoadError(f"{part_path} is not part {i + 1} of {split_count} of {path} "
                                     "(its split.no / split.count disagree); download the model again")
            num_tensors += part.num_tensors
            parameters += part.num_parameters
            tensor_bytes += part.tensor_bytes

    def arch_int(key: str) -> int | None:
        return _get_count(path, meta, f"{arch}.{key}")

    block_count = arch_int("block_count")
    embedding_length = arch_int("embedding_length")
    head_counts = _get_ints(path, meta, f"{arch}.attention.head_count")
    kv_head_counts = _get_ints(path, meta, f"{arch}.attention.head_count_kv")
    if kv_head_counts is None:
        kv_head_counts = head_counts  # llama.cpp's default: no grouped-query attention
    head_count = max(head_counts) if head_counts else None
    head_count_kv = max(kv_head_counts) if kv_head_counts else None
    layer_kv_heads = kv_head_counts if kv_head_counts is not None and len(kv_head_counts) > 1 else None
    key_length = arch_int("attention.key_length")
    value_length = arch_int("attention.value_length")
    if key_length is None and embedding_length and head_count:
        key_length = embedding_length // head_count
    if value_length is None:
        value_length = key_length
    file_type_id = _get_int(path, meta, "general.file_type")
    file_type = None
    if file_type_id is not None:
        file_type = FILE_TYPES.get(file_type_id & ~1024, f"FTYPE_{file_type_id}")  # 1024: "guessed"
    return GGUFInfo(
        path=path,
        size_bytes=size_bytes,
        version=first.version,
        architecture=arch,
        name=_get_str(path, meta, "general.name"),
        parameters=parameters,
        num_tensors=num_tensors,
        tensor_bytes=tensor_bytes,
        context_length=arch_int("context_length"),
        file_type=file_type,
        block_count=block_count,
        embedding_length=embedding_length,
        head_count=head_count,
        head_count_kv=head_count_kv,
        key_length=key_length,
        value_length=value_length,
        sliding_window=arch_int("attention.sliding_window"),
        chat_template=_get_str(path, meta, "tokenizer.chat_template"),
        license=_get_str(path, meta, "general.license"),
        split_count=split_count,
        layer_kv_heads=layer_kv_heads,
        metadata=meta,
    )


# -- metadata access -------------------------------------------------------------------------


def _get_int(path: Path, meta: dict, key: str) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{path}: key {key} should be a whole number, not {_describe(value)}; "
                             "the file is damaged or was written by a broken converter")
    return value


def _get_count(path: Path, meta: dict, key: str) -> int | None:
    """A size or a count: a whole number, 0 or more."""
    value = _get_int(path, meta, key)
    if value is not None and value < 0:
        raise ModelLoadError(f"{path}: key {key} is {value}, a negative count; the file is damaged")
    return value


def _get_ints(path: Path, meta: dict, key: str) -> tuple[int, ...] | None:
    """Counts llama.cpp accepts either once or per layer (an array of whole numbers)."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if not (isinstance(value, tuple) and value
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise ModelLoadError(f"{path}: key {key} should be a whole number or a list of them, not "
                             f"{_describe(value)}; the file is damaged")
    if min(value) < 0:
        raise ModelLoadError(f"{path}: key {key} holds {min(value)}, a negative count; the file is damaged")
    return value


def _get_str(path: Path, meta: dict, key: str) -> str | None:
    value = meta.get(key)
    if value is not None and not isinstance(value, str):
        raise ModelLoadError(f"{path}: key {key} should be text, not {_describe(value)}; the file is damaged")
    return value


def _describe(value) -> str:
    if isinstance(value, GGUFArray):
        return f"an array of {value.length} {value.item_type}"
    if isinstance(value, tuple):
        return f"an array of {len(value)} values"
    return f"{type(value).__name__} {value!r}"[:80]


def _split_paths(path: Path, meta: dict, split_count: int) -> list[Path]:
    """The files of a split model, named as llama.cpp's llama_split_path names them."""
    m = _SPLIT_NAME.fullmatch(path.name)
    split_no = _get_count(path, meta, "split.no") or 0
    if m is None or int(m["count"]) != split_count or split_no != 0 or int(m["no"]) != 1:
        raise ModelLoadError(
            f"{path} is part {split_no + 1} of a model split into {split_count} files; pass the "
            f"first part, named like NAME-00001-of-{split_count:05d}.gguf")
    parts = [path.with_name(f"{m['prefix']}-{i:05d}-of-{split_count:05d}.gguf")
             for i in range(1, split_count + 1)]
    for part in parts[1:]:
        if not part.is_file():
            raise ModelLoadError(f"{path} is split into {split_count} files but {part} is missing; "
                                 "download every part into the same folder")
    return parts


# -- one file --------------------------------------------------------------------------------


def tensor_table(path: str | Path) -> tuple[dict, int, tuple[TensorEntry, ...]]:
    """(metadata, offset of the data section, the tensors) of a single-file GGUF model, checked
    as read_info checks it; skipped arrays (the vocabulary) appear as GGUFArray."""
    path = Path(path)
    part = _read_part(path)
    if (_get_count(path, part.metadata, "split.count") or 1) > 1:
        raise ModelLoadError(f"{path} is one part of a split model, which the torch runner does not "
                             "read yet; use --runner llamacpp")
    return part.metadata, part.data_start, part.tensors


def token_texts(path: str | Path) -> tuple[bytes, ...] | None:
    """The raw bytes of every token of the file's vocabulary (tokenizer.ggml.tokens), as
    llama.cpp reads them; None when the file has no such array of strings."""
    path = Path(path)
    return _read_part(path, keep_strings="tokenizer.ggml.tokens").kept_strings


# Headers read lately, by the file's identity: a load reads one file's header three or four
# times (the check, the memory plan, the weights), and a 150k-token vocabulary takes ~80 ms
# to skip each time. A file changed in place has another size or mtime, so it is read again.
# A load checks the file first (gguf_check, which keeps the vocabulary's strings), so its other
# reads find that one.
_PARTS: OrderedDict[tuple, _Part] = OrderedDict()
_PARTS_KEPT = 8
_PARTS_LOCK = threading.Lock()  # models load on worker threads


def _read_part(path: Path, keep_strings: str | None = None) -> _Part:
    try:
        st = path.stat()
        is_file = stat.S_ISREG(st.st_mode)  # a FIFO or a device would block or never end
    except FileNotFoundError:
        raise ModelLoadError(f"model file {path} does not exist; pass the path to a .gguf file") from None
    except OSError as e:
        raise ModelLoadError(f"{path} cannot be read ({e}); pass the path to a readable .gguf file") from None
    if not is_file:
        raise ModelLoadError(f"{path} is not a file; pass the path to a .gguf file")
    key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, keep_strings)
    with _PARTS_LOCK:
        # A read that keeps no strings takes one that kept some: the same header besides them.
        found = key if key in _PARTS else next(
            (k for k in reversed(_PARTS) if keep_strings is None and k[:-1] == key[:-1]), None)
        if found is not None:
            _PARTS.move_to_end(found)
            return _PARTS[found]
    try:
        with open(path, "rb") as f:
            if f.seek(0, 2) == 0:
                raise ModelLoadError(f"{path} is empty, not a GGUF model; download it again")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                part = _Parser(path, buf, keep_strings).parse()
    except (OSError, ValueError) as e:  # permissions, a file that vanished, mmap refusing it
        raise ModelLoadError(f"{path} cannot be read ({e}); pass the path to a readable .gguf file") from None
    with _PARTS_LOCK:
        _PARTS[key] = part
        while len(_PARTS) > _PARTS_KEPT:
            _PARTS.popitem(last=False)
    return part


class _Parser:
    """Reads one GGUF file from a buffer, checking every length before it trusts it."""

    def __init__(self, path: Path, buf, keep_strings: str | None = None) -> None:
        self.path = path
        self.buf = buf
        self.pos = 0
        self.end = len(buf)
        self.keep_strings = keep_strings  # the key of one string array to return as bytes
        self.kept_strings: tuple[bytes, ...] | None = None
        self.has_byte_tokens = False

    def fail(self, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path} is not a valid GGUF file: {problem}; "
                              "download it again or convert the model again")

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise self.fail(f"it ends inside {what} (at byte {self.pos} of {self.end}: "
                            f"{n} bytes needed, {self.end - self.pos} left); the file is truncated")

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        if n > MAX_STRING_LENGTH:
            raise self.fail(f"{what} claims to be {n} bytes long (at most {MAX_STRING_LENGTH})")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 (byte 0x{raw[e.start]:02x} at byte "
                            f"{self.pos + e.start})") from None
        self.pos += n
        return text

    # -- sections -------------------------------------------------------------------------

    def parse(self) -> _Part:
        self.need(4, "the magic bytes")
        magic = bytes(self.buf[:4])
        if magic != MAGIC:
            raise ModelLoadError(f"{self.path} is not a GGUF file (bad magic {magic!r}, expected b'GGUF'); "
                                 "pass a .gguf model file")
        self.pos = 4
        version = self.u32("the version")
        if version & 0xFFFF == 0 and version:
            raise self.fail(f"version {version:#x} looks byte-swapped: a big-endian GGUF file, "
                            "which this machine cannot load")
        if version not in SUPPORTED_VERSIONS:
            raise self.fail(f"GGUF version {version} is not supported (only versions "
                            f"{' and '.join(map(str, SUPPORTED_VERSIONS))})")
        num_tensors = self.u64("the tensor count")
        num_kv = self.u64("the key-value count")
        # Each pair takes at least 14 bytes (key length, a 1-byte key, type, a 1-byte value),
        # each tensor 25 (name length, a 1-byte name, dims count, type, offset).
        if num_kv > (self.end - self.pos) // 14:
            raise self.fail(f"it claims {num_kv} key-value pairs, more than its {self.end} bytes could hold")
        if num_tensors > (self.end - self.pos) // 25:
            raise self.fail(f"it claims {num_tensors} tensors, more than its {self.end} bytes could hold")
        metadata, value_types = self.key_values(num_kv)
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (value_types.get("general.alignment", 4) != 4 or alignment <= 0
                or alignment & (alignment - 1)):
            raise self.fail(f"general.alignment {alignment!r} is not a power of two stored as uint32")
        num_parameters, tensor_bytes, data_size = self.tensor_infos(num_tensors, alignment)
        data_start = -(-self.pos // alignment) * alignment
        if num_tensors and data_start + data_size > self.end:
            raise self.fail(f"its tensor data needs {data_start + data_size} bytes but the file has "
                            f"{self.end}; the file is truncated")
        return _Part(version=version, metadata=metadata, size_bytes=self.end, num_tensors=num_tensors,
                     num_parameters=num_parameters, tensor_bytes=tensor_bytes, data_start=data_start,
                     tensors=tuple(self.tensors), kept_strings=self.kept_strings,
                     has_byte_tokens=self.has_byte_tokens)

    def key_values(self, num_kv: int) -> tuple[dict, dict[str, int]]:
        """The metadata, and each key's GGUF value type."""
        metadata: dict = {}
        value_types: dict[str, int] = {}
        for i in range(num_kv):
            key = self.string(f"key {i}")
            if not key:
                raise self.fail(f"key {i} is empty")
            if key in metadata:
                raise self.fail(f"key {key!r} appears twice")
            value_type = self.u32(f"the type of {key!r}")
            if value_type == _TYPE_ARRAY:
                metadata[key] = self.array(key)
            elif value_type == _TYPE_STRING:
                metadata[key] = self.string(f"the value of {key!r}")
            elif value_type in _SCALARS:
                fmt = _SCALARS[value_type][1]
                value = self.unpack(fmt, struct.calcsize(fmt), f"the value of {key!r}")
                metadata[key] = bool(value) if value_type == _TYPE_BOOL else value
            else:
                raise self.fail(f"key {key!r} has unknown value type {value_type}")
            value_types[key] = value_type
        return metadata, value_types

    def array(self, key: str):
        item_type = self.u32(f"the item type of {key!r}")
        length = self.u64(f"the length of {key!r}")
        if item_type == _TYPE_ARRAY:
            raise self.fail(f"key {key!r} is an array of arrays, which llama.cpp does not read")
        if item_type != _TYPE_STRING and item_type not in _SCALARS:
            raise self.fail(f"key {key!r} is an array of unknown value type {item_type}")
        if length > MAX_ARRAY_ELEMENTS:
            raise self.fail(f"array {key!r} claims {length} items (at most {MAX_ARRAY_ELEMENTS})")
        item_size = 8 if item_type == _TYPE_STRING else struct.calcsize(_SCALARS[item_type][1])
        if length * item_size > self.end - self.pos:
            raise self.fail(f"array {key!r} claims {length} items, more than the rest of the file "
                            f"could hold; the file is truncated or damaged")
        if item_type == _TYPE_STRING:
            kept = self.skip_strings(key, length, keep=key == self.keep_strings)
            if kept is not None:
                self.kept_strings = kept
            return GGUFArray("string", length)
        if key == "tokenizer.ggml.token_type" and _SCALARS[item_type][0] == "int32":
            types = pyarray.array("i")  # a whole vocabulary's: read in C, not decoded one by one
            types.frombytes(self.buf[self.pos:self.pos + length * 4])
            if sys.byteorder == "big":
                types.byteswap()
            self.has_byte_tokens = TOKEN_TYPE_BYTE in types
        if length > MAX_DECODED_ARRAY:
            self.pos += length * item_size  # bounds checked above
            return GGUFArray(_SCALARS[item_type][0], length)
        fmt = _SCALARS[item_type][1]
        values = struct.unpack_from(f"<{length}{fmt[1]}", self.buf, self.pos)
        self.pos += length * item_size
        if item_type == _TYPE_BOOL:
            values = tuple(bool(v) for v in values)
        return values

    def skip_strings(self, key: str, count: int, keep: bool = False) -> tuple[bytes, ...] | None:
        """Steps over count strings (a vocabulary: 150k of them) without decoding them; with
        keep, returns their raw bytes."""
        pos, end, buf = self.pos, self.end, self.buf
        unpack_from = struct.unpack_from
        kept: list[bytes] | None = [] if keep else None
        for i in range(count):
            if end - pos < 8:
                self.pos = pos
                self.need(8, f"the length of item {i} of {key!r}")
            n = unpack_from("<Q", buf, pos)[0]
            pos += 8
            if n > MAX_STRING_LENGTH or n > end - pos:
                self.pos = pos
                raise self.fail(f"item {i} of {key!r} claims to be {n} bytes long, but "
                                f"{end - pos} bytes are left; the file is truncated or damaged")
            if kept is not None:
                kept.append(buf[pos:pos + n])
            pos += n
        self.pos = pos
        return tuple(kept) if kept is not None else None

    def tensor_infos(self, num_tensors: int, alignment: int) -> tuple[int, int, int]:
        """Checks the tensor table as llama.cpp does; returns (elements, tensor bytes, bytes
        of the data section up to the end of the last tensor)."""
        names: set[str] = set()
        self.tensors: list[TensorEntry] = []
        num_parameters = tensor_bytes = data_size = 0
        for i in range(num_tensors):
            name = self.string(f"the name of tensor {i}")
            if len(name.encode("utf-8")) > MAX_NAME_BYTES:
                raise self.fail(f"tensor {i}'s name is {len(name.encode())} bytes long (at most {MAX_NAME_BYTES})")
            if name in names:
                raise self.fail(f"tensor name {name!r} appears twice")
            names.add(name)
            num_dims = self.u32(f"the dimension count of tensor {name!r}")
            if num_dims > MAX_DIMS:
                raise self.fail(f"tensor {name!r} has {num_dims} dimensions (at most {MAX_DIMS})")
            shape = [self.u64(f"the shape of tensor {name!r}") for _ in range(num_dims)]
            num_elements = 1
            for n in shape:
                if n > INT64_MAX:
                    raise self.fail(f"tensor {name!r} has a negative dimension")
                num_elements *= n
            if num_elements > INT64_MAX:
                raise self.fail(f"tensor {name!r} has {num_elements} elements, more than llama.cpp can count")
            ggml_type = self.u32(f"the type of tensor {name!r}")
            if ggml_type not in GGML_TYPES:
                raise self.fail(f"tensor {name!r} has unknown ggml type {ggml_type}")
            type_name, block, block_bytes = GGML_TYPES[ggml_type]
            row = shape[0] if shape else 1
            if row % block:
                raise self.fail(f"tensor {name!r} of type {type_name} has rows of {row} elements, "
                                f"not a multiple of its block size {block}")
            offset = self.u64(f"the data offset of tensor {name!r}")
            if offset != data_size:  # llama.cpp wants the tensors in order, each padded
                raise self.fail(f"tensor {name!r} has data offset {offset}, expected {data_size}")
            num_bytes = num_elements // block * block_bytes
            data_size += -(-num_bytes // alignment) * alignment
            if i == num_tensors - 1:
                data_size = offset + num_bytes  # the last tensor needs no padding after it
            num_parameters += num_elements
            tensor_bytes += num_bytes
            self.tensors.append(TensorEntry(name, type_name, tuple(shape), offset, num_bytes))
        return num_parameters, tensor_bytes, data_size

