"""Scheduler: token budget, decode-first chunked prefill, max_num_seqs, FCFS, preemption.

No model: ``step`` below does what ``LLMEngine._update`` does with a SchedulerOutput (advance
``num_computed_tokens``, name full blocks, append a token where the step gave logits), with a
fake token in place of a sampled one. block_size is 4 and max_model_len is num_blocks * 4.
"""

from __future__ import annotations

import pytest

from localllm.config import SchedulerConfig
from localllm.engine.block_manager import BlockManager
from localllm.engine.request import SamplingParams, Sequence, SequenceStatus
from localllm.engine.scheduler import Scheduler, SchedulerOutput
from localllm.errors import ContextOverflowError

BS = 4


def make_scheduler(num_blocks: int = 8, max_num_seqs: int = 4,
                   max_num_batched_tokens: int = 32) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, BlockManager(num_blocks, BS), max_model_len=num_blocks * BS)


def make_seq(request_id: str, start: int, n: int, max_tokens: int = 256) -> Sequence:
    return Sequence(prompt_token_ids=list(range(start, start + n)),
                    params=SamplingParams(max_tokens=max_tokens), request_id=request_id)


def fake_token(seq: Sequence) -> int:
    return 9000 + len(seq)


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    for s in out.scheduled:
        needs_logits = s.needs_logits  # read before num_computed_tokens moves
        s.seq.num_computed_tokens += s.num_new_tokens
        sched.block_manager.cache_full_blocks(s.seq)
        if needs_logits:
            s.seq.output_token_ids.append(fake_token(s.seq))
    return out


def summary(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def test_one_prompt_prefills_in_one_step_then_decodes():
    sched = make_scheduler()
    a = make_seq("a", 100, 10)
    sched.add(a)
    assert a.status is SequenceStatus.WAITING
    out = sched.schedule()
    assert summary(out) == [("a", 10)]
    assert out.scheduled[0].needs_logits
    assert (out.num_batched_tokens, out.preempted, out.is_empty) == (10, [], False)
    assert a.status is SequenceStatus.RUNNING and a.block_table == [0, 1, 2]
    a.num_computed_tokens += 10
    a.output_token_ids.append(fake_token(a))

    out = step(sched)
    assert summary(out) == [("a", 1)]
    assert (a.num_computed_tokens, len(a), a.block_table) == (11, 12, [0, 1, 2])


def test_nothing_to_schedule_gives_an_empty_output():
    sched = make_scheduler()
    out = sched.schedule()
    assert (out.scheduled, out.preempted, out.is_empty, out.num_batched_tokens) == ([], [], True, 0)
    assert not sched.has_unfinished


def test_long_prompt_is_chunked_while_running_decodes_get_their_token():
    sched = make_scheduler(num_blocks=10, max_num_batched_tokens=8)
    a, b = make_seq("a", 100, 3), make_seq("b", 200, 20)
    sched.add(a)
    sched.add(b)

    out = step(sched)
    assert summary(out) == [("a", 3), ("b", 5)]  # b gets what a leaves of the budget
    assert (a.num_output_tokens, b.num_output_tokens, b.num_computed_tokens) == (1, 0, 5)

    trace = []
    for _ in range(4):
        out = step(sched)
        trace.append((summary(out), b.num_computed_tokens, b.num_output_tokens))
    assert trace == [
        ([("a", 1), ("b", 7)], 12, 0),
        ([("a", 1), ("b", 7)], 19, 0),
        ([("a", 1), ("b", 1)], 20, 1),  # the last prompt token gives b its first token
        ([("a", 1), ("b", 1)], 21, 2),
    ]
    assert (a.num_output_tokens, a.num_computed_tokens) == (5, 7)
    assert (a.block_table, b.block_table) == ([0, 4], [1, 2, 3, 5, 6, 7])


def test_decodes_go_first_whatever_the_running_order():
    sched = make_scheduler(num_blocks=10, max_num_batched_tokens=8)
    a, b = make_seq("a", 100, 3), make_seq("b", 200, 20)
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.running.reverse()  # b (prefilling) ahead of a (decoding)
    out = step(sched)
    assert summary(out) == [("a", 1), ("b", 7)]


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    a, b, c = make_seq("a", 100, 3), make_seq("b", 200, 3), make_seq("c", 300, 3)
    for s in (a, b, c):
        sched.add(s)
    assert summary(step(sched)) == [("a", 3), ("b", 3)]
    assert (ids(sched.running), ids(sched.waiting)) == (["a", "b"], ["c"])
    assert summary(step(sched)) == [("a", 1), ("b", 1)]  # budget is left, but no seat

    sched.finish(a)
    assert (a.status, a.block_table) == (SequenceStatus.FINISHED, [])
    assert summary(step(sched)) == [("b", 1), ("c", 3)]
    assert (ids(sched.running), ids(sched.waiting)) == (["b", "c"], [])


def test_waiting_request_that_does_not_fit_blocks_those_behind_it():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=40)
    a, b, c = make_seq("a", 100, 20), make_seq("b", 200, 16), make_seq("c", 300, 3)
    for s in (a, b, c):
        sched.add(s)
    out = step(sched)
    assert summary(out) == [("a", 20)]  # b needs 4 blocks, 3 are free; c would fit but waits
    assert ids(sched.waiting) == ["b", "c"]
    assert a.block_table == [0, 1, 2, 3, 4]

    assert summary(step(sched)) == [("a", 1)]  # a's token 21 opens block 5; b still waits
    assert (a.block_table, sched.block_manager.num_free_blocks) == ([0, 1, 2, 3, 4, 5], 2)
    assert ids(sched.waiting) == ["b", "c"]

    sched.finish(a)
    out = step(sched)
    assert summary(out) == [("b", 16), ("c", 3)]
    assert (b.block_table, c.block_table) == ([6, 7, 5, 4], [3])  # a's blocks, tail first


