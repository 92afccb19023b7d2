"""Engines shared by the whole test session: loading a model (and, on the torch runner, reading
its converted weights) costs more than most tests, so every test that can share one takes it
from ``EnginePool.get``, which hands out the engine of that configuration after
``LLMEngine.reset()`` (every request aborted, the KV storage emptied, counters at zero: the
next request is computed as on a new engine; tests/integration/test_engine.py holds reset to
that). A test that needs a restart, a prefix-cache folder or a damaged file builds its own."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from localllm.config import CacheConfig, EngineConfig, SchedulerConfig
from localllm.engine.engine import LLMEngine

MAX_LOADED = 6  # the least recently used is closed first


def engine_config(model_path: Path, runner: str = "llamacpp", n_ctx: int = 4096, batch_tokens: int = 256,
                  max_num_seqs: int = 16, **config) -> EngineConfig:
    """The tests' engine: 2 threads, the session's own weights cache (see conftest.py), so only
    the first torch engine of a session converts a file's weights."""
    from localllm import paths

    return EngineConfig(
        model_path=model_path,
        cache=CacheConfig(n_ctx=n_ctx),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=batch_tokens),
        n_threads=2, runner=runner, weights_cache_dir=paths.weights_cache_dir(), **config)


class EnginePool:
    def __init__(self) -> None:
        self._engines: OrderedDict[EngineConfig, LLMEngine] = OrderedDict()

    def get(self, model_path: Path, runner: str = "llamacpp", **config) -> LLMEngine:
        """The session's engine of this configuration (see engine_config), reset."""
        key = engine_config(model_path, runner, **config)
        engine = self._engines.pop(key, None)
        if engine is None:
            while len(self._engines) >= MAX_LOADED:
                self._engines.popitem(last=False)[1].close()
            engine = LLMEngine(key)
            assert engine.runner.name == runner
        else:
            engine.reset()
        self._engines[key] = engine
        return engine

    def close(self) -> None:
        while self._engines:
            self._engines.popitem()[1].close()
