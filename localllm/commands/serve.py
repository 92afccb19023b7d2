"""`localllm serve`: every installed model behind one port (server/models.py), the pinned ones
(`--model`, `--embedding-model`) loaded before it starts; the HTTP API is server/app.py."""

from __future__ import annotations

import sys
from pathlib import Path

from localllm.config import EngineConfig, ServerConfig


def serve(engine_config: EngineConfig, server_config: ServerConfig, pinned: list[Path] | None = None,
          keep_alive: str = "5m", upstreams: list | None = None) -> int:
    """``pinned``: the files of --model (none: every installed model, each on demand)."""
    import uvicorn

    from localllm.server.app import create_app
    from localllm.server.limits import header_timeout_protocol
    from localllm.server.models import serve_models

    embedding = [server_config.embedding_model] if server_config.embedding_model is not None else []
    models = serve_models(engine_config, server_config, pinned or [], embedding, keep_alive, upstreams or [])
    loader = models.loader
    try:
        loaded = loader.preload()
        app = create_app(models, server_config)

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                # End in-flight streams with an error event first, so shutdown never waits on them.
                models.shutdown_streams()
                super().handle_exit(sig, frame)
                # uvicorn re-raises the signal after its shutdown, which would kill the process
                # (exit -15) before the engines are closed; a clean shutdown exits 0 instead.
                captured = getattr(self, "_captured_signals", None)
                if captured is not None:
                    captured.clear()

            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started:
                    port = next((s.getsockname()[1] for srv in self.servers for s in srv.sockets), server_config.port)
                    _banner(server_config, port, models, loaded)

        config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level="warning",
                                timeout_graceful_shutdown=5, access_log=False,
                                http=header_timeout_protocol(server_config.read_timeout_s))
        _Server(config).run()
    finally:
        loader.close_preloaded()
        for model in models.loaded():  # the lifespan's close did not run (a failed start)
            model.close()
    return 0


def _banner(server_config: ServerConfig, port: int, models, loaded) -> None:
    from localllm.server.errors import APIError

    base = f"http://{server_config.host}:{port}/v1"
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        default = models.entry(None, "text").name
    except APIError:  # embedding models only
        default = None
    say(f"localllm serve: {base}  model {default or '(none: embedding models only)'}")
    chats = [model for model in loaded if model.server is not None]
    for model in chats:
        engine = model.server.engine.engine
        of = "" if len(chats) == 1 else f" of {model.entry.name}"
        runner = engine.runner
        why = getattr(runner, "chosen_because", None)
        say(f"Runner{of}: {runner.name}" + (f" ({why})" if why else ""))
        if engine.kv_pool_summary:
            say(f"KV cache{of}: {engine.kv_pool_summary}")
        say(f"Context{of}: {engine.max_model_len} tokens per request, prompt and answer together")
    on_demand = [e.name for e in models.manager.entries if not e.pinned]
    if on_demand:
        say(f"Also served, loaded on the first request that names one: {', '.join(on_demand)}")
    for upstream in models.forwarder.upstreams.values():
        say(f"Forwarded: {upstream.name} -> {upstream.url} (model {upstream.model})")
    if default is not None:
        say(f"Editors: add an OpenAI-compatible provider with base URL {base}, model {default}"
            f"{', and your --api-key' if server_config.api_key else ', any API key'}")
