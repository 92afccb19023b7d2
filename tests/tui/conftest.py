"""The chat app under Textual's pilot, on the real Qwen model, with its store in tmp_path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from localllm.config import CacheConfig, EngineConfig
from localllm.tui.app import ChatApp
from localllm.tui.backend import GenerationSettings, LocalBackend, LocalModels
from localllm.tui.conversations import ConversationStore


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path / "conversations.db")
    yield s
    s.close()


@pytest.fixture
def make_app(qwen_path, store):
    """make_app(n_ctx=..., conversation=..., **ChatApp kwargs) -> ChatApp on the real model, its
    models leased from a LocalModels as `localllm chat` leases them; n_threads=0 (the default)
    lets the engine choose them, and runner="auto" the runner, as `localllm chat` does."""

    def make(n_ctx: int = 2048, max_tokens: int = 48, n_threads: int = 0, runner: str = "auto", **kwargs) -> ChatApp:
        config = EngineConfig(model_path=qwen_path, cache=CacheConfig(n_ctx=n_ctx), n_threads=n_threads,
                              runner=runner)
        models = LocalModels(config)

        def factory(model: str) -> LocalBackend:
            return LocalBackend(dataclasses.replace(config, model_path=Path(model)), models)

        kwargs.setdefault("settings", GenerationSettings(temperature=0, max_tokens=max_tokens))
        return ChatApp(factory, str(qwen_path), store, models=models, **kwargs)

    return make
