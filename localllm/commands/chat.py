"""`localllm chat`: open the Textual chat app on a model file or an OpenAI-compatible server."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from localllm import paths
from localllm.config import EngineConfig
from localllm.errors import ModelLoadError, UsageError


def installed_models(store, current: str) -> list[tuple[str, str]]:
    """(model, label) for the picker: .gguf files in the models folder, models earlier chats
    used that are still on disk, and the current one. Until `localllm pull` keeps a store of
    its own, these paths are the installed models."""
    found: dict[str, Path] = {}
    folder = paths.models_dir()
    candidates = sorted(folder.glob("**/*.gguf")) if folder.is_dir() else []
    candidates += [Path(c.model) for c in store.list() if c.model]
    if current:
        candidates.insert(0, Path(current))
    for path in candidates:
        if path.is_file():
            found.setdefault(str(path.resolve()), path)
    out = []
    for resolved, path in found.items():
        size_mb = path.stat().st_size / 1e6
        out.append((str(path), f"{path.name}   {size_mb:,.0f} MB   {path.parent}"))
    return out


def chat(engine_config: EngineConfig | None, model: str | None, *, endpoint: str | None = None,
         api_key: str | None = None, system: str = "", resume: str | None = None,
         settings=None) -> int:
    from localllm.tui.backend import LocalBackend, RemoteBackend
    from localllm.tui.conversations import ConversationStore

    store = ConversationStore(paths.history_db())
    try:
        conversation = None
        if resume is not None:
            conversation = store.latest() if resume == "" else store.get(resume)
            if conversation is None:
                raise UsageError("there is no saved conversation to resume" if resume == "" else
                                 f"no saved conversation {resume!r}; open `localllm chat` and press "
                                 "ctrl+b to see the saved ones")
        if endpoint is not None:
            RemoteBackend(endpoint)  # a malformed URL is a usage error now, not inside the app

            def factory(name: str):
                return RemoteBackend(endpoint, name or None, api_key)
            model = model or (conversation.model if conversation else "") or ""
        else:
            model = model or (conversation.model if conversation else None) or _last_model(store)
            if not model:
                raise UsageError("no model given; run `localllm chat PATH/TO/MODEL.gguf` "
                                 f"(or put .gguf files in {paths.models_dir()})")
            if not Path(model).expanduser().is_file():
                raise ModelLoadError(f"model file {model} does not exist; give the path to a .gguf file")
            model = str(Path(model).expanduser())

            def factory(name: str):
                return LocalBackend(dataclasses.replace(engine_config, model_path=Path(name)))

        from localllm.tui.app import ChatApp

        app = ChatApp(factory, model, store, settings=settings, system=system, conversation=conversation,
                      list_models=lambda: installed_models(store, app.model) if endpoint is None
                      else [(app.model, app.model)])
        result = app.run()
        return result if isinstance(result, int) else 0
    finally:
        store.close()


def _last_model(store) -> str | None:
    for conv in store.list():
        if conv.model and Path(conv.model).is_file():
            return conv.model
    return None
