"""The pure-Python GGUF reader: exact values from files the `gguf` package writes, one
ModelLoadError (naming the file and the problem) for every kind of malformed file, and a
property test that random damage never gets anything else out of it."""

from __future__ import annotations

import os
import struct
import tempfile
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

from localllm.errors import ModelLoadError  # noqa: E402
from localllm.gguf import GGUFArray, GGUFInfo, read_info  # noqa: E402

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
TOKENS = ["<s>", "</s>", "a", "b", "ab", "héllo", "世界"]


def write_tiny(path: Path, *, arch: str = "llama", head_count_kv=2, extra=None,
               split_max_tensors: int = 0) -> Path:
    """A 2-layer model: 4 heads of 16 (embedding 64), 2 KV heads, 7 tokens, 5 tensors."""
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_name("Tiny Test")
    w.add_license("apache-2.0")
    w.add_context_length(2048)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    if head_count_kv is not None:
        w.add_head_count_kv(head_count_kv)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_token_list(TOKENS)
    w.add_chat_template(TEMPLATE)
    for add in extra or ():
        add(w)
    w.add_tensor("token_embd.weight", np.zeros((7, 64), dtype=np.float32))  # 448 elements
    w.add_tensor("blk.0.attn_q.weight", np.ones((64, 64), dtype=np.float16))  # 4096
    w.add_tensor("blk.1.attn_q.weight", np.ones((64, 64), dtype=np.float16))  # 4096
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))  # 64
    w.add_tensor("output.weight", np.zeros((7, 64), dtype=np.float32))  # 448
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TINY_PARAMETERS = 448 + 4096 + 4096 + 64 + 448
TINY_TENSOR_BYTES = 448 * 4 + 4096 * 2 + 4096 * 2 + 64 * 4 + 448 * 4


def test_tiny_model_exact_values(tmp_path):
    path = write_tiny(tmp_path / "tiny.gguf")
    info = read_info(path)
    assert isinstance(info, GGUFInfo)
    assert info.path == path
    assert info.size_bytes == path.stat().st_size
    assert (info.version, info.architecture, info.name, info.license) == (3, "llama", "Tiny Test", "apache-2.0")
    assert info.parameters == TINY_PARAMETERS == 9152
    assert info.num_tensors == 5
    assert info.tensor_bytes == TINY_TENSOR_BYTES
    assert info.context_length == 2048
    assert info.file_type == "Q8_0"
    assert (info.block_count, info.embedding_length, info.head_count, info.head_count_kv) == (2, 64, 4, 2)
    assert (info.key_length, info.value_length, info.head_dim) == (16, 16, 16)  # 64 / 4
    assert info.sliding_window is None
    assert info.chat_template == TEMPLATE
    assert info.split_count == 1
    assert info.layer_kv_heads is None
    # 2 layers x 2 KV heads x (16 + 16) values x 2 bytes
    assert info.kv_bytes_per_token() == 256
    assert info.kv_bytes_per_token(bytes_per_value=1) == 128
    # The vocabulary is stepped over, not decoded.
    assert info.metadata["tokenizer.ggml.tokens"] == GGUFArray("string", 7)
    assert info.metadata["llama.feed_forward_length"] == 128


def test_explicit_head_dims_sliding_window_and_per_layer_kv_heads(tmp_path):
    path = write_tiny(tmp_path / "t.gguf", arch="gemma3", head_count_kv=None, extra=[
        lambda w: w.add_key_length(32),
        lambda w: w.add_value_length(24),
        lambda w: w.add_sliding_window(512),
        lambda w: w.add_array("gemma3.attention.head_count_kv", [2, 0]),  # layer 1: no KV
    ])
    info = read_info(path)
    assert (info.architecture, info.key_length, info.value_length, info.sliding_window) == ("gemma3", 32, 24, 512)
    assert (info.head_count, info.head_count_kv, info.layer_kv_heads) == (4, 2, (2, 0))
    assert info.kv_bytes_per_token() == (2 + 0) * (32 + 24) * 2 == 224


