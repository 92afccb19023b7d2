"""The on-disk prefix cache with the real models: a new engine (as after a restart) loads a
long prompt from disk and answers as the first one did; damaged, truncated and foreign
entries, and KV bytes the runner does not take, are refused with one warning line and the
prompt is computed (these Qwen tests on both runners); Gemma 3's sliding window loads only
what gives the same logits (llama.cpp's: to the engine the torch runner has no window); the
chat app's resume hits the disk."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
from pathlib import Path

import pytest

from localllm.config import CacheConfig, EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.prefix_store import decode_entry, encode_header, entry_key
from localllm.engine.request import SamplingParams
from localllm.tui.backend import LocalBackend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runners import runner_names  # noqa: E402

pytestmark = pytest.mark.model

N_CTX = 2048
GREEDY = SamplingParams(temperature=0, max_tokens=12)
# 366 tokens: over the store's 256-token minimum (prefix_store.DEFAULT_MIN_TOKENS), no more.
SOURCE = "".join(f"def scale_{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(20))


def make_engine(model: Path, store: Path, runner: str = "llamacpp", **kwargs) -> LLMEngine:
    from localllm import paths

    engine = LLMEngine(EngineConfig(model_path=model, cache=CacheConfig(n_ctx=N_CTX), n_threads=2,
                                    prefix_cache_dir=store, runner=runner,
                                    weights_cache_dir=paths.weights_cache_dir(), **kwargs))
    assert engine.runner.name == runner
    return engine


def answer(engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY):
    return engine.generate([prompt], params)[0]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture(params=runner_names())
def runner(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def stored(qwen_path, tmp_path_factory):
    """Per runner, once a module: a prompt of ~370 tokens answered by a first engine, which
    stores it; (store, prompt, output)."""
    done = {}

    def get(runner: str):
        if runner not in done:
            store = tmp_path_factory.mktemp("prefix")
            engine = make_engine(qwen_path, store, runner)
            prompt = engine.tokenizer.encode(SOURCE + "# scale_20 comes next:\n")
            out = answer(engine, prompt)
            assert out.metrics.num_cached_tokens == 0
            engine.close()  # finishes the write
            done[runner] = store, prompt, out
        return done[runner]

    return get


@pytest.fixture
def cold(stored, runner):
    return stored(runner)


def copy_store(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_new_engine_loads_the_prompt_from_disk_and_answers_the_same(qwen_path, runner, cold, tmp_path):
    store, prompt, first = cold
    engine = make_engine(qwen_path, copy_store(store, tmp_path / "prefix"), runner)
    try:
        again = answer(engine, prompt)
        assert again.metrics.num_disk_cached_tokens == again.metrics.num_cached_tokens == len(prompt) - 1
        assert again.token_ids == first.token_ids
        assert engine.stats().num_disk_cached_tokens == len(prompt) - 1
        # A longer prompt that starts with it gets all of the stored tokens (the pool's copy,
        # which would win, is dropped first).
        engine.block_manager.reset_prefix_cache()
        longer = prompt + engine.tokenizer.encode("def scale_40(x):\n", add_special=False)
        out = answer(engine, longer)
        assert out.metrics.num_disk_cached_tokens == len(prompt)
        # The pool now holds the prompt's blocks: a third request takes them from memory.
        third = answer(engine, prompt)
        assert third.metrics.num_disk_cached_tokens == 0
        assert third.metrics.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    finally:
        engine.close()


def test_a_prompt_already_stored_is_not_written_again(qwen_path, runner, cold, tmp_path):
    store, prompt, _ = cold
    directory = copy_store(store, tmp_path / "prefix")
    engine = make_engine(qwen_path, directory, runner)
    try:
        answer(engine, prompt)
        engine.prefix_store.flush(30)
        assert engine.prefix_store.num_writes == 0
        sibling = prompt[:-20] + engine.tokenizer.encode("# the last one:\n", add_special=False)
        answer(engine, sibling)  # shares all but a few tokens: not worth a second copy on disk
        engine.prefix_store.flush(30)
        assert engine.prefix_store.num_writes == 0
        assert len(engine.prefix_store.index.entries()) == 1
    finally:
        engine.close()


def _foreign_entry(gemma_path: Path, prompt: list[int], tmp_path: Path) -> bytes:
    """The entry Gemma 3 writes for the same token ids: another model's KV bytes."""
    engine = make_engine(gemma_path, tmp_path / "gemma-prefix")
    try:
        answer(engine, prompt, SamplingParams(temperature=0, max_tokens=1))
        engine.prefix_store.flush(30)
        (entry,) = engine.prefix_store.index.entries()
        return engine.prefix_store.index.file(entry.key).read_bytes()
    finally:
        engine.close()


