"""Where localllm keeps its files, from platformdirs: nothing is created until it is used."""

from __future__ import annotations

from pathlib import Path

APP_NAME = "localllm"


def data_dir() -> Path:
    """Conversations and other things a person would miss: ~/.local/share/localllm on Linux."""
    from platformdirs import user_data_path

    return user_data_path(APP_NAME, appauthor=False)


def cache_dir() -> Path:
    """Things that can be rebuilt (the prefix cache): ~/.cache/localllm on Linux."""
    from platformdirs import user_cache_path

    return user_cache_path(APP_NAME, appauthor=False)


def models_dir() -> Path:
    """GGUF files a person placed or pulled for localllm."""
    return data_dir() / "models"


def history_db() -> Path:
    """The chat app's saved conversations (SQLite)."""
    return data_dir() / "conversations.db"
