"""`localllm chat`'s mistakes, caught before the screen opens: exit 2, one red line."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
from test_cli import assert_usage_error, localllm  # noqa: E402


def _env(tmp_path) -> dict:
    return {"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache")}


def test_chat_with_a_missing_model_file(tmp_path):
    proc = localllm("chat", tmp_path / "nope.gguf", env=_env(tmp_path))
    assert_usage_error(proc, f"model file {tmp_path / 'nope.gguf'} does not exist")


def test_chat_with_no_model_installed_and_no_terminal_to_ask_in(tmp_path):
    proc = localllm("chat", env=_env(tmp_path))  # stdin is not a terminal: no question, the command to run
    assert_usage_error(proc, "no model is installed; run `localllm pull qwen2.5-coder:0.5b`, then `localllm chat`")


def test_resume_with_nothing_saved(tmp_path):
    proc = localllm("chat", "--resume", env=_env(tmp_path))
    assert_usage_error(proc, "there is no saved conversation to resume")


def test_resume_an_unknown_id(tmp_path):
    proc = localllm("chat", "--resume", "abc123", env=_env(tmp_path))
    assert_usage_error(proc, "no saved conversation 'abc123'")


def test_endpoint_that_is_not_a_url(tmp_path):
    proc = localllm("chat", "--endpoint", "localhost:8000", env=_env(tmp_path))
    assert_usage_error(proc, "--endpoint 'localhost:8000' is not an http(s) URL")


def test_bad_generation_settings(tmp_path):
    proc = localllm("chat", "--temperature", "-1", env=_env(tmp_path))
    assert_usage_error(proc, "temperature=-1.0 is invalid")


def test_a_damaged_conversation_store(tmp_path):
    db = tmp_path / "data" / "localllm" / "conversations.db"
    db.parent.mkdir(parents=True)
    db.write_bytes(b"this is not a database" * 100)
    proc = localllm("chat", "--resume", env=_env(tmp_path))
    assert_usage_error(proc, f"the conversation store {db} cannot be opened")
    assert db.read_bytes() == b"this is not a database" * 100  # nothing lost
