"""The runners that the engine's integration tests run on: llama.cpp, and the torch runner
where torch is installed. Tests that build engines take the name as ``EngineConfig.runner``
and ``paths.weights_cache_dir()`` as its weights cache (the session's own cache folder, see
conftest.py), so that only the first torch engine of a session converts the weights."""

from __future__ import annotations

import importlib.util


def runner_names() -> list[str]:
    return ["llamacpp", "torch"] if importlib.util.find_spec("torch") else ["llamacpp"]
