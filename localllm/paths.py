"""Where localllm keeps its files, from platformdirs; nothing is created until it is used.

One variable moves all of them: ``LOCALLLM_HOME=/some/dir`` puts config, data and cache under
``/some/dir/{config,data,cache}`` (tests, portable installs, a second profile). Pulled model
files stay in the Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``), shared with other tools.
"""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "localllm"
HOME_VARIABLE = "LOCALLLM_HOME"


def _home() -> Path | None:
    home = os.environ.get(HOME_VARIABLE)
    return Path(home).expanduser() if home else None


def config_dir() -> Path:
    """Settings a person edits: ~/.config/localllm on Linux."""
    if (home := _home()) is not None:
        return home / "config"
    from platformdirs import user_config_path

    return user_config_path(APP_NAME, appauthor=False)


def data_dir() -> Path:
    """Conversations and the model list, things a person would miss: ~/.local/share/localllm."""
    if (home := _home()) is not None:
        return home / "data"
    from platformdirs import user_data_path

    return user_data_path(APP_NAME, appauthor=False)


def cache_dir() -> Path:
    """Things that can be rebuilt (the prefix cache): ~/.cache/localllm on Linux."""
    if (home := _home()) is not None:
        return home / "cache"
    from platformdirs import user_cache_path

    return user_cache_path(APP_NAME, appauthor=False)


def prefix_cache_dir() -> Path:
    """The on-disk prefix cache: the KV of long prompts, kept across restarts."""
    return cache_dir() / "prefix"


def weights_cache_dir() -> Path:
    """The torch runner's converted weights (safetensors), one file per model file."""
    return cache_dir() / "weights"


def models_dir() -> Path:
    """GGUF files a person placed here for localllm (imported as they are)."""
    return data_dir() / "models"


def models_manifest() -> Path:
    """The installed models: names and the files they are made of."""
    return data_dir() / "models.json"


def history_db() -> Path:
    """The chat app's saved conversations (SQLite)."""
    return data_dir() / "conversations.db"


def responses_db() -> Path:
    """The responses `localllm serve` keeps for OpenAI's Responses API (SQLite)."""
    return data_dir() / "responses.db"
