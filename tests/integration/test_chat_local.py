"""The chat app's LocalBackend on the real Qwen file: a greedy turn, the prefix cache across
turns and after warm(), stop() mid-answer, and a conversation too long for the context."""

from __future__ import annotations

import asyncio

import pytest

from localllm.config import CacheConfig, EngineConfig
from localllm.errors import ContextOverflowError
from localllm.tui.backend import Chunk, GenerationSettings, LocalBackend, reserve_for

pytestmark = pytest.mark.model

N_CTX = 2048
BLOCK = 16
WAIT_S = 60
GREEDY = GenerationSettings(temperature=0, top_p=1.0, max_tokens=16)
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def make_backend(qwen_path) -> LocalBackend:
    backend = LocalBackend(EngineConfig(model_path=qwen_path, cache=CacheConfig(n_ctx=N_CTX), n_threads=2))
    backend.load()
    return backend


@pytest.fixture(scope="module")
def backend(qwen_path):
    backend = make_backend(qwen_path)
    yield backend
    backend.close()
    assert backend._engine is None


@pytest.fixture
def fresh_backend(qwen_path):
    backend = make_backend(qwen_path)
    yield backend
    backend.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))


async def collect(backend: LocalBackend, messages: list[dict], settings: GenerationSettings) -> list[Chunk]:
    return [chunk async for chunk in backend.stream(messages, settings)]


def assert_idle(backend: LocalBackend) -> None:
    figures = run(backend.engine_figures())
    assert (figures.kv_used, figures.num_running, figures.num_waiting) == (0, 0, 0)
    assert figures.kv_total == N_CTX


def assert_well_formed(chunks: list[Chunk], finish_reason: str) -> None:
    assert chunks[-1].finished and chunks[-1].finish_reason == finish_reason
    assert all(not c.finished and c.finish_reason is None for c in chunks[:-1])


def test_loaded_backend(backend, qwen_path):
    assert (backend.model_name, backend.n_ctx) == (qwen_path.name, N_CTX)
    assert_idle(backend)


def test_greedy_answer(backend):
    chunks = run(collect(backend, FRANCE, GREEDY))
    assert_well_formed(chunks, "stop")
    text = "".join(c.text for c in chunks)
    assert text.strip().rstrip(".") == "Paris"
    assert all(c.num_tokens == 1 for c in chunks)  # one token per engine step, the end-of-turn one too
    num_prompt = backend.count_tokens(FRANCE)
    assert num_prompt == len(backend.tokenizer.apply_chat_template(FRANCE))
    # The prompt figures come with the first chunk and again with the last one, never in between.
    assert chunks[0].prompt_tokens == chunks[-1].prompt_tokens == num_prompt
    assert all(c.prompt_tokens is None and c.cached_tokens is None for c in chunks[1:-1])
    assert chunks[0].cached_tokens == chunks[-1].cached_tokens
    assert chunks[0].cached_tokens % BLOCK == 0
    assert_idle(backend)

    again = run(collect(backend, FRANCE, GREEDY))
    assert "".join(c.text for c in again) == text  # greedy: the same answer
    assert again[0].cached_tokens == (num_prompt - 1) // BLOCK * BLOCK  # every full block but the last token's


def test_second_turn_reuses_the_first_turn_s_blocks(backend):
    first = [{"role": "user", "content": "Name a prime number between 20 and 30. Answer with the number only."}]
    answer = "".join(c.text for c in run(collect(backend, first, GREEDY)))
    second = first + [{"role": "assistant", "content": answer},
                      {"role": "user", "content": "And one between 40 and 50?"}]
    first_ids = backend.tokenizer.apply_chat_template(first)
    second_ids = backend.tokenizer.apply_chat_template(second)
    assert second_ids[:len(first_ids)] == first_ids  # the second turn extends the first

    chunks = run(collect(backend, second, GREEDY))
    assert_well_formed(chunks, "stop")
    cached = chunks[0].cached_tokens
    assert cached > 0 and cached % BLOCK == 0
    assert len(first_ids) // BLOCK * BLOCK <= cached <= len(second_ids) - 1
    assert chunks[0].prompt_tokens == chunks[-1].prompt_tokens == len(second_ids) == backend.count_tokens(second)
    assert_idle(backend)


