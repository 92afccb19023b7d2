"""Shared fixtures: the real GGUF test models (see scripts/test_models.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import test_models  # noqa: E402


def _model(name: str) -> Path:
    path = test_models.default_dest() / test_models.MODELS[name]["file"]
    if not path.exists():
        message = f"test model {name} is missing; run: python scripts/test_models.py"
        if os.environ.get("LOCALLLM_REQUIRE_MODELS"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return _model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return _model("gemma3-270m")
