"""The models one `localllm serve` serves: every installed model (`localllm ls`), the pinned
ones (`--model`, `--embedding-model`) loaded at start and kept, the rest loaded by the first
request that names them and unloaded by the model manager (localllm/manager.py) when their
keep_alive runs out or another needs the memory.

A door takes a ``Lease`` on the model a request names for as long as it serves the request —
to the end of its stream (``Lease.hand_over``) — so no model is unloaded under a request.
The manager's errors come out here as ``APIError``s, which each door answers in its own shape:
an unknown name 404 (listing the served names), a model too large for the memory 400 (with
its sizes), memory held by busy models 503 (Retry-After), a model of the wrong kind 400, a
``keep_alive`` that is no duration 400.

Memory: the budget is what was free at start (available RAM; `--memory` when given) less the
headroom of memory.py. Each model is planned by memory.plan against the whole budget: its
weights and a KV pool of ``--ctx`` tokens, or of what fits up to its trained context; a model
needs those bytes free (the budget less what the loaded models took) or the manager makes room.
Pinned models must fit together at start (else `serve` exits 2 with each one's size). With the
small models of an editor (a chat model, a FIM model, an embedding model) all of them fit side
by side on a laptop. The planning is memory.SharedMemory's, which the chat app shares.

The engines of the loaded models step freely, each on its own thread, and each engine's
ThreadChooser (engine/threads.py) sees the other's steps as load and moves to fewer threads:
two busy models on 2 cores settle near one core each. Measured against steps taking turns under
one lock, each on every core (docs/benchmarks.md, "Several models behind one port"), stepping
freely gave the pair 1.2-1.5x the tokens/s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.responses import Response

from localllm.config import EngineConfig, ServerConfig
from localllm.errors import LocalLLMError, ModelBusy, ModelLoadError, ModelNotFound, ModelTooLarge, UsageError
from localllm.manager import ModelEntry, ModelManager
from localllm.server.core import Server
from localllm.server.errors import APIError
from localllm.server.metrics import ServerMetrics
from localllm.server.upstream import Forwarder, Upstream

log = logging.getLogger("localllm.server")


@dataclass(eq=False)
class LoadedModel:
    """One model the manager loaded: a chat or completion model's request path (``server``),
    or an embedding model (``embedder``)."""

    entry: ModelEntry
    server: Server | None = None
    embedder: Any = None
    owned: bool = True  # False: the caller built it and closes it (ServedModels.of)
    load_s: float | None = None  # how long its load took, when loaded before the manager took it

    def shutdown(self) -> None:
        """End the streams in flight with an error (the server is stopping); close() follows."""
        if self.server is not None and self.owned:
            self.server.engine.shutdown()

    def close(self) -> None:
        if not self.owned:
            return
        if self.server is not None:
            self.server.engine.shutdown()
            self.server.engine.engine.close()
        if self.embedder is not None:
            self.embedder.close()


class LeasedResponse(Response):
    """A streamed response that releases its model's lease when it has been sent (or the client
    left): the lease lasts as long as the stream."""

    def __init__(self, inner: Response, release) -> None:
        self.inner, self._release = inner, release
        self.background = None
        self.status_code = inner.status_code

    async def __call__(self, scope, receive, send) -> None:
        if self.background is not None and self.inner.background is None:
            self.inner.background = self.background
        try:
            await self.inner(scope, receive, send)
        finally:
            await self._release()


@dataclass(eq=False)
class Lease:
    model: LoadedModel
    _stack: contextlib.AsyncExitStack
    handed: bool = False

    @property
    def server(self) -> Server:
        return self.model.server

    @property
    def embedder(self):
        return self.model.embedder

    def hand_over(self, response):
        """``response`` itself, or, for a streamed one, a response that holds the lease until
        the stream ends (the lease no longer ends with the door's ``async with``)."""
        from fastapi.responses import StreamingResponse

        if not isinstance(response, StreamingResponse):
            return response
        self.handed = True
        return LeasedResponse(response, self._stack.aclose)


class ServedModels:
    """The door's side of the manager: leases by name and kind, with errors as APIErrors."""

    def __init__(self, manager: ModelManager, metrics: ServerMetrics | None = None,
                 plans: dict[str, int] | None = None, upstreams: Sequence[Upstream] = ()):
        self.manager = manager
        self.forwarder = Forwarder(list(upstreams))
        for upstream in upstreams:
            if upstream.name in {n for e in manager.entries for n in e.names}:
                raise UsageError(f"the upstream {upstream.name!r} has the name of an installed model; "
                                 "give the upstream another name")
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._planned_ctx = plans if plans is not None else {}  # entry name -> KV tokens (for /v1/models)
        self._started = False
        self.loader: Loader | None = None  # serve_models' (None for ServedModels.of)
        self._unknown_names: set[str] = set()  # logged by entry(unknown_is_default=True); at most 64

    @classmethod
    def of(cls, engine, model_path: Path, config: ServerConfig, embedder=None) -> "ServedModels":
        """Models already loaded (an engine and an embedder built by the caller), pinned: one
        server over them, as the tests and an in-process caller build it."""
        metrics = ServerMetrics()
        n_ctx_train = trained_context(model_path)
        entries = [ModelEntry(Path(model_path).stem, Path(model_path), pinned=True)]
        built = {entries[0].name: LoadedModel(entries[0], owned=False, server=Server(
            engine, model_path, config, n_ctx_train, metrics=metrics))}
        if embedder is not None:
            path = Path(getattr(embedder, "path", Path(embedder.name + ".gguf")))
            entry = ModelEntry(embedder.name, path, kind="embedding", pinned=True)
            entries.append(entry)
            built[entry.name] = LoadedModel(entry, embedder=embedder, owned=False)
        manager = ModelManager(entries, load=lambda e: built[e.name], need_bytes=lambda e: 0,
                               free_bytes=lambda: None)
        return cls(manager, metrics)

    async def start(self) -> None:
        if not self._started:
            self._started = True
            await self.manager.start()

    async def close(self) -> None:
        await self.manager.close()
        await self.forwarder.close()

    def upstream(self, name: str | None) -> Upstream | None:
        """The upstream server that serves ``name``, if one does (upstream.py)."""
        return self.forwarder.get(name)

    def shutdown_streams(self) -> None:
        """End every loaded model's streams in flight (the server was asked to stop)."""
        for model in self.loaded():
            model.shutdown()

    def loaded(self) -> list[LoadedModel]:
        return self.manager.loaded_models()

    def entry(self, name: str | None, kind: str, unknown_is_default: bool = False) -> ModelEntry:
        """The entry a request's ``model`` names, for a door of ``kind`` ("text": chat and
        completion models; "embedding"); None or "": the door's default model (llama-server
        takes "" so, and llama.vim sends it when no model is configured).

        ``unknown_is_default``, for llama-server's own routes (/infill): a name this server does
        not serve is the default model too, as llama-server, which serves one model, reads no
        name there. llama.vscode sends its setting `ai_model` (by default OpenRouter's
        "google/gemini-2.5-flash") to whatever endpoint it has; a 404 would leave its editor
        with no completions and no word why. The server's log says so, once a name."""
        if name is not None and not name.strip():
            name = None
        if name is not None and unknown_is_default and self.upstream(name) is None:
            try:
                self.manager.resolve(name)
            except ModelNotFound:
                if name not in self._unknown_names and len(self._unknown_names) < 64:
                    self._unknown_names.add(name)
                    log.warning("a request to llama-server's routes named the model '%s', which this server "
                                "does not serve: answered by its default model, as llama-server answers", name)
                name = None
        entries = self.manager.entries
        upstream = self.upstream(name)
        if upstream is not None:
            raise APIError(400, f"'{name}' is served by the upstream server {upstream.url}, reached through "
                                "OpenAI's routes only: /v1/chat/completions, /v1/completions and /v1/embeddings",
                           param="model", code="model_is_upstream")
        try:
            if name is None:
                fits = [e for e in entries if (e.kind == "embedding") == (kind == "embedding")]
                if not fits:
                    raise APIError(404 if kind == "embedding" else 400, _no_model_of(kind, entries),
                                   param="model", code="model_not_found")
                # The first pinned, else the first chat model (a base model answers no chat).
                return next((e for e in fits if e.pinned), next((e for e in fits if e.kind == "chat"), fits[0]))
            entry = self.manager.resolve(name)
        except ModelNotFound:
            raise APIError(404, self.not_found(name), param="model", code="model_not_found") from None
        if kind == "embedding" and entry.kind != "embedding":
            embedders = [e.name for e in entries if e.kind == "embedding"]
            raise APIError(400, f"'{name}' is a {entry.kind} model, not an embedding model; "
                                + (f"this server embeds with {', '.join(map(repr, embedders))}" if embedders else
                                   "install one (e.g. `localllm pull nomic-embed-text:v1.5`) and name it"),
                           param="model", code="model_not_embedding")
        if kind != "embedding" and entry.kind == "embedding":
            raise APIError(400, f"'{name}' is an embedding model: it answers /v1/embeddings only; name a chat model "
                                f"({', '.join(e.name for e in entries if e.kind != 'embedding') or 'none installed'})",
                           param="model", code="model_not_chat")
        return entry

    def not_found(self, name: str) -> str:
        served = [e.name for e in self.manager.entries] + list(self.forwarder.upstreams)
        return (f"The model '{name}' does not exist; this server serves {', '.join(map(repr, served)) or 'none'} "
                "(see GET /v1/models; `localllm pull NAME` installs one)")

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None, keep_alive: object = None, kind: str = "text",
                    unknown_is_default: bool = False) -> AsyncIterator[Lease]:
        """The loaded model ``name`` reaches (loading it), held until the block exits — or, for a
        response handed over (Lease.hand_over), until that response is sent."""
        entry = self.entry(name, kind, unknown_is_default)
        await self.start()
        stack = contextlib.AsyncExitStack()
        try:
            model = await stack.enter_async_context(self.manager.lease(entry.name, keep_alive))
        except UsageError as e:
            if isinstance(e, ModelNotFound):
                raise APIError(404, self.not_found(entry.name), param="model", code="model_not_found") from None
            raise APIError(400, str(e), param="keep_alive") from None
        except ModelTooLarge as e:
            raise APIError(400, str(e), param="model", code="model_too_large") from None
        except ModelBusy as e:
            raise APIError(503, str(e), type_="server_error", code="server_busy", headers={"Retry-After": "5"}) from None
        except ModelLoadError as e:
            raise APIError(400, str(e), param="model", code="model_load_failed") from None
        except (LocalLLMError, OSError, RuntimeError, ValueError) as e:  # the runner's, llama.cpp's, the file's
            raise APIError(500, f"{entry.name} could not be loaded: {e}", type_="server_error",
                           code="model_load_failed") from None
        held = Lease(model, stack)
        try:
            yield held
        finally:
            if not held.handed:
                await stack.aclose()

    def ctx_of(self, entry: ModelEntry) -> int | None:
        """The tokens one request to ``entry`` may hold: the loaded engine's, else the plan's."""
        for model in self.loaded():
            if model.entry is entry:
                if model.server is not None:
                    return model.server.max_model_len
                return model.embedder.n_ctx
        return self._planned_ctx.get(entry.name)


