"""`localllm run/eval/pull` on malformed model files, as subprocesses: exit 2 and one
`localllm: error:` line naming the file, never a traceback, a signal or an abort. Half of the
files pass a naive check (magic, version, sizes) and made llama.cpp abort the process before
localllm.gguf_check refused them."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from gguf_mutations import ARRAY, F32, KV, STRING, U32, read_model
from tiny_gguf import write_tiny_gguf

TIMEOUT_S = 120


def _files() -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as d:
        good = write_tiny_gguf(Path(d) / "tiny.gguf", "qwen2")
        data = good.read_bytes()
    model = read_model_bytes(data)
    tokens = model.get("tokenizer.ggml.tokens").value
    header_end = data.index(b"token_embd.weight") + 40
    return {
        # damaged containers
        "truncated in the tensor table": data[:header_end],
        "truncated in the tensor data": data[:len(data) - 1000],
        "garbled magic": b"GGUG" + data[4:],
        "lying tensor count": data[:8] + struct.pack("<Q", 2**40) + data[16:],
        "lying string length": data[:24] + struct.pack("<Q", 2**62) + data[32:],
        "misaligned offset": model.to_bytes(offsets={1: 4}),
        "unknown tensor type": replace(model, tensors=(replace(model.tensors[0], ggml_type=4),) + model.tensors[1:]).to_bytes(),
        # well-formed files that aborted llama.cpp (SIGABRT / SIGSEGV) before the model check
        "no layers": model.with_kv(KV("qwen2.block_count", U32, 0)).to_bytes(),
        "experts used, none defined": model.with_kv(KV("qwen2.expert_used_count", U32, 2)).to_bytes(),
        "nan norm epsilon": model.with_kv(KV("qwen2.attention.layer_norm_rms_epsilon", F32, float("nan"))).to_bytes(),
        "head size apart from rope": model.with_kv(KV("qwen2.rope.dimension_count", U32, 8)).to_bytes(),
        "duplicate token": model.with_kv(KV("tokenizer.ggml.tokens", ARRAY, tokens[:-1] + (tokens[40],), STRING)).to_bytes(),
        "alignment 1": model.with_kv(KV("general.alignment", U32, 1)).to_bytes(),
        "integer matrix": replace(model, tensors=tuple(
            replace(t, ggml_type=26) if t.name == "blk.0.attn_q.weight" else t for t in model.tensors)).to_bytes(),
    }


def read_model_bytes(data: bytes):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.gguf"
        path.write_bytes(data)
        return read_model(path)


FILES = _files()


def localllm(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env={**os.environ, **(env or {})})


def assert_clear_error(proc: subprocess.CompletedProcess, path: Path) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])  # a signal would be negative
    assert "Traceback" not in proc.stderr and "GGML_ASSERT" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("localllm: error: ") and str(path) in lines[0], lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize("name", FILES)
def test_run_refuses_malformed_model(tmp_path, name):
    path = tmp_path / "bad.gguf"
    path.write_bytes(FILES[name])
    assert_clear_error(localllm("run", path, "hi", "--max-tokens", "1", "--threads", "1"), path)


@pytest.mark.parametrize("name", ["duplicate token", "integer matrix", "truncated in the tensor data"])
def test_other_doors_refuse_malformed_model(tmp_path, name):
    """The torch runner (its vocab_only load), eval (the same) and pull's import of a local file."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(FILES[name])
    text = tmp_path / "text.txt"
    text.write_text("hello world " * 200)
    assert_clear_error(localllm("run", path, "hi", "--runner", "torch", "--max-tokens", "1"), path)
    assert_clear_error(localllm("eval", path, "--text", text), path)
    assert_clear_error(localllm("pull", path, env={"LOCALLLM_HOME": str(tmp_path / "home")}), path)