def test_kv_heads_default_to_heads_and_missing_keys_are_none(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "bare.gguf", "mamba")
    w.add_tensor("x", np.zeros(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = read_info(tmp_path / "bare.gguf")
    assert info.architecture == "mamba" and info.parameters == 32
    assert (info.name, info.context_length, info.file_type, info.block_count, info.head_count,
            info.head_count_kv, info.key_length, info.chat_template, info.license) == (None,) * 9
    assert info.kv_bytes_per_token() is None

    info = read_info(write_tiny(tmp_path / "no-kv.gguf", head_count_kv=0))
    assert info.head_count_kv == 0 and info.kv_bytes_per_token() is None

    info = read_info(write_tiny(tmp_path / "mha.gguf", head_count_kv=None))
    assert info.head_count_kv == 4
    assert info.kv_bytes_per_token() == 2 * 4 * 32 * 2


@pytest.mark.parametrize("file_type, name", [
    (0, "F32"), (1, "F16"), (2, "Q4_0"), (7, "Q8_0"), (8, "Q5_0"), (10, "Q2_K"), (12, "Q3_K_M"),
    (14, "Q4_K_S"), (15, "Q4_K_M"), (17, "Q5_K_M"), (18, "Q6_K"), (30, "IQ4_XS"), (32, "BF16"),
    (38, "MXFP4_MOE"), (1024 + 15, "Q4_K_M"), (999, "FTYPE_999"),
])
def test_file_type_names(tmp_path, file_type, name):
    data = gguf_bytes([ARCH, kv("general.file_type", 4, struct.pack("<I", file_type))])
    assert read_info(write(tmp_path, data)).file_type == name


def test_split_model(tmp_path):
    write_tiny(tmp_path / "tiny.gguf", split_max_tensors=2)
    parts = [tmp_path / f"tiny-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert sorted(tmp_path.iterdir()) == parts
    info = read_info(parts[0])
    assert info.split_count == 3
    assert info.parameters == TINY_PARAMETERS
    assert info.num_tensors == 5
    assert info.tensor_bytes == TINY_TENSOR_BYTES
    assert info.size_bytes == sum(p.stat().st_size for p in parts)
    assert info.block_count == 2 and info.chat_template == TEMPLATE

    with pytest.raises(ModelLoadError, match=r"is part 2 of a model split into 3 files; pass the first part"):
        read_info(parts[1])
    parts[2].unlink()
    with pytest.raises(ModelLoadError) as e:
        read_info(parts[0])
    assert str(e.value) == (f"{parts[0]} is split into 3 files but {parts[2]} is missing; "
                            "download every part into the same folder")


def test_timing_does_not_depend_on_vocabulary_decoding(tmp_path):
    """A 200k-token vocabulary is stepped over, not decoded: its strings may hold any bytes."""
    w = gguf.GGUFWriter(tmp_path / "big.gguf", "llama")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(200_000)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert read_info(tmp_path / "big.gguf").metadata["tokenizer.ggml.tokens"] == GGUFArray("string", 200_000)


def test_a_header_is_read_once_for_the_check_and_the_plain_reads_after_it(tmp_path, monkeypatch):
    """A load checks the file (keeping the vocabulary's strings), then reads the plain header for
    the memory plan and the weights: those are answered from the first read. A plain read
    first does not answer a read that needs the strings, and a file changed in place is read
    again."""
    from localllm import gguf as reader

    path = write_tiny(tmp_path / "tiny.gguf")
    parses = []
    real_parse = reader._Parser.parse
    monkeypatch.setattr(reader._Parser, "parse", lambda self: parses.append(self.keep_strings) or real_parse(self))
    assert reader.token_texts(path) == tuple(t.encode() for t in TOKENS)
    assert read_info(path).num_tensors == 5
    assert reader.tensor_table(path)[2][0].name == "token_embd.weight"
    assert parses == ["tokenizer.ggml.tokens"]
    other = write_tiny(tmp_path / "other.gguf")
    read_info(other)
    assert reader.token_texts(other) is not None
    assert parses == ["tokenizer.ggml.tokens", None, "tokenizer.ggml.tokens"]
    os.utime(path, ns=(1, 1))  # the same bytes, another mtime: another file as far as the cache knows
    read_info(path)
    assert parses[-1] is None and len(parses) == 4


def test_a_file_that_passed_its_check_is_not_checked_again_until_it_changes(tmp_path, monkeypatch):
    from localllm import gguf_check

    path = write_tiny(tmp_path / "tiny.gguf")
    checks = []
    real_check = gguf_check._check
    monkeypatch.setattr(gguf_check, "_check", lambda p, first: checks.append(p) or real_check(p, first))
    info = gguf_check.check_model(path)
    assert gguf_check.check_model(path) is info and len(checks) == 1
    os.utime(path, ns=(1, 1))
    assert gguf_check.check_model(path).architecture == "llama" and len(checks) == 2


# -- malformed files, built byte by byte -----------------------------------------------------


def s(text) -> bytes:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key, value_type: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", value_type) + payload


def tensor(name, shape, ggml_type: int = 0, offset: int = 0) -> bytes:
    return (s(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", n) for n in shape)
            + struct.pack("<IQ", ggml_type, offset))


ARCH = kv("general.architecture", 8, s("llama"))


def gguf_bytes(kvs, tensors=(), data=b"", *, version=3, num_kv=None, num_tensors=None) -> bytes:
    head = (b"GGUF" + struct.pack("<IQQ", version, len(tensors) if num_tensors is None else num_tensors,
                                  len(kvs) if num_kv is None else num_kv)
            + b"".join(kvs) + b"".join(tensors))
    return head + b"\0" * (-len(head) % 32) + data


def write(tmp_path: Path, data: bytes, name: str = "m.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as e:
        read_info(path)
    message = str(e.value)
    assert str(path) in message
    return message


def test_hand_built_file_reads(tmp_path):
    data = gguf_bytes([ARCH], [tensor("w", [32, 2], 8, 0)], data=b"\0" * 68)  # Q8_0: 2 blocks of 34
    info = read_info(write(tmp_path, data))
    assert (info.architecture, info.parameters, info.num_tensors, info.tensor_bytes) == ("llama", 64, 1, 68)


def test_missing_directory_and_empty(tmp_path):
    assert load_error(tmp_path / "nope.gguf") == (
        f"model file {tmp_path / 'nope.gguf'} does not exist; pass the path to a .gguf file")
    assert load_error(tmp_path) == f"{tmp_path} is not a file; pass the path to a .gguf file"
    assert "is empty" in load_error(write(tmp_path, b""))
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "fifo.gguf"
        os.mkfifo(fifo)  # opening it would wait for a writer forever
        assert load_error(fifo) == f"{fifo} is not a file; pass the path to a .gguf file"
    unreadable = write(tmp_path, gguf_bytes([ARCH]), "secret.gguf")
    unreadable.chmod(0)
    if os.geteuid() != 0:  # root reads it anyway
        assert "cannot be read (" in load_error(unreadable)


MALFORMED = [
    (b"GGU", "it ends inside the magic bytes"),
    (b"GGUF\x03\0", "it ends inside the version"),
    (b"GGUF" + struct.pack("<I", 3) + b"\0" * 12, "it ends inside the key-value count"),
    (gguf_bytes([ARCH], version=1), "GGUF version 1 is not supported (only versions 2 and 3)"),
    (gguf_bytes([ARCH], version=4), "GGUF version 4 is not supported"),
    (gguf_bytes([ARCH], version=0), "GGUF version 0 is not supported"),
    (gguf_bytes([ARCH], version=0x03000000), "looks byte-swapped: a big-endian GGUF file"),
    (gguf_bytes([ARCH], num_kv=2**40), "it claims 1099511627776 key-value pairs, more than its"),
    (gguf_bytes([ARCH], num_tensors=2**40), "it claims 1099511627776 tensors, more than its"),
    (gguf_bytes([ARCH], num_tensors=3), "it claims 3 tensors, more than its 96 bytes could hold"),
    (gguf_bytes([ARCH], [tensor("a", [8])])[:94], "it ends inside the data offset of tensor 'a' (at byte 94 of 94: 8 bytes needed, 0 left)"),
    (gguf_bytes([ARCH, struct.pack("<Q", 2**60) + b"key"]), "key 1 claims to be 1152921504606846976 bytes long"),
    (gguf_bytes([ARCH, struct.pack("<Q", 1000) + b"key"]), "it ends inside key 1 "),
    (gguf_bytes([ARCH, kv("x", 8, struct.pack("<Q", 2**60))]), "the value of 'x' claims to be 1152921504606846976 bytes"),
    (gguf_bytes([ARCH, kv("x", 9, struct.pack("<IQ", 5, 2**40))]), "array 'x' claims 1099511627776 items (at most 1073741824)"),
    (gguf_bytes([ARCH, kv("x", 9, struct.pack("<IQ", 5, 2**29))]), "array 'x' claims 536870912 items, more than the rest of the file"),
    (gguf_bytes([ARCH, kv("x", 9, struct.pack("<IQ", 8, 2**20))]), "array 'x' claims 1048576 items, more than the rest"),
    (gguf_bytes([ARCH, kv("x", 9, struct.pack("<IQ", 8, 2) + s("ok") + struct.pack("<Q", 2**60))]),
     "item 1 of 'x' claims to be 1152921504606846976 bytes long"),
    (gguf_bytes([ARCH, kv("x", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 0))]), "'x' is an array of arrays"),
    (gguf_bytes([ARCH, kv("x", 9, struct.pack("<IQ", 13, 1))]), "'x' is an array of unknown value type 13"),
    (gguf_bytes([ARCH, kv("x", 13, b"\0" * 8)]), "key 'x' has unknown value type 13"),
    (gguf_bytes([ARCH, kv("x", 0xFFFFFFFF, b"\0" * 8)]), "key 'x' has unknown value type 4294967295"),
    (gguf_bytes([ARCH, kv(b"\xff\xfe", 4, b"\0" * 4)]), "key 1 is not UTF-8 (byte 0xff at byte"),
    (gguf_bytes([ARCH, kv("x", 8, s(b"ok\xc3("))]), "the value of 'x' is not UTF-8 (byte 0xc3 at byte"),
    (gguf_bytes([ARCH, kv("", 4, b"\0" * 4)]), "key 1 is empty"),
    (gguf_bytes([ARCH, ARCH]), "key 'general.architecture' appears twice"),
    (gguf_bytes([ARCH, kv("general.alignment", 4, struct.pack("<I", 48))]), "general.alignment 48 is not a power of two"),
    (gguf_bytes([ARCH, kv("general.alignment", 10, struct.pack("<Q", 32))]), "general.alignment 32 is not a power of two stored as uint32"),
    (gguf_bytes([ARCH], [tensor(b"w\xff", [32])]), "the name of tensor 0 is not UTF-8"),
    (gguf_bytes([ARCH], [tensor("w" * 64, [32])]), "tensor 0's name is 64 bytes long (at most 63)"),
    (gguf_bytes([ARCH], [tensor("w", [32]), tensor("w", [32], offset=128)]), "tensor name 'w' appears twice"),
    (gguf_bytes([ARCH], [tensor("w", [1, 1, 1, 1, 1])]), "tensor 'w' has 5 dimensions (at most 4)"),
    (gguf_bytes([ARCH], [tensor("w", [2**63])]), "tensor 'w' has a negative dimension"),
    (gguf_bytes([ARCH], [tensor("w", [2**32, 2**32])]), "tensor 'w' has 18446744073709551616 elements"),
    (gguf_bytes([ARCH], [tensor("w", [32], ggml_type=4)]), "tensor 'w' has unknown ggml type 4"),
    (gguf_bytes([ARCH], [tensor("w", [32], ggml_type=43)]), "tensor 'w' has unknown ggml type 43"),
    (gguf_bytes([ARCH], [tensor("w", [100, 2], ggml_type=12)]),
     "tensor 'w' of type Q4_K has rows of 100 elements, not a multiple of its block size 256"),
    (gguf_bytes([ARCH], [tensor("w", [32], offset=64)]), "tensor 'w' has data offset 64, expected 0"),
    (gguf_bytes([ARCH], [tensor("a", [8]), tensor("b", [8], offset=0)]), "tensor 'b' has data offset 0, expected 32"),
    (gguf_bytes([ARCH], [tensor("w", [1000, 1000])]), "its tensor data needs 4000128 bytes but the file has 128; the file is truncated"),
]


@pytest.mark.parametrize("data, problem", MALFORMED, ids=[problem for _, problem in MALFORMED])
def test_malformed(tmp_path, data, problem):
    path = write(tmp_path, data)
    message = load_error(path)
    assert problem in message, message
    if "GGUF version" in problem or "bad magic" in problem:
        return
    assert message.startswith(f"{path} is not a valid GGUF file: ")
    assert message.endswith("; download it again or convert the model again")


def test_wrong_magic(tmp_path):
    path = write(tmp_path, b"PK\x03\x04 a zip file, not a model")
    assert load_error(path) == (f"{path} is not a GGUF file (bad magic b'PK\\x03\\x04', expected b'GGUF'); "
                                "pass a .gguf model file")


@pytest.mark.parametrize("kvs, problem", [
    ([], "has no general.architecture key, so it is not a model llama.cpp can load"),
    ([kv("general.architecture", 4, b"\0" * 4)], "key general.architecture should be text, not int 0"),
    ([ARCH, kv("llama.block_count", 8, s("24"))], "key llama.block_count should be a whole number, not str '24'"),
    ([ARCH, kv("llama.context_length", 6, struct.pack("<f", 4096))], "llama.context_length should be a whole number, not float 4096.0"),
    ([ARCH, kv("llama.attention.head_count", 9, struct.pack("<IQ", 8, 1) + s("x"))],
     "llama.attention.head_count should be a whole number or a list of them, not an array of 1 string"),
    ([ARCH, kv("llama.block_count", 5, struct.pack("<i", -1))], "key llama.block_count is -1, a negative count"),
    ([ARCH, kv("llama.attention.head_count_kv", 9, struct.pack("<IQ", 5, 2) + struct.pack("<ii", 2, -2))],
     "key llama.attention.head_count_kv holds -2, a negative count"),
    ([ARCH, kv("split.count", 4, struct.pack("<I", 2))], "is part 1 of a model split into 2 files; pass the first part, named like NAME-00001-of-00002.gguf"),
])
def test_not_a_usable_model(tmp_path, kvs, problem):
    message = load_error(write(tmp_path, gguf_bytes(kvs)))
    assert problem in message, message


def test_every_truncation_is_reported(tmp_path):
    """Cut a valid file at every length up to the tensor data, and at every 7th length and the
    last 64 in the data (cuts there all fail the same check, that the data ends before the last
    tensor's end): each cut is one ModelLoadError saying it is truncated."""
    data = write_tiny(tmp_path / "tiny.gguf").read_bytes()
    assert read_info(tmp_path / "tiny.gguf").parameters == TINY_PARAMETERS
    last_tensor_end = len(data)  # the file ends right after the last tensor's data
    tables_end = data.index(b"\0" * 32) + 64  # past the header, KV section and tensor table
    assert tables_end < last_tensor_end - 64
    cuts = sorted({*range(1, tables_end), *range(tables_end, last_tensor_end, 7),
                   *range(last_tensor_end - 64, last_tensor_end)})
    for n in cuts:
        path = write(tmp_path, data[:n], "cut.gguf")
        message = load_error(path)
        assert "truncated" in message or "more than" in message, (n, message)


# -- property: damage never escapes as anything but ModelLoadError --------------------------


def _tiny_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        return write_tiny(Path(d) / "tiny.gguf").read_bytes()


TINY = _tiny_bytes()
HEADER_END = TINY.index(b"\0" * 32)  # mutations aimed at the header, KV section and tensor table

_u64_edges = st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**60, 2**63, 2**64 - 1])
_edit = st.one_of(
    st.tuples(st.just("byte"), st.integers(0, len(TINY) - 1), st.integers(0, 255)),
    st.tuples(st.just("byte"), st.integers(0, HEADER_END), st.integers(0, 255)),
    st.tuples(st.just("u64"), st.integers(0, HEADER_END), st.one_of(_u64_edges, st.integers(0, 2**64 - 1))),
    st.tuples(st.just("u32"), st.integers(0, HEADER_END), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("insert"), st.integers(0, HEADER_END), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, HEADER_END), st.integers(1, 16)),
)


def _mutate(data: bytes, edits, cut: int | None) -> bytes:
    buf = bytearray(data)
    for kind, pos, arg in edits:
        pos = min(pos, len(buf))
        if kind == "byte" and pos < len(buf):
            buf[pos] = arg
        elif kind in ("u64", "u32"):
            buf[pos:pos + (8 if kind == "u64" else 4)] = struct.pack("<Q" if kind == "u64" else "<I", arg)
        elif kind == "insert":
            buf[pos:pos] = arg
        elif kind == "delete":
            del buf[pos:pos + arg]
    return bytes(buf[:cut] if cut is not None else buf)


@settings(max_examples=400, deadline=timedelta(seconds=5),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(edits=st.lists(_edit, min_size=1, max_size=4),
       cut=st.one_of(st.none(), st.integers(0, len(TINY))))
def test_damage_parses_or_raises_model_load_error(edits, cut):
    data = _mutate(TINY, edits, cut)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "damaged.gguf"
        path.write_bytes(data)
        try:
            info = read_info(path)
        except ModelLoadError as e:
            assert str(path) in str(e)
        else:
            assert isinstance(info, GGUFInfo) and info.size_bytes == len(data)