def trained_context(path: Path) -> int | None:
    """The context the model at ``path`` was trained for, from its GGUF; None where the file
    does not say (or cannot be read: the runner's load says why)."""
    from localllm.gguf import read_info

    try:
        return read_info(path).context_length
    except (OSError, LocalLLMError):
        return None


def _no_model_of(kind: str, entries: Sequence[ModelEntry]) -> str:
    if kind == "embedding":
        return ("no embedding model (such as all-MiniLM-L6-v2 or nomic-embed-text) is served here, so it serves "
                "no embeddings; install one (e.g. `localllm pull nomic-embed-text:v1.5`) and name it")
    return (f"no chat model is served here (only embedding models: {', '.join(e.name for e in entries)}); "
            "install one with `localllm pull qwen2.5-coder:0.5b`")


# -- building the models of `localllm serve` ---------------------------------------------------


def model_kind(path: Path) -> str:
    """chat (a chat template), completion (none: a base model, e.g. for FIM) or embedding."""
    from localllm.engine.embedder import embedding_pooling
    from localllm.gguf import read_info

    info = read_info(path)
    if embedding_pooling(info) is not None:
        return "embedding"
    return "chat" if info.chat_template else "completion"


def installed_entries(pinned: Sequence[Path], embedding: Sequence[Path] = ()) -> list[ModelEntry]:
    """Every model to serve: the pinned files (in the order given), then every installed model
    (``localllm ls``: its name first, then its file's stem) not among them. A file that is not a
    readable GGUF is left out of the installed ones (with a warning); a pinned one raises."""
    from localllm.commands.models import open_store

    entries: list[ModelEntry] = []
    installed = {m.path.resolve(): m for m in open_store().list() if m.is_present}
    seen: set[Path] = set()
    for path in [*pinned, *embedding]:
        path = Path(path)
        model = installed.get(path.resolve())
        kind = model_kind(path)
        if path in embedding and kind != "embedding":
            raise UsageError(f"--embedding-model {path.name} is not an embedding model (no pooling type in its "
                             "metadata); give one such as all-MiniLM-L6-v2 or nomic-embed-text")
        entries.append(ModelEntry(model.name if model else path.stem, path, kind=kind, pinned=True))
        seen.add(path.resolve())
    for resolved, model in installed.items():
        if resolved in seen:
            continue
        try:
            kind = model_kind(model.path)
        except LocalLLMError as e:
            log.warning("not serving %s: %s", model.name, e)
            continue
        entries.append(ModelEntry(model.name, model.path, kind=kind))
    names: set[str] = set()
    unique = []
    for entry in entries:  # two files of one stem: the second is reached by its own name only
        if entry.name in names:
            entry = ModelEntry(f"{entry.name}-{len(unique)}", entry.path, entry.kind, entry.pinned)
        names.add(entry.name)
        unique.append(entry)
    return unique


