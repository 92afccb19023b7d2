"""AsyncEngine over a real LLMEngine on the Qwen file: concurrent asyncio streams, leaving a
stream early, aborting from another thread, and a bad request that fails only its own stream."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from localllm.engine.engine import AsyncEngine, RequestOutput
from localllm.engine.request import FinishReason, SamplingParams
from localllm.errors import ContextOverflowError, UsageError


GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)  # runs until aborted
PROMPTS = ["def quicksort(arr):", "def binary_search(arr, target):", "def is_prime(n):",
           "def merge_sort(arr):"]
WAIT_S = 60


@pytest.fixture(scope="module")
def async_engine(engines, qwen_path):
    async_engine = AsyncEngine(engines.get(qwen_path))
    yield async_engine
    async_engine.shutdown()
    assert not async_engine._thread.is_alive()


@pytest.fixture(scope="module")
def references(async_engine) -> dict[str, RequestOutput]:
    """Each prompt generated alone by LLMEngine.generate, on the engine thread."""
    def alone(engine):
        return {p: engine.generate([p], GREEDY)[0] for p in PROMPTS}

    return async_engine.call(alone).result(timeout=WAIT_S)


@pytest.fixture(autouse=True)
def ends_idle(async_engine):
    yield
    idle = async_engine.call(lambda e: (e.has_unfinished, e.block_manager.num_used_blocks))
    assert idle.result(timeout=WAIT_S) == (False, 0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))


async def collect(agen) -> list[RequestOutput]:
    return [out async for out in agen]


def assert_matches(outputs: list[RequestOutput], reference: RequestOutput) -> None:
    assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
    assert outputs[-1].finish_reason == reference.finish_reason
    assert [t for o in outputs for t in o.token_ids] == reference.token_ids
    assert "".join(o.text for o in outputs) == reference.text


def test_four_concurrent_streams_equal_generate(async_engine, references):
    async def main():
        return await asyncio.gather(*(collect(async_engine.generate(p, GREEDY)) for p in PROMPTS))

    results = run(main())
    for prompt, outputs in zip(PROMPTS, results):
        assert_matches(outputs, references[prompt])
        assert outputs[-1].metrics.num_generated_tokens == len(references[prompt].token_ids)


def test_leaving_a_stream_early_aborts_its_request(async_engine, references):
    leaver = {}

    async def leave_early():
        agen = async_engine.generate("def fibonacci(n):", LONG, request_id="leaver")
        num_seen = 0
        async for _ in agen:
            num_seen += 1
            if num_seen == 1:  # the Sequence, to inspect after it is gone from the engine
                leaver["seq"] = async_engine.call(lambda e: e._seqs["leaver"]).result(timeout=WAIT_S)
            if num_seen == 3:
                break
        await agen.aclose()
        # The abort reaches the engine thread within a step or two; its blocks go back.
        deadline = time.monotonic() + 10
        while async_engine.call(lambda e: "leaver" in e._seqs).result(timeout=WAIT_S):
            assert time.monotonic() < deadline, "leaving the stream did not abort the request"
            await asyncio.sleep(0.01)
        return num_seen

    async def main():
        others = [collect(async_engine.generate(p, GREEDY)) for p in PROMPTS[:2]]
        return await asyncio.gather(leave_early(), *others)

    num_seen, *others = run(main())
    assert num_seen == 3
    seq = leaver["seq"]
    assert seq.finish_reason is FinishReason.ABORT
    assert 3 <= seq.num_output_tokens < 100
    # The other streams got exactly what they get alone.
    for prompt, outputs in zip(PROMPTS[:2], others):
        assert_matches(outputs, references[prompt])
    # Nothing holds a block any more (queried on the engine thread).
    used = async_engine.call(lambda e: e.block_manager.num_used_blocks).result(timeout=WAIT_S)
    assert used == 0


def test_abort_from_another_thread_stops_the_stream(async_engine, references):
    async def main():
        outputs = []
        aborter = None
        async for out in async_engine.generate("def fibonacci(n):", LONG, request_id="victim"):
            outputs.append(out)
            if len(outputs) == 2:
                aborter = threading.Thread(target=async_engine.abort, args=("victim",))
                aborter.start()
        aborter.join(timeout=WAIT_S)
        return outputs

    outputs = run(main())
    final = outputs[-1]
    assert final.finished and final.finish_reason == "abort"
    assert final.metrics.finish_reason == "abort"
    assert all(not o.finished for o in outputs[:-1])
    assert len(outputs) < 100  # stopped long before max_tokens=1000
    assert final.metrics.num_generated_tokens == len(outputs) - 1  # the abort output adds no token
    assert final.token_ids == [] and final.text == ""


def test_bad_requests_fail_only_their_own_stream(async_engine, references):
    async def expect(error, match, prompt):
        agen = async_engine.generate(prompt, GREEDY)
        with pytest.raises(error, match=match):
            await agen.__anext__()
        return True

    async def main():
        return await asyncio.gather(
            collect(async_engine.generate(PROMPTS[0], GREEDY)),
            expect(ContextOverflowError, "raise --ctx", list(range(100, 100 + 5000))),
            expect(UsageError, "outside the vocabulary", [1, 2, 10**9]),
            expect(UsageError, "empty", ""),
        )

    good, *refused = run(main())
    assert refused == [True, True, True]
    assert_matches(good, references[PROMPTS[0]])
    # The engine serves the next request as before.
    again = run(collect(async_engine.generate(PROMPTS[1], GREEDY)))
    assert_matches(again, references[PROMPTS[1]])


def test_a_call_whose_waiter_gave_up_leaves_the_engine_running(async_engine):
    """The chat app polls the engine's figures with call(); when the app closes, the asyncio
    wrapper is cancelled first. The engine thread must skip that call, not die on it."""
    blocker = threading.Event()
    first = async_engine.call(lambda engine: blocker.wait(WAIT_S))  # holds the engine thread
    second = async_engine.call(lambda engine: engine.stats())
    assert second.cancel()  # what asyncio.wrap_future does when its task is cancelled
    blocker.set()
    assert first.result(timeout=WAIT_S) is True
    assert async_engine.call(lambda engine: engine.stats().num_running).result(timeout=WAIT_S) == 0
    assert async_engine._thread.is_alive()
