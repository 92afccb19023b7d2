"""`localllm chat`: open the Textual chat app on a model file or an OpenAI-compatible server."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from localllm import paths
from localllm.config import EngineConfig
from localllm.errors import UsageError


def server_models(endpoint: str, api_key: str | None, current: str) -> list[tuple[str, str]]:
    """(model, label) for the picker of `chat --endpoint`: the server's chat and completion
    models (its /v1/models; a localllm server says which are loaded), or the current one alone
    where the server cannot be asked."""
    import httpx

    base = endpoint.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    try:
        r = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}, timeout=10)
        cards = [m for m in r.json()["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return [(current, current)] if current else []
    out = []
    for m in cards:
        if m.get("kind") == "embedding":
            continue
        notes = [m["kind"]] if m.get("kind") else []
        notes += ["loaded"] if m.get("loaded") else ([] if m.get("loaded") is None else ["loads when picked"])
        out.append((m["id"], m["id"] + (f"   {' · '.join(notes)}" if notes else "")))
    if current and current not in {model for model, _ in out}:
        out.insert(0, (current, current))
    return out


def installed_models(store, current: str) -> list[tuple[str, str]]:
    """(model, label) for the picker: the installed models (`localllm ls`), .gguf files in the
    models folder, models earlier chats used that are still on disk, and the current one."""
    from localllm.commands.models import open_store

    names: dict[str, str] = {m.files[0]: m.name for m in open_store().list() if m.is_present}
    folder = paths.models_dir()
    candidates = [Path(f) for f in names]
    candidates += sorted(folder.glob("**/*.gguf")) if folder.is_dir() else []
    candidates += [Path(c.model) for c in store.list() if c.model]
    if current:
        candidates.insert(0, Path(current))
    found: dict[str, Path] = {}
    for path in candidates:
        if path.is_file():
            found.setdefault(str(path.resolve()), path)
    out = []
    for path in found.values():
        size_mb = path.stat().st_size / 1e6
        label = names.get(str(path)) or path.name
        out.append((str(path), f"{label}   {size_mb:,.0f} MB   {path.parent}"))
    return out


def chat(engine_config: EngineConfig | None, model: str | None, *, endpoint: str | None = None,
         api_key: str | None = None, system: str = "", resume: str | None = None,
         settings=None, catalog=None) -> int:
    from localllm.tui.backend import LocalBackend, LocalModels, RemoteBackend
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
        models = None
        if endpoint is not None:
            RemoteBackend(endpoint)  # a malformed URL is a usage error now, not inside the app

            def factory(name: str):
                return RemoteBackend(endpoint, name or None, api_key)
            model = model or (conversation.model if conversation else "") or ""
        else:
            model = str(_pick_model(model, conversation, store, catalog))
            models = LocalModels(engine_config)  # ctrl+o switches models through it

            def factory(name: str):
                return LocalBackend(dataclasses.replace(engine_config, model_path=Path(name)), models)

        from localllm.tui.app import ChatApp

        app = ChatApp(factory, model, store, settings=settings, system=system, conversation=conversation,
                      models=models,
                      list_models=lambda: installed_models(store, app.model) if endpoint is None
                      else server_models(endpoint, api_key, app.backend.model_name if app.backend else app.model))
        result = app.run()
        return result if isinstance(result, int) else 0
    finally:
        store.close()


def _pick_model(name: str | None, conversation, store, catalog) -> Path:
    """MODEL resolved (path, installed name, pulled alias); without one: the resumed or last
    chat's model, else the catalog's default or any installed model; with none installed,
    offer to pull the default."""
    from localllm.catalog import Catalog
    from localllm.commands.models import open_store, pull, resolve

    catalog = catalog or Catalog.load()
    models = open_store()
    if name:
        return resolve(name, models, catalog)
    earlier = ([conversation.model] if conversation and conversation.model else []) + \
        [c.model for c in store.list() if c.model]
    for candidate in earlier:
        if Path(candidate).is_file():
            return Path(candidate)
    installed = [m for m in models.list() if m.is_present]
    if installed:
        default = next((m for m in installed if m.name == catalog.default), installed[0])
        return default.path
    default = catalog.default
    if not default:
        raise UsageError("no model is installed; `localllm pull NAME` installs one")
    if not sys.stdin.isatty():
        raise UsageError(f"no model is installed; run `localllm pull {default}`, then `localllm chat`")
    answer = input(f"No model is installed. Pull {default} ({catalog.models[default].repo}) now? [Y/n] ")
    if answer.strip().lower() not in ("", "y", "yes"):
        raise UsageError(f"nothing to chat with; `localllm pull {default}` (or any model) first")
    pull(default, catalog)
    return resolve(default, models, catalog)
