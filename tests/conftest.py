"""Shared fixtures: the real GGUF test models (see scripts/test_models.py)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import test_models  # noqa: E402

# Where there is no NVIDIA GPU, Triton's kernels run in its interpreter on CPU tensors. Triton
# reads this when triton.language is first imported, so it is set before any test imports it.
if not Path("/proc/driver/nvidia").exists() and not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))


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


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """all-MiniLM-L6-v2 as an f16 GGUF (arch bert, mean pooling): the embedding model."""
    return _model("all-minilm-l6-v2")


@pytest.fixture(scope="session", autouse=True)
def _own_cache_folder(tmp_path_factory):
    """Every test, and every `localllm` process a test starts, keeps its prefix cache and its
    data (the responses `serve` keeps, say) in folders of this session's own, never the user's:
    XDG_CACHE_HOME and XDG_DATA_HOME move platformdirs' folders (tests that need a particular
    home set LOCALLLM_HOME, which wins)."""
    old = {key: os.environ.get(key) for key in ("XDG_CACHE_HOME", "XDG_DATA_HOME")}
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    os.environ["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("xdg-data"))
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def engines(_own_cache_folder):
    """The session's shared engines (tests/engines.py): ``engines.get(path, runner, **config)``."""
    from engines import EnginePool

    pool = EnginePool()
    yield pool
    pool.close()


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run the statistical and long cases (marked heavy) at their full size, "
                          "not the trimmed size the test command runs by default (docs/testing.md)")


@pytest.fixture
def full(request) -> bool:
    """True under ``--full``: a case marked ``heavy`` takes its full size (more seeds, more
    prompts, more requests), else its trimmed one, which asserts the same properties."""
    assert request.node.get_closest_marker("heavy"), "the full fixture is for cases marked heavy"
    return request.config.getoption("--full")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run only where torch sees a CUDA device."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    try:
        import torch

        have = torch.cuda.is_available()
    except ImportError:
        have = False
    if not have:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in marked:
            item.add_marker(skip)
