"""Fixtures for the download tests: a fake hub on a loopback port, and a Hugging Face cache and
localllm home in tmp_path.

huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE once, when it is imported,
into ``huggingface_hub.constants``; setting the variables in a test that runs after the import
changes nothing. So the fixture sets the variables (for subprocesses, which import afresh) and
patches the constants (for this process), and the tests pass ``endpoint=`` explicitly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_hub import FakeHub

from localllm import paths
from localllm.store import ModelStore

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class HubEnv:
    hub: FakeHub
    cache: Path  # the Hugging Face cache (HF_HUB_CACHE)
    home: Path  # LOCALLLM_HOME
    store: ModelStore

    def storage(self, repo: str) -> Path:
        return self.cache / ("models--" + repo.replace("/", "--"))

    def cache_files(self, repo: str) -> list[str]:
        """Every file and link under the repo's cache folder, relative to it, sorted."""
        root = self.storage(repo)
        if not root.exists():
            return []
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink())

    def run_python(self, code: str, env: dict[str, str] | None = None,
                   timeout: float = 120) -> subprocess.CompletedProcess:
        """``code`` in a fresh interpreter that reads this environment's variables at import."""
        full_env = {**os.environ, **(env or {})}
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                              cwd=REPO_ROOT, timeout=timeout)


@pytest.fixture
def hub_env(tmp_path, monkeypatch) -> HubEnv:
    from huggingface_hub import constants

    cache, home = tmp_path / "hf" / "hub", tmp_path / "localllm"
    with FakeHub() as hub:
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                     "HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_POSITION"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no token file of the machine's user
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.setenv(paths.HOME_VARIABLE, str(home))
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
        monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
        yield HubEnv(hub, cache, home, ModelStore(paths.models_manifest()))
