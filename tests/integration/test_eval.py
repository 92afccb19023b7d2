"""`localllm eval` run as a subprocess on the real Qwen file, on a short text (the first 1,000
characters of the built-in one, 253 tokens), with 2 threads."""

from __future__ import annotations

import importlib.util
import json
from importlib import resources

import pytest
from test_cli import assert_usage_error, localllm

pytestmark = pytest.mark.model

NUM_TOKENS = 253  # Qwen2.5's tokens of SHORT_TEXT (no BOS)
SHORT_TEXT = resources.files("localllm").joinpath("data/eval.txt").read_text(encoding="utf-8")[:1000]
FIELDS = {"model", "text", "num_tokens", "num_predictions", "threads", "candidate_is_reference",
          "reference", "candidate", "seconds"}
ROW_FIELDS = {"runner", "kv_dtype", "perplexity", "top1_agreement", "kl"}


@pytest.fixture(scope="module")
def short_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "short.txt"
    path.write_text(SHORT_TEXT, encoding="utf-8")
    return path


def eval_json(*args) -> dict:
    proc = localllm("eval", *args, "--threads", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    report = json.loads(proc.stdout)
    assert set(report) == FIELDS
    assert set(report["reference"]) == set(report["candidate"]) == ROW_FIELDS
    return report


@pytest.fixture(scope="module")
def reference_json(qwen_path, short_text) -> dict:
    """llama.cpp with its f16 KV: the reference itself (auto may name the torch runner here)."""
    return eval_json(qwen_path, "--text", short_text, "--runner", "llamacpp")


def test_reference_against_itself(qwen_path, reference_json):
    r = reference_json
    assert r["model"] == qwen_path.name
    assert r["text"] == "short.txt"
    assert (r["num_tokens"], r["num_predictions"], r["threads"]) == (NUM_TOKENS, NUM_TOKENS - 1, 2)
    assert r["candidate_is_reference"] is True
    assert r["reference"] == r["candidate"]
    assert r["reference"]["runner"] == "llamacpp" and r["reference"]["kv_dtype"] == "f16"
    assert r["candidate"]["top1_agreement"] == 100.0
    assert r["candidate"]["kl"] == 0.0
    assert 5 < r["reference"]["perplexity"] < 500


def test_f32_kv_cache_against_the_reference(qwen_path, short_text, reference_json):
    r = eval_json(qwen_path, "--text", short_text, "--runner", "llamacpp", "--kv-dtype", "f32")
    assert r["candidate_is_reference"] is False
    assert r["reference"] == reference_json["reference"]  # the reference does not depend on the candidate
    c = r["candidate"]
    assert (c["runner"], c["kv_dtype"]) == ("llamacpp", "f32")
    assert 90 <= c["top1_agreement"] < 100  # 96.43 measured: float16 K/V and flash attention move some argmaxes
    assert 0 < c["kl"] < 0.02  # 0.0017 measured
    assert c["perplexity"] == pytest.approx(r["reference"]["perplexity"], rel=0.02)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the torch runner needs torch")
def test_torch_runner_against_the_reference(qwen_path, short_text, reference_json):
    r = eval_json(qwen_path, "--text", short_text, "--runner", "torch", "--kv-dtype", "f32")
    assert r["reference"] == reference_json["reference"]
    c = r["candidate"]
    assert (c["runner"], c["kv_dtype"]) == ("torch", "f32")
    assert 90 <= c["top1_agreement"] <= 100
    assert 0 < c["kl"] < 0.02
    assert c["perplexity"] == pytest.approx(r["reference"]["perplexity"], rel=0.05)


def test_table(qwen_path, short_text, reference_json):
    proc = localllm("eval", qwen_path, "--text", short_text, "--threads", "2", "--runner", "llamacpp")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    head, columns, ref_row, cand_row = proc.stdout.splitlines()
    assert head.startswith(f"{qwen_path.name} · short.txt, {NUM_TOKENS} tokens · 2 threads · ")
    assert columns.split() == ["runner", "KV", "perplexity", "top-1", "agreement", "KL(ref", "||", "this)"]
    ppl = f"{reference_json['reference']['perplexity']:.4f}"
    assert ref_row.split() == ["reference", "llama.cpp", "f16", ppl, "100.00", "%", "0.000000"]
    assert cand_row.split() == ["candidate", "llama.cpp", "f16", ppl, "100.00", "%", "0.000000"]


# -- failures: exit 2, one line that names the problem -----------------------------------


def test_text_file_missing(qwen_path, tmp_path):
    assert_usage_error(localllm("eval", qwen_path, "--text", tmp_path / "nope.txt"),
                       f"--text {tmp_path / 'nope.txt'} does not exist")


def test_text_is_a_directory(qwen_path, tmp_path):
    assert_usage_error(localllm("eval", qwen_path, "--text", tmp_path), "is not a file")


def test_text_not_utf8(qwen_path, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("Caf\u00e9 au lait".encode("latin-1"))
    assert_usage_error(localllm("eval", qwen_path, "--text", bad),
                       "is not UTF-8 text (byte 0xe9 at offset 3); save it as UTF-8")


def test_text_empty(qwen_path, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n", encoding="utf-8")
    assert_usage_error(localllm("eval", qwen_path, "--text", empty), "empty.txt is empty")


def test_text_too_short(qwen_path, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Before we proceed any further", encoding="utf-8")
    assert_usage_error(localllm("eval", qwen_path, "--text", short),
                       "short.txt is 5 tokens; eval needs at least 16: give a longer text")


def test_text_too_long(qwen_path, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text(" ".join(f"word{i}" for i in range(6000)), encoding="utf-8")  # about 23,000 tokens
    proc = localllm("eval", qwen_path, "--text", long)
    assert_usage_error(proc, "eval takes at most 16,384: shorten it")
    assert "long.txt is " in proc.stderr


def test_unknown_model_name():
    proc = localllm("eval", "no-such-model")
    assert_usage_error(proc, "no model 'no-such-model': not a file, not installed, not in the catalog")
    # the same line `localllm run` gives
    assert proc.stderr == localllm("run", "no-such-model", "hi").stderr