def test_newest_running_sequence_is_preempted_and_readmitted_with_its_cached_blocks():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=32)
    bm = sched.block_manager
    a, b = make_seq("a", 100, 14), make_seq("b", 200, 14)
    sched.add(a)
    sched.add(b)
    assert summary(step(sched)) == [("a", 14), ("b", 14)]
    assert (a.block_table, b.block_table) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert summary(step(sched)) == [("a", 1), ("b", 1)]
    assert summary(step(sched)) == [("a", 1), ("b", 1)]
    assert (a.num_computed_tokens, len(a), bm.num_free_blocks) == (16, 17, 0)

    # a's next token opens a block; none is free, so b (newer) gives its blocks back.
    out = step(sched)
    assert summary(out) == [("a", 1)]
    assert out.preempted == [b]
    assert (b.status, b.num_computed_tokens, b.num_preemptions, b.block_table) == (
        SequenceStatus.PREEMPTED, 0, 1, [])
    assert sched.num_preemptions == 1
    assert (ids(sched.running), ids(sched.waiting)) == (["a"], ["b"])
    assert a.block_table == [0, 1, 2, 3, 7]  # b's tail block, freed first, reused first
    assert [bm.is_cached(x) for x in (4, 5, 6)] == [True, True, True]
    assert bm.free_block_ids() == [6, 5, 4]

    out = step(sched)
    assert (summary(out), out.preempted) == ([("a", 1)], [])  # b needs 2 more blocks than its 3 hits
    assert ids(sched.waiting) == ["b"]

    sched.finish(a)
    out = step(sched)
    assert summary(out) == [("b", 5)]  # 17 tokens, 12 of them hits: recompute 12..16
    assert out.scheduled[0].seq is b and b.status is SequenceStatus.RUNNING
    assert (b.num_cached_tokens, b.num_computed_tokens, b.num_output_tokens) == (12, 17, 4)
    assert b.block_table == [4, 5, 6, 7, 3]
    assert (b.num_preemptions, sched.num_preemptions) == (1, 1)


def test_newest_sequence_that_needs_a_block_preempts_itself():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=32)
    a, b = make_seq("a", 100, 14), make_seq("b", 200, 16)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.block_manager.num_free_blocks == 0
    out = step(sched)  # a's position 14 fits its block 3; b's position 16 needs a fifth block
    assert summary(out) == [("a", 1)]
    assert out.preempted == [b]
    assert (ids(sched.running), ids(sched.waiting)) == (["a"], ["b"])
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert sched.block_manager.free_block_ids() == [7, 6, 5, 4]  # all four full, all cached


