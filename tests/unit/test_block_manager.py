"""BlockManager: exact block ids, refcounts, chain-hash hits, LRU eviction, KVListener calls.

No model: a sequence's KV is "computed" by moving ``num_computed_tokens`` forward and calling
``cache_full_blocks``, as ``LLMEngine._update`` does after each step. block_size is 4
throughout, so block i of a sequence holds positions 4i..4i+3.
"""

from __future__ import annotations

from localllm.engine.block_manager import BlockManager
from localllm.engine.request import SamplingParams, Sequence

BS = 4


def make_seq(token_ids: list[int], request_id: str = "") -> Sequence:
    return Sequence(prompt_token_ids=list(token_ids), params=SamplingParams(), request_id=request_id)


def tokens(start: int, n: int) -> list[int]:
    """n distinct token ids from ``start`` on; different starts give prompts that share nothing."""
    return list(range(start, start + n))


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What the engine does after a step that computed ``num_tokens`` of ``seq``."""
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


def prefill(bm: BlockManager, seq: Sequence) -> int:
    """Admit ``seq`` and compute its whole prompt in one step; returns the tokens computed."""
    num_new = bm.allocate(seq, len(seq))
    assert num_new > 0
    compute(bm, seq, num_new)
    return num_new


def ref_counts(bm: BlockManager) -> list[int]:
    return [bm.ref_count(b) for b in range(bm.num_blocks)]


def cached_ids(bm: BlockManager) -> list[int]:
    return [b for b in range(bm.num_blocks) if bm.is_cached(b)]


class FakeListener:
    """Records every KVListener call, with the block table as it stood at the call."""

    def __init__(self, attach_limit: int | None = None, drop: list[int] | None = None):
        self.attach_limit = attach_limit  # attach() restores at most this many hit blocks
        self.drop = list(drop or [])  # what the next release() says it can no longer hold
        self.calls: list[tuple] = []

    def attach(self, seq: Sequence, num_hit_blocks: int) -> int:
        self.calls.append(("attach", seq.request_id, num_hit_blocks, list(seq.block_table)))
        return num_hit_blocks if self.attach_limit is None else min(num_hit_blocks, self.attach_limit)

    def release(self, seq: Sequence, kept_block_ids: list[int]) -> list[int]:
        self.calls.append(("release", seq.request_id, list(seq.block_table), list(kept_block_ids)))
        dropped, self.drop = self.drop, []
        return dropped

    def evict(self, block_id: int) -> None:
        self.calls.append(("evict", block_id))


# -- allocation ---------------------------------------------------------------------------


def test_fresh_allocation_takes_block_ids_in_order_with_a_partial_last_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 10))
    assert bm.allocate(a, 10) == 10
    assert a.block_table == [0, 1, 2]  # 4 + 4 + 2 tokens: block 2 is partial
    assert (a.num_computed_tokens, a.num_cached_tokens) == (0, 0)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (5, 3)
    assert bm.free_block_ids() == [3, 4, 5, 6, 7]
    assert ref_counts(bm) == [1, 1, 1, 0, 0, 0, 0, 0]

    b = make_seq(tokens(200, 5))
    assert bm.allocate(b, 5) == 5
    assert b.block_table == [3, 4]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (3, 5)
    assert bm.free_block_ids() == [5, 6, 7]


def test_num_blocks_for_rounds_up():
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert [bm.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_new_sequence_is_capped_by_max_new_tokens_for_chunked_prefill():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 10))
    assert bm.allocate(a, 3) == 3
    assert a.block_table == [0]
    compute(bm, a, 3)
    assert bm.allocate(a, 3) == 3  # positions 3..5: one more block
    assert a.block_table == [0, 1]
    compute(bm, a, 3)
    assert bm.allocate(a, 2) == 2  # positions 6..7 still fit in block 1
    assert a.block_table == [0, 1]
    compute(bm, a, 2)
    assert bm.allocate(a, 2) == 2  # positions 8..9
    assert a.block_table == [0, 1, 2]
    assert bm.free_block_ids() == [3, 4, 5, 6, 7]


def test_running_sequence_takes_a_block_only_at_a_block_boundary():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 6))
    prefill(bm, a)
    assert a.block_table == [0, 1]
    for _ in range(2):  # positions 6 and 7 fill block 1
        a.output_token_ids.append(900)
        assert bm.allocate(a, 1) == 1
        assert a.block_table == [0, 1]
        compute(bm, a, 1)
    a.output_token_ids.append(901)
    assert bm.allocate(a, 1) == 1  # position 8 opens block 2
    assert a.block_table == [0, 1, 2]
    assert bm.num_used_blocks == 3


# -- naming full blocks and hitting them ----------------------------------------------------


def test_cache_full_blocks_names_only_full_computed_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 10))
    assert bm.allocate(a, 10) == 10
    compute(bm, a, 3)
    assert cached_ids(bm) == []  # block 0 is allocated but only 3/4 computed
    compute(bm, a, 2)
    assert cached_ids(bm) == [0]
    compute(bm, a, 5)
    assert cached_ids(bm) == [0, 1]  # block 2 holds 2 tokens: never named
    assert bm.num_cached_blocks == 2


def test_chain_hash_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=8, block_size=BS)
    h = bm.prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2)
    h_other_head = bm.prefix_hashes([9, 2, 3, 4, 5, 6, 7, 8], 2)
    assert len(h) == 2 and h[0] != h[1]
    assert h_other_head[0] != h[0]
    assert h_other_head[1] != h[1]  # same tokens 4..7, different parent
    assert BlockManager(8, BS, fingerprint=b"other model").prefix_hashes([1, 2, 3, 4], 1) != h[:1]


def test_second_sequence_with_the_same_prefix_shares_its_full_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 10))
    prefill(bm, a)
    assert a.block_table == [0, 1, 2]

    b = make_seq(tokens(100, 8) + [50, 51, 52])  # shares a's first 8 tokens, then differs
    assert bm.allocate(b, 11) == 3  # only positions 8..10 are computed
    assert b.block_table == [0, 1, 3]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (8, 8)
    assert ref_counts(bm) == [2, 2, 1, 1, 0, 0, 0, 0]
    assert bm.free_block_ids() == [4, 5, 6, 7]
    compute(bm, b, 3)
    assert cached_ids(bm) == [0, 1]  # b's block 3 holds 3 tokens


def test_last_prompt_token_is_never_a_hit():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 8))  # exactly two full blocks
    prefill(bm, a)
    assert cached_ids(bm) == [0, 1]

    b = make_seq(tokens(100, 8))
    assert bm.allocate(b, 8) == 4  # block 1 would hit, but its last token must give logits
    assert b.block_table == [0, 2]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (4, 4)
    assert ref_counts(bm)[:3] == [2, 1, 1]
    compute(bm, b, 4)
    assert cached_ids(bm) == [0, 1]  # block 2 holds block 1's content: it stays anonymous

    c = make_seq(tokens(100, 9))  # one token more: both full blocks hit
    assert bm.allocate(c, 9) == 1
    assert c.block_table == [0, 1, 3]
    assert (c.num_computed_tokens, c.num_cached_tokens) == (8, 8)


def test_hit_on_a_block_in_use_does_not_touch_the_free_list():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 9))
    prefill(bm, a)
    b = make_seq(tokens(100, 9))
    assert bm.allocate(b, 9) == 1
    assert b.block_table == [0, 1, 3]
    assert bm.free_block_ids() == [4, 5, 6, 7]
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]


# -- free list and eviction -----------------------------------------------------------------


def test_free_returns_blocks_tail_first_and_cached_ones_stay_hits():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 10))
    prefill(bm, a)
    bm.free(a)
    assert a.block_table == []
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (8, 0)
    assert ref_counts(bm) == [0] * 8
    assert cached_ids(bm) == [0, 1]

    b = make_seq(tokens(100, 8) + [50, 51, 52])
    assert bm.allocate(b, 11) == 3
    assert b.block_table == [0, 1, 3]  # hits leave the free list; the new block is its head
    assert (b.num_computed_tokens, b.num_cached_tokens) == (8, 8)
    assert bm.free_block_ids() == [4, 5, 6, 7, 2]
    assert ref_counts(bm) == [1, 1, 0, 1, 0, 0, 0, 0]


def test_shared_blocks_are_freed_only_when_the_last_holder_frees_them():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 9))
    prefill(bm, a)
    b = make_seq(tokens(100, 9))
    bm.allocate(b, 9)
    compute(bm, b, 1)
    assert b.block_table == [0, 1, 3]
    bm.free(a)
    assert ref_counts(bm)[:4] == [1, 1, 0, 1]
    assert bm.free_block_ids() == [4, 5, 6, 7, 2]
    bm.free(b)
    assert bm.free_block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert cached_ids(bm) == [0, 1]


def test_eviction_is_least_recently_freed_first():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 9))
    b = make_seq(tokens(200, 9))
    prefill(bm, a)
    prefill(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    assert cached_ids(bm) == [0, 1, 3, 4]
    bm.free(a)
    bm.free(b)
    assert bm.free_block_ids() == [6, 7, 2, 1, 0, 5, 4, 3]

    # A hit takes a's blocks out of the free list; freed again they go to its end.
    c = make_seq(tokens(100, 8) + [60])
    assert bm.allocate(c, 9) == 1
    assert c.block_table == [0, 1, 6]
    assert bm.free_block_ids() == [7, 2, 5, 4, 3]
    compute(bm, c, 1)
    bm.free(c)
    assert bm.free_block_ids() == [7, 2, 5, 4, 3, 6, 1, 0]

    # Five new blocks: b's prefix (freed before c) goes first, tail block first.
    d = make_seq(tokens(300, 20))
    assert bm.allocate(d, 20) == 20
    assert d.block_table == [7, 2, 5, 4, 3]
    assert cached_ids(bm) == [0, 1]
    assert bm.free_block_ids() == [6, 1, 0]

    # a's prefix is evicted from its end: block 1 before block 0.
    bm.free(d)
    e = make_seq(tokens(400, 8))
    assert bm.allocate(e, 8) == 8
    assert cached_ids(bm) == [0]
    f = make_seq(tokens(100, 9))
    assert bm.allocate(f, 9) == 5  # only block 0 still hits
    assert f.block_table == [0, 3, 4]
    assert (f.num_computed_tokens, f.num_cached_tokens) == (4, 4)


def test_allocation_failure_returns_zero_and_changes_nothing():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 20))
    prefill(bm, a)
    c = make_seq(tokens(200, 8))
    prefill(bm, c)
    assert a.block_table == [0, 1, 2, 3, 4] and c.block_table == [5, 6]
    free_before, refs_before, cached_before = bm.free_block_ids(), ref_counts(bm), cached_ids(bm)

    b = make_seq(tokens(300, 9))  # needs 3 blocks, 1 is free
    assert bm.allocate(b, 9) == 0
    assert (b.block_table, b.num_computed_tokens, b.num_cached_tokens) == ([], 0, 0)
    assert (bm.free_block_ids(), ref_counts(bm), cached_ids(bm)) == (free_before, refs_before, cached_before)
    assert bm.allocate(b, 4) == 4  # a chunk that fits is fine
    assert b.block_table == [7]
    bm.free(b)

    # A running sequence that needs a block when none is free.
    d = make_seq(tokens(400, 4))
    assert bm.allocate(d, 4) == 4
    compute(bm, d, 4)
    d.output_token_ids.append(900)
    free_before, refs_before, cached_before = bm.free_block_ids(), ref_counts(bm), cached_ids(bm)
    assert free_before == []
    assert bm.allocate(d, 1) == 0
    assert (d.block_table, d.num_computed_tokens) == ([7], 4)
    assert (bm.free_block_ids(), ref_counts(bm), cached_ids(bm)) == (free_before, refs_before, cached_before)


def test_allocation_failure_with_prefix_hits_leaves_refcounts_and_sequence_alone():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 12))
    y = make_seq(tokens(200, 8))
    prefill(bm, a)
    prefill(bm, y)
    bm.free(a)
    bm.free(y)
    refs_before, cached_before = ref_counts(bm), cached_ids(bm)

    b = make_seq(tokens(100, 8) + tokens(300, 28))  # hits 2 blocks, then needs 7 of the 6 left
    assert bm.allocate(b, len(b)) == 0
    assert (b.block_table, b.num_computed_tokens, b.num_cached_tokens) == ([], 0, 0)
    assert (ref_counts(bm), cached_ids(bm)) == (refs_before, cached_before)
    assert bm.num_free_blocks == 8


def test_allocation_failure_with_prefix_hits_keeps_the_free_list_order():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 12))
    y = make_seq(tokens(200, 8))
    prefill(bm, a)
    prefill(bm, y)
    bm.free(a)
    bm.free(y)
    assert bm.free_block_ids() == [5, 6, 7, 2, 1, 0, 4, 3]

    b = make_seq(tokens(100, 8) + tokens(300, 28))
    assert bm.allocate(b, len(b)) == 0
    assert bm.free_block_ids() == [5, 6, 7, 2, 1, 0, 4, 3]  # is [5, 6, 7, 2, 4, 3, 1, 0]


def test_identical_prompts_computed_together_register_the_hash_once():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 9))
    b = make_seq(tokens(100, 9))
    assert bm.allocate(a, 9) == 9 and bm.allocate(b, 9) == 9  # nothing cached yet: no hits
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    compute(bm, a, 9)
    compute(bm, b, 9)
    assert cached_ids(bm) == [0, 1]  # b's blocks 3 and 4 hold the same content, anonymously
    assert bm.num_cached_blocks == 2

    bm.free(b)
    assert bm.free_block_ids() == [6, 7, 5, 4, 3]
    assert cached_ids(bm) == [0, 1]
    c = make_seq(tokens(100, 9))
    assert bm.allocate(c, 9) == 1
    assert c.block_table == [0, 1, 6]
    assert ref_counts(bm)[:3] == [2, 2, 1]


def test_chain_continues_past_an_anonymous_duplicate_block():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = make_seq(tokens(100, 9))
    b = make_seq(tokens(100, 9))
    bm.allocate(a, 9)
    bm.allocate(b, 9)
    compute(bm, a, 9)
    compute(bm, b, 9)
    for t in (900, 901, 902):  # b decodes to 12 computed tokens: its block 5 becomes full
        b.output_token_ids.append(t)
        assert bm.allocate(b, 1) == 1
        compute(bm, b, 1)
    b.output_token_ids.append(903)
    assert b.block_table == [3, 4, 5]
    assert cached_ids(bm) == [0, 1, 5]

    c = make_seq(b.token_ids[:12] + [70])
    assert bm.allocate(c, 13) == 1
    assert c.block_table == [0, 1, 5, 6]  # a's two blocks, then b's third
    assert (c.num_computed_tokens, c.num_cached_tokens) == (12, 12)


def test_reset_prefix_cache_drops_only_free_cached_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(tokens(100, 12))
    prefill(bm, a)
    b = make_seq(tokens(100, 8) + [50])
    assert bm.allocate(b, 9) == 1
    assert b.block_table == [0, 1, 3]
    bm.free(a)
    assert bm.free_block_ids() == [4, 5, 6, 7, 2]
    assert cached_ids(bm) == [0, 1, 2]

    bm.reset_prefix_cache()
    assert cached_ids(bm) == [0, 1]  # held by b
    assert bm.num_cached_blocks == 2
    assert bm.free_block_ids() == [4, 5, 6, 7, 2]  # order untouched
    c = make_seq(tokens(100, 13))
    assert bm.allocate(c, 13) == 5  # blocks 0 and 1 still hit, block 2 no longer
    assert c.block_table == [0, 1, 4, 5]


# -- the KVListener -------------------------------------------------------------------------


def test_listener_attach_is_called_once_on_the_first_allocation():
    listener = FakeListener()
    bm = BlockManager(num_blocks=8, block_size=BS, listener=listener)
    a = make_seq(tokens(100, 10), "a")
    assert bm.allocate(a, 6) == 6
    assert listener.calls == [("attach", "a", 0, [])]
    compute(bm, a, 6)
    assert bm.allocate(a, 4) == 4
    compute(bm, a, 4)
    assert listener.calls == [("attach", "a", 0, [])]  # a running sequence is not attached again

    b = make_seq(tokens(100, 8) + [50], "b")
    assert bm.allocate(b, 9) == 1
    assert listener.calls[1:] == [("attach", "b", 2, [0, 1])]  # table holds just the hits then
    assert b.block_table == [0, 1, 3]


def test_listener_release_sees_the_intact_table_and_exactly_the_hashed_blocks():
    listener = FakeListener()
    bm = BlockManager(num_blocks=8, block_size=BS, listener=listener)
    a = make_seq(tokens(100, 10), "a")
    prefill(bm, a)
    listener.calls.clear()
    bm.free(a)
    assert listener.calls == [("release", "a", [0, 1, 2], [0, 1])]

    # A duplicate's anonymous blocks are not kept; shared hit blocks are.
    b = make_seq(tokens(200, 9), "b")
    c = make_seq(tokens(200, 9), "c")
    bm.allocate(b, 9)
    bm.allocate(c, 9)
    compute(bm, b, 9)
    compute(bm, c, 9)
    d = make_seq(tokens(200, 9), "d")
    bm.allocate(d, 9)
    assert (b.block_table, c.block_table, d.block_table) == ([3, 4, 5], [6, 7, 2], [3, 4, 1])
    listener.calls.clear()
    bm.free(c)
    bm.free(d)
    assert listener.calls == [("release", "c", [6, 7, 2], []), ("release", "d", [3, 4, 1], [3, 4])]


def test_listener_hears_evict_when_a_cached_block_is_reused():
    listener = FakeListener()
    bm = BlockManager(num_blocks=8, block_size=BS, listener=listener)
    a = make_seq(tokens(100, 10), "a")
    prefill(bm, a)
    bm.free(a)
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    listener.calls.clear()

    d = make_seq(tokens(300, 28), "d")  # 7 blocks: 3..7, then 2 (anonymous), then 1 (cached)
    assert bm.allocate(d, 28) == 28
    assert d.block_table == [3, 4, 5, 6, 7, 2, 1]
    assert listener.calls == [("attach", "d", 0, []), ("evict", 1)]
    assert cached_ids(bm) == [0]


def test_listener_attaching_fewer_blocks_makes_the_rest_go_back():
    listener = FakeListener(attach_limit=1)
    bm = BlockManager(num_blocks=8, block_size=BS, listener=listener)
    a = make_seq(tokens(100, 12), "a")
    prefill(bm, a)
    bm.free(a)
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    listener.calls.clear()

    b = make_seq(tokens(100, 12) + [50], "b")  # 3 blocks could hit
    assert bm.allocate(b, 13) == 9
    assert listener.calls == [("attach", "b", 3, [0, 1, 2])]
    assert b.block_table == [0, 3, 4, 5]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (4, 4)
    assert ref_counts(bm) == [1, 0, 0, 1, 1, 1, 0, 0]
    assert bm.free_block_ids() == [6, 7, 2, 1]  # given back tail first, still cached
    assert cached_ids(bm) == [0, 1, 2]

    compute(bm, b, 9)
    assert cached_ids(bm) == [0, 1, 2]  # b's blocks 3 and 4 repeat 1 and 2: anonymous
    listener.calls.clear()
    bm.free(b)
    assert listener.calls == [("release", "b", [0, 3, 4, 5], [0])]


def test_listener_attaching_fewer_blocks_with_a_chunk_budget():
    listener = FakeListener(attach_limit=0)
    bm = BlockManager(num_blocks=8, block_size=BS, listener=listener)
    a = make_seq(tokens(100, 9), "a")
    prefill(bm, a)
    bm.free(a)
    b = make_seq(tokens(100, 9), "b")
    assert bm.allocate(b, 4) == 4  # nothing attached: the chunk starts at position 0
    assert b.block_table == [3]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (0, 0)
    assert ref_counts(bm) == [0, 0, 0, 1, 0, 0, 0, 0]


def test_blocks_the_listener_drops_on_release_are_uncached():
    listener = FakeListener(drop=[0, 1])
    bm = BlockManager(num_blocks=8, block_size=BS, listener=listener)
    a = make_seq(tokens(100, 13), "a")
    prefill(bm, a)
    assert cached_ids(bm) == [0, 1, 2]
    bm.free(a)
    assert cached_ids(bm) == [2]
    assert bm.num_cached_blocks == 1
    assert bm.free_block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]

    b = make_seq(tokens(100, 13), "b")
    assert bm.allocate(b, 13) == 13  # block 0 no longer hits, so neither does the chain after it
    assert (b.num_computed_tokens, b.num_cached_tokens) == (0, 0)
    assert listener.calls[-1] == ("attach", "b", 0, [])


def test_blocks_the_listener_drops_stay_cached_while_another_sequence_holds_them():
    listener = FakeListener()
    bm = BlockManager(num_blocks=8, block_size=BS, listener=listener)
    a = make_seq(tokens(100, 9), "a")
    prefill(bm, a)
    b = make_seq(tokens(100, 9), "b")
    bm.allocate(b, 9)
    listener.drop = [0, 1]
    bm.free(a)
    assert cached_ids(bm) == [0, 1]  # b still uses them
    assert ref_counts(bm)[:2] == [1, 1]


def test_reset_prefix_cache_tells_the_listener_about_each_dropped_block():
    listener = FakeListener()
    bm = BlockManager(num_blocks=8, block_size=BS, listener=listener)
    a = make_seq(tokens(100, 9), "a")
    prefill(bm, a)
    bm.free(a)
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    listener.calls.clear()
    bm.reset_prefix_cache()
    # Else the storage would keep owners for memory that is later reused for other content.
    assert listener.calls == [("evict", 1), ("evict", 0)]  # in free-list order
    assert cached_ids(bm) == []
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    d = make_seq(tokens(300, 32), "d")
    assert bm.allocate(d, 32) == 32  # every block reused: nothing left to evict
    assert listener.calls[2:] == [("attach", "d", 0, [])]


def test_failed_first_allocation_makes_no_listener_calls():
    listener = FakeListener()
    bm = BlockManager(num_blocks=8, block_size=BS, listener=listener)
    a = make_seq(tokens(100, 28), "a")
    prefill(bm, a)
    listener.calls.clear()
    b = make_seq(tokens(200, 9), "b")
    assert bm.allocate(b, 9) == 0
    assert listener.calls == []