# Garbled, truncated and foreign entries are refused by the store's own checks before any runner
# sees them: on llama.cpp alone. KV bytes the runner does not take are each runner's to refuse.
DAMAGES = [(r, "cut-kv") for r in runner_names()] + [("llamacpp", d) for d in ("garbled", "truncated", "foreign")]


@pytest.mark.parametrize("runner, damage", DAMAGES)
def test_a_bad_entry_is_refused_with_one_warning_and_the_prompt_computed(
        qwen_path, gemma_path, runner, cold, tmp_path, caplog, damage):
    store, prompt, first = cold
    directory = copy_store(store, tmp_path / "prefix")
    engine = make_engine(qwen_path, directory, runner)
    path = engine.prefix_store.index.file(entry_key(engine.prefix_store.model, prompt))
    data = bytearray(path.read_bytes())
    if damage == "garbled":
        for i in range(1000, len(data), len(data) // 7):
            data[i] ^= 0x5A
        path.write_bytes(data)
    elif damage == "truncated":
        path.write_bytes(data[:len(data) * 2 // 3])
    elif damage == "foreign":
        path.write_bytes(_foreign_entry(gemma_path, prompt, tmp_path))
    else:  # an intact entry (its checksum made anew) whose KV bytes lack their last third
        model = engine.prefix_store.model
        token_ids, payload = decode_entry(data, model)
        payload = payload[:payload.nbytes * 2 // 3]
        path.write_bytes(encode_header(model, token_ids, payload) + bytes(payload))
    try:
        with caplog.at_level(logging.WARNING, logger="localllm"):
            out = answer(engine, prompt)
        (warning,) = warnings_of(caplog)
        reason = {"garbled": "checksum mismatch", "truncated": "truncated", "foreign": "another model",
                  "cut-kv": f"the {runner} runner did not accept its KV bytes"}[damage]
        assert path.name in warning and reason in warning
        assert out.metrics.num_cached_tokens == 0 and out.token_ids == first.token_ids
        engine.prefix_store.flush(30)
        assert engine.prefix_store.num_writes == 1  # computed in full, so stored again
    finally:
        engine.close()
    engine = make_engine(qwen_path, directory, runner)
    try:
        assert answer(engine, prompt).metrics.num_disk_cached_tokens == len(prompt) - 1
    finally:
        engine.close()


def test_gemma_sliding_window_loads_only_what_gives_the_same_logits(gemma_path, tmp_path, caplog):
    store = tmp_path / "prefix"
    engine = make_engine(gemma_path, store)
    text = "".join(f"Line {i}: the fox number {i} jumps over {i * 7} lazy dogs.\n" for i in range(60))
    prompt = engine.tokenizer.encode(text)
    assert len(prompt) > 2 * engine.runner.n_swa
    first = answer(engine, prompt)
    engine.close()
    engine = make_engine(gemma_path, store)
    try:
        with caplog.at_level(logging.WARNING, logger="localllm"):
            # Sent again: the stored window reaches back far enough for the last token.
            again = answer(engine, prompt)
            assert again.metrics.num_disk_cached_tokens == len(prompt) - 1
            assert again.token_ids == first.token_ids
            # Cut well inside the stored prompt: the window kept on disk does not reach back
            # over the cut's own window, so nothing is loaded and the prompt is computed.
            engine.block_manager.reset_prefix_cache()
            cut = prompt[:len(prompt) - engine.runner.n_swa // 2] + [prompt[0]]
            out = answer(engine, cut)
            assert out.metrics.num_cached_tokens == 0
        assert warnings_of(caplog) == []  # an inexact prefix is no damage
    finally:
        engine.close()


def test_the_chat_apps_resume_after_a_restart_loads_the_conversation(qwen_path, tmp_path):
    config = EngineConfig(model_path=qwen_path, cache=CacheConfig(n_ctx=N_CTX), n_threads=2,
                          prefix_cache_dir=tmp_path / "prefix")
    conversation = [{"role": "system", "content": "You review Python code."},
                    {"role": "user", "content": "Review this:\n" + SOURCE},
                    {"role": "assistant", "content": "It is repetitive; a loop or a dict would do."}]

    def warm_and_count() -> int:
        backend = LocalBackend(config)
        backend.load()
        try:
            asyncio.run(asyncio.wait_for(backend.warm(conversation), 60))
            return backend._engine.engine.stats().num_disk_cached_tokens
        finally:
            backend.close()

    assert warm_and_count() == 0  # the first run computes and stores it
    assert warm_and_count() > 300  # the next start loads it
