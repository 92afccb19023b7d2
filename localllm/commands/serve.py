"""`localllm serve`: load the model, start the engine thread, serve its HTTP API (server/app.py)."""

from __future__ import annotations

import sys

from localllm.config import EngineConfig, ServerConfig
from localllm.errors import UsageError


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    import uvicorn

    from localllm.engine.engine import AsyncEngine, LLMEngine
    from localllm.server.app import create_app
    from localllm.server.limits import header_timeout_protocol

    embedder = None
    if server_config.embedding_model is not None:
        from localllm.engine.embedder import Embedder, is_embedding_model

        if not is_embedding_model(server_config.embedding_model):
            raise UsageError(f"--embedding-model {server_config.embedding_model.name} is not an embedding model "
                             "(no pooling type in its metadata); give one such as all-MiniLM-L6-v2 or nomic-embed-text")
        embedder = Embedder(server_config.embedding_model, n_threads=engine_config.n_threads or None)
    if is_chat_model_an_embedder(engine_config.model_path):
        raise UsageError(f"--model {engine_config.model_path.name} is an embedding model; serve a chat model with "
                         f"--model and this one with --embedding-model {engine_config.model_path}")
    engine = AsyncEngine(LLMEngine(engine_config))
    app = create_app(engine, engine_config.model_path, server_config, embedder)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # End in-flight streams with an error event first, so shutdown never waits on them.
            engine.shutdown()
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after its shutdown, which would kill the process
            # (exit -15) before the engine is closed; a clean shutdown exits 0 instead.
            captured = getattr(self, "_captured_signals", None)
            if captured is not None:
                captured.clear()

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                port = next((s.getsockname()[1] for srv in self.servers for s in srv.sockets), server_config.port)
                base = f"http://{server_config.host}:{port}/v1"
                model = app.state.server.model_id
                print(f"localllm serve: {base}  model {model}", file=sys.stderr, flush=True)
                if engine.engine.kv_pool_summary:
                    print(f"KV cache: {engine.engine.kv_pool_summary}", file=sys.stderr, flush=True)
                print(f"Context: {engine.engine.max_model_len} tokens per request, prompt and answer together",
                      file=sys.stderr, flush=True)
                print(f"Editors: add an OpenAI-compatible provider with base URL {base}, model {model}"
                      f"{', and your --api-key' if server_config.api_key else ', any API key'}",
                      file=sys.stderr, flush=True)

    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level="warning",
                            timeout_graceful_shutdown=5, access_log=False,
                            http=header_timeout_protocol(server_config.read_timeout_s))
    try:
        _Server(config).run()
    finally:
        engine.shutdown()
        engine.engine.close()
        if embedder is not None:
            embedder.close()
    return 0


def is_chat_model_an_embedder(path) -> bool:
    from localllm.engine.embedder import is_embedding_model
    from localllm.errors import LocalLLMError

    try:
        return is_embedding_model(path)
    except LocalLLMError:  # an unreadable file: the engine's load says what is wrong with it
        return False