def test_warm_computes_a_resumed_conversation_ahead(fresh_backend):
    backend = fresh_backend
    conversation = [{"role": "system", "content": "You are a terse geography tutor."},
                    {"role": "user", "content": "What is the capital of Italy? Answer in one word."},
                    {"role": "assistant", "content": "Rome."}]
    warm_ids = backend.tokenizer.apply_chat_template(conversation, add_generation_prompt=False)
    turn = conversation + [{"role": "user", "content": "And of Spain?"}]
    turn_ids = backend.tokenizer.apply_chat_template(turn)
    assert turn_ids[:len(warm_ids)] == warm_ids
    assert len(warm_ids) >= 2 * BLOCK

    run(backend.warm(conversation))
    figures = run(backend.engine_figures())
    assert figures.kv_used == 0  # warm's own request is over
    assert figures.kv_cached >= len(warm_ids) // BLOCK * BLOCK

    chunks = run(collect(backend, turn, GREEDY))
    assert_well_formed(chunks, "stop")
    assert chunks[0].cached_tokens == len(warm_ids) // BLOCK * BLOCK
    assert chunks[0].prompt_tokens == len(turn_ids)
    assert_idle(backend)


def test_a_fresh_backend_has_nothing_cached(fresh_backend):
    """The other half of the warm() test: without warm() the same turn finds nothing."""
    turn = [{"role": "user", "content": "What is the capital of Spain? Answer in one word."}]
    chunks = run(collect(fresh_backend, turn, GREEDY))
    assert chunks[0].cached_tokens == 0


def test_warm_with_no_messages_does_nothing(backend):
    before = run(backend.engine_figures())
    run(backend.warm([]))
    assert run(backend.engine_figures()) == before


def test_stop_during_a_long_answer(backend):
    messages = [{"role": "user", "content": "Count from 1 to 500, one number per line."}]
    settings = GenerationSettings(temperature=0, top_p=1.0, max_tokens=500)

    async def main() -> tuple[list[Chunk], int]:
        chunks, num_at_stop = [], 0
        async for chunk in backend.stream(messages, settings):
            chunks.append(chunk)
            if len(chunks) == 4:
                num_at_stop = len(chunks)
                backend.stop()
        return chunks, num_at_stop

    chunks, num_at_stop = run(main())
    assert num_at_stop == 4
    assert_well_formed(chunks, "abort")
    assert chunks[-1].num_tokens == 0 and chunks[-1].text == ""
    assert chunks[-1].prompt_tokens == backend.count_tokens(messages)
    assert len(chunks) < 20  # ended at once, not after 500 tokens
    assert backend._request_id is None
    assert_idle(backend)  # every block went back
    backend.stop()  # nothing streams now: a no-op

    after = run(collect(backend, FRANCE, GREEDY))  # the engine still answers
    assert_well_formed(after, "stop")


def test_a_conversation_too_long_fails_before_any_chunk(backend):
    settings = GenerationSettings(temperature=0, top_p=1.0, max_tokens=16)
    limit = N_CTX - reserve_for(settings, N_CTX)
    assert limit == N_CTX - 16

    def messages(num_words: int) -> list[dict]:
        return [{"role": "user", "content": " ".join(["hello"] * num_words)}]

    # "hello", then one " hello" token per further word
    num_words = 1 + limit + 1 - backend.count_tokens(messages(1))
    too_long = messages(num_words)
    assert backend.count_tokens(too_long) == limit + 1  # one token over the line

    async def main() -> list[Chunk]:
        chunks = []
        with pytest.raises(ContextOverflowError) as e:
            async for chunk in backend.stream(too_long, settings):
                chunks.append(chunk)
        assert str(e.value) == f"the conversation is {limit + 1:,} tokens and the context holds {N_CTX:,}"
        return chunks

    assert run(main()) == []
    assert_idle(backend)
    assert backend._request_id is None
