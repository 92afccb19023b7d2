"""What the torch runner gives on the CPU through a real `localllm serve`, on both real files:
the same seeded request three times gives one answer; a ~2,000-token prompt answered after a
restart (a disk prefix hit) equals its cold answer token for token; drafting on and off give
the same greedy text. Served with `--runner auto` where auto chooses the torch runner on this
CPU (engine.choose_runner), with `--runner torch` elsewhere, so every CPU tier checks the same
promises; the banner's Runner line must agree with the rule either way."""

from __future__ import annotations

import re

import httpx
import pytest
from conftest import LiveServer, start_serve
from conftest import stop_serve as stop

pytest.importorskip("torch")

from localllm.engine import engine  # noqa: E402

CODE = "".join(f"def scale_{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(110))


def _rule(path) -> tuple[str, str]:
    from localllm.gguf import read_info

    probe = engine.probe_auto()
    return engine.choose_runner(read_info(path).architecture, probe, engine.formats_not_in_place(path))


def start(path, home, log_path, *extra) -> LiveServer:
    return start_serve(path, home, log_path, "--ctx", "4096", *extra)


def complete(server: LiveServer, **body) -> dict:
    r = httpx.post(f"{server.base_url}/completions", timeout=300,
                   json={"model": server.model_path.stem, **body})
    assert r.status_code == 200, r.text
    return r.json()


def metric(server: LiveServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return float(re.search(rf"^{name}(?:_total)? (\S+)$", text, re.M).group(1))


@pytest.mark.model
@pytest.mark.parametrize("model", ["qwen", "gemma"])
def test_seeds_restarts_and_drafting_give_one_answer(model, qwen_path, gemma_path, tmp_path):
    path = qwen_path if model == "qwen" else gemma_path
    chosen, why = _rule(path)
    runner = "auto" if chosen == "torch" else "torch"
    home, log_path = tmp_path / "home", tmp_path / "serve.log"
    long_prompt = CODE + "# scale_7(2) returns"

    server = start(path, home, log_path, "--runner", runner)
    try:
        seeded = [complete(server, prompt="A short poem about the sea:\n", max_tokens=24, temperature=0.9,
                           seed=1234)["choices"][0]["text"] for _ in range(3)]
        cold = complete(server, prompt=long_prompt, max_tokens=24, temperature=0)
        drafted = complete(server, prompt=CODE[:1500] + CODE[:600], max_tokens=64, temperature=0)
        accepted = metric(server, "localllm_draft_tokens_accepted")
    finally:
        stop(server)
    banner = re.search(r"^Runner: (\S+)(.*)$", server.log(), re.M)
    assert banner is not None, server.log()[-3000:]
    assert banner.group(1) == "torch"
    assert banner.group(2) == (f" ({why})" if runner == "auto" else "")
    assert len(set(seeded)) == 1 and seeded[0]
    assert 1900 < cold["usage"]["prompt_tokens"] < 4000

    server = start(path, home, log_path, "--runner", runner)
    try:
        warm = complete(server, prompt=long_prompt, max_tokens=24, temperature=0)
    finally:
        stop(server)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == warm["usage"]["prompt_tokens"] - 1
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]

    server = start(path, home, log_path, "--runner", runner, "--no-spec")
    try:
        plain = complete(server, prompt=CODE[:1500] + CODE[:600], max_tokens=64, temperature=0)
    finally:
        stop(server)
    assert accepted > 0  # the repeated code was drafted, and drafts were taken
    assert plain["choices"][0]["text"] == drafted["choices"][0]["text"]
