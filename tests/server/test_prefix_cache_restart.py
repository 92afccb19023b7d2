"""A real `localllm serve` stopped and started again: the second process answers a long chat
request from the prefix cache on disk (the official openai client sees it in
usage.prompt_tokens_details.cached_tokens), with the same greedy answer; `localllm cache`
lists the entry and clears it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from conftest import LiveServer, start_serve
from conftest import stop_serve as stop
from openai import OpenAI

SYSTEM = ("You answer questions about this module.\n\n"
          + "".join(f"def scale_{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(40)))


def start(qwen_path, home, log_path) -> LiveServer:
    return start_serve(qwen_path, home, log_path, "--ctx", "2048")


def ask(server: LiveServer):
    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=server.model_path.stem, temperature=0, max_tokens=16,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does scale_7(2) return?"}])


def cache_cli(home, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm.cli", "cache", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "LOCALLLM_HOME": str(home)})


@pytest.mark.model
def test_a_restarted_server_answers_a_long_prompt_from_the_disk_cache(qwen_path, tmp_path):
    home, log_path = tmp_path / "home", tmp_path / "serve.log"
    server = start(qwen_path, home, log_path)
    try:
        cold = ask(server)
    finally:
        stop(server)
    assert cold.usage.prompt_tokens > 600 and cold.usage.prompt_tokens_details.cached_tokens == 0

    listed = json.loads(cache_cli(home, "ls", "--json").stdout)
    assert [(e["model"], e["tokens"]) for e in listed] == [(qwen_path.name, cold.usage.prompt_tokens)]

    server = start(qwen_path, home, log_path)
    try:
        warm = ask(server)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        stop(server)
    assert warm.usage.prompt_tokens_details.cached_tokens == warm.usage.prompt_tokens - 1
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert f"localllm_disk_cached_prompt_tokens_total {float(warm.usage.prompt_tokens - 1)}" in metrics
    assert "WARNING" not in server.log()

    stats = json.loads(cache_cli(home, "stats", "--json").stdout)
    assert stats["entries"] == 1 and stats["tokens"] == cold.usage.prompt_tokens
    cleared = cache_cli(home, "clear", "-y")
    assert cleared.returncode == 0 and cleared.stdout.startswith("removed 1 entries")
    assert json.loads(cache_cli(home, "ls", "--json").stdout) == []
    assert cache_cli(home, "ls").stdout.startswith("the prefix cache is empty")