def test_preempted_sequence_goes_back_ahead_of_later_arrivals():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=32)
    a, b, c = make_seq("a", 100, 14), make_seq("b", 200, 14), make_seq("c", 300, 2)
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        step(sched)
    sched.add(c)
    out = step(sched)
    assert out.preempted == [b]
    assert ids(sched.waiting) == ["b", "c"]  # c fits in no block either


def test_prompt_that_fills_the_context_is_refused():
    sched = make_scheduler(num_blocks=8)  # context 32
    with pytest.raises(ContextOverflowError, match=r"the prompt has 32 tokens and the context holds 32"):
        sched.add(make_seq("a", 100, 32))
    assert not sched.has_unfinished
    sched.add(make_seq("b", 100, 31))
    assert ids(sched.waiting) == ["b"]


def test_finishing_a_preempted_sequence_removes_it_from_the_waiting_queue():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=32)
    a, b = make_seq("a", 100, 14), make_seq("b", 200, 16)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    assert ids(sched.waiting) == ["b"]
    sched.finish(b)
    assert (ids(sched.waiting), b.status) == ([], SequenceStatus.FINISHED)
    assert sched.block_manager.num_used_blocks == 4


def test_every_block_comes_back_when_everything_finishes():
    sched = make_scheduler(num_blocks=8, max_num_seqs=3, max_num_batched_tokens=8)
    bm = sched.block_manager
    seqs = [make_seq(f"r{i}", 100 * (i + 1), 10, max_tokens=6) for i in range(4)]
    seqs.append(make_seq("shared", 100, 10, max_tokens=6))  # r0's prompt again
    for s in seqs:
        sched.add(s)
    num_steps = 0
    while sched.has_unfinished:
        out = step(sched)
        num_steps += 1
        assert num_steps < 200
        assert out.num_batched_tokens <= 8 and len(sched.running) <= 3
        assert bm.num_used_blocks == len({b for s in sched.running for b in s.block_table})
        for s in [s.seq for s in out.scheduled]:
            if s.num_output_tokens >= s.params.max_tokens or len(s) >= sched.max_model_len:
                sched.finish(s)
    assert [s.num_output_tokens for s in seqs] == [6] * 5
    assert all(s.status is SequenceStatus.FINISHED and s.block_table == [] for s in seqs)
    assert (bm.num_used_blocks, bm.num_free_blocks) == (0, 8)
    assert sched.num_preemptions > 0  # 8 blocks for 3 seats of up to 4 blocks each: the path ran
    assert sched.num_preemptions == sum(s.num_preemptions for s in seqs)
    assert [bm.ref_count(b) for b in range(8)] == [0] * 8


# --- drafts --------------------------------------------------------------------------


def test_drafts_take_what_the_budget_leaves_after_decodes_and_prefill_within_room():
    calls = []

    def proposer(candidates, num_tokens, num_outputs, budget):
        calls.append(([(s.request_id, room) for s, room in candidates], num_tokens, num_outputs, budget))
        return {s.seq_id: [7] * min(room, budget) for s, room in candidates}

    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=16)
    sched.proposer = proposer
    a, b = make_seq("a", 100, 4, max_tokens=4), make_seq("b", 200, 4)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefill: nothing decodes, no drafts
    assert calls == [([], 8, 2, 8)]
    c = make_seq("c", 300, 6)
    sched.add(c)
    out = sched.schedule()
    # a and b decode (1 each), c prefills 6: 8 tokens, 3 outputs, 8 left; a may draft
    # max_tokens - 1 output - 1 = 2, b may draft 64 - 5 - 1 = 58
    assert calls[-1] == ([("a", 2), ("b", 58)], 8, 3, 8)
    assert summary(out) == [("a", 3), ("b", 9), ("c", 6)]
    assert [(s.num_draft_tokens, s.num_logits) for s in out.scheduled] == [(2, 3), (8, 9), (0, 1)]
    assert a.draft_token_ids == [7, 7] and len(b.block_table) == 4  # 5 known + 8 drafts: 13 slots


def test_a_draft_that_needs_blocks_the_pool_lacks_is_dropped_and_preempts_no_one():
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=32)
    sched.proposer = lambda candidates, *_: {s.seq_id: [7] * 8 for s, _ in candidates}
    a = make_seq("a", 100, 6)
    sched.add(a)
    step(sched)
    out = sched.schedule()  # 7 tokens known; 1 + 8 more would need 4 blocks of the 3
    assert summary(out) == [("a", 1)] and not out.preempted and a.draft_token_ids == []