class Loader:
    """Loads the models of one `localllm serve` for the ModelManager, planned by
    memory.SharedMemory (see the module docstring for the rule)."""

    def __init__(self, base: EngineConfig, config: ServerConfig, metrics: ServerMetrics):
        from localllm.memory import SharedMemory

        self.base, self.config, self.metrics = base, config, metrics
        self.memory = SharedMemory(base)
        self.preloaded: dict[str, LoadedModel] = {}  # loaded before the server's loop started

    @property
    def manager(self) -> ModelManager | None:
        return self.memory.manager

    @manager.setter
    def manager(self, manager: ModelManager) -> None:
        self.memory.manager = manager

    @property
    def budget(self) -> int | None:
        return self.memory.budget

    def need_bytes(self, entry: ModelEntry) -> int:
        return self.memory.need_bytes(entry)

    def free_bytes(self) -> int | None:
        return self.memory.free_bytes()

    def load(self, entry: ModelEntry) -> LoadedModel:
        from localllm.engine.engine import AsyncEngine, LLMEngine

        if entry.name in self.preloaded:
            return self.preloaded.pop(entry.name)
        if entry.kind == "embedding":
            from localllm.engine.embedder import Embedder

            return LoadedModel(entry, embedder=Embedder(entry.path, n_threads=self.base.n_threads or None))
        engine = AsyncEngine(LLMEngine(self.memory.config_for(entry)))
        server = Server(engine, entry.path, self.config, trained_context(entry.path), name=entry.name,
                        metrics=self.metrics)
        return LoadedModel(entry, server=server)

    def preload(self) -> list[LoadedModel]:
        """Load the pinned models now, before the server starts (a load error stops `serve`
        with its message); the manager takes them at its start."""
        for entry in self.manager.entries:
            if entry.pinned and entry.name not in self.preloaded:
                start = time.perf_counter()
                model = self.load(entry)
                model.load_s = time.perf_counter() - start
                self.preloaded[entry.name] = model
        return list(self.preloaded.values())

    def close_preloaded(self) -> None:
        """Close what was preloaded and never taken (the server did not start)."""
        while self.preloaded:
            self.preloaded.popitem()[1].close()

    def check_pinned(self, entries: Sequence[ModelEntry]) -> None:
        """Refuse to start (UsageError: exit 2) when the pinned models cannot fit together."""
        pinned = [e for e in entries if e.pinned]
        if self.budget is None or not pinned:
            return
        sizes = [(e.name, self.need_bytes(e)) for e in pinned]
        total = sum(n for _, n in sizes)
        if total > self.budget:
            each = ", ".join(f"{name} {_gib(n)}" for name, n in sizes)
            raise UsageError(f"the pinned models do not fit together: they need {_gib(total)} ({each}) and "
                             f"{_gib(self.budget)} is free for models ({self.memory.where}, less headroom); pin fewer "
                             "(--model), lower --ctx, or allow more memory (--memory)")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def serve_models(base: EngineConfig, config: ServerConfig, pinned: Sequence[Path],
                 embedding: Sequence[Path] = (), keep_alive: str | float = "5m",
                 upstreams: Sequence[Upstream] = ()) -> ServedModels:
    """The ServedModels of `localllm serve`, before anything is loaded; raises UsageError when
    no model is installed or the pinned ones cannot fit together."""
    entries = installed_entries(pinned, embedding)
    if not entries and not upstreams:
        raise UsageError("no models to serve: none is installed; `localllm pull qwen2.5-coder:0.5b` installs one, "
                         "or give a file with --model PATH")
    metrics = ServerMetrics()
    loader = Loader(base, config, metrics)
    loader.check_pinned(entries)
    manager = ModelManager(entries, load=loader.load, need_bytes=loader.need_bytes, free_bytes=loader.free_bytes,
                           keep_alive_s=keep_alive, on_load=metrics.observe_load)
    loader.manager = manager
    served = ServedModels(manager, metrics, plans=loader.memory.ctx, upstreams=upstreams)
    served.loader = loader
    return served
