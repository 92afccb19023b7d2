"""`localllm chat` with nothing installed, in a real terminal: it offers to pull the catalog's
default, pulls it from the (fake) hub on "y", and opens the app on it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tui"))
from test_tmux import Tmux, status, wait_for  # noqa: E402

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]

ALIAS = "qwen:test"
REPO, FILE = "acme/qwen-GGUF", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


@pytest.fixture
def tmux():
    import os
    import uuid

    server = Tmux(f"localllm-pull-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield server
    finally:
        server.kill()


def test_chat_offers_to_pull_the_default_and_opens_on_it(hub_env, qwen_path, tmux, tmp_path):
    hub_env.hub.add_repo(REPO, {FILE: qwen_path})
    catalog = tmp_path / "models.toml"
    catalog.write_text(f'default = "{ALIAS}"\n[models."{ALIAS}"]\nrepo = "{REPO}"\nfiles = {{ Q4_K_M = "{FILE}" }}\n')
    env = {"HF_ENDPOINT": hub_env.hub.url, "HF_HUB_CACHE": str(hub_env.cache), "HF_HOME": str(hub_env.cache.parent),
           "LOCALLLM_HOME": str(hub_env.home), "LOCALLLM_CATALOG": str(catalog), "TERM": "xterm-256color"}
    rc = tmp_path / "rc"
    tmux.start("offer", [str(Path(sys.executable).parent / "localllm"), "chat", "--ctx", "2048"], env, rc)

    wait_for(tmux, "offer", "the offer", lambda pane: f"No model is installed. Pull {ALIAS} ({REPO}) now? [Y/n]"
             in pane, 30)
    tmux.type("offer", "y")
    pane = wait_for(tmux, "offer", "the app, ready on the pulled model",
                    lambda pane: (s := status(pane)) is not None and s["state"] == "ready", 90)
    assert "qwen2.5-coder-0.5b-instruct-q4_" in pane  # the status bar names the model

    tmux.key("offer", "C-q")
    wait_for(tmux, "offer", "the exit", lambda pane: rc.exists() and rc.read_text().strip() != "", 30)
    assert rc.read_text().strip() == "0"
    [model] = json.loads((hub_env.home / "data" / "models.json").read_text())["models"]
    assert model["name"] == ALIAS and model["repo"] == REPO
    assert Path(model["files"][0]).read_bytes()[:4] == b"GGUF"
