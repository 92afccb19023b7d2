"""The paged KV cache's bookkeeping: blocks, chain hashes, refcounts, LRU reuse.

The BlockManager is the only authority on KV capacity. It knows no model: the runner that
holds the physical KV listens (``KVListener``) and mirrors every change synchronously, so
after any call here the runner's storage matches this view exactly.

Block-table layout, for block_size 4 and a 10-token sequence::

    positions   0 1 2 3 | 4 5 6 7 | 8 9 . .
    block_table [  7    ,    2    ,   5    ]     blocks 7 and 2 are full, 5 is partial

A full block is named by a chain hash: hash(parent's hash, its 4 token ids), the first
block's parent being the model fingerprint. Two sequences whose prompts share the first 8
tokens get the same two hashes, so the second finds blocks 7 and 2 in ``_cached`` and shares
them (refcount 2) instead of computing them again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Protocol

from localllm.engine.request import Sequence


class KVListener(Protocol):
    """What the physical KV storage (a runner) must do to stay in step with the BlockManager."""

    def attach(self, seq: Sequence, num_hit_blocks: int) -> int:
        """A new sequence starts; its first ``num_hit_blocks`` blocks are cached prefix blocks
        to share. Returns how many of them could be attached exactly (<= num_hit_blocks)."""

    def release(self, seq: Sequence, kept_block_ids: list[int]) -> list[int]:
        """A sequence gives its blocks back (``seq.block_table`` is still intact);
        ``kept_block_ids`` (hashed, still valid) are to stay cached. Returns the cached blocks
        that the storage can no longer hold, so that they stop being offered as hits."""

    def truncate(self, seq: Sequence, num_tokens: int, dropped_block_ids: list[int]) -> None:
        """Forget ``seq``'s positions from ``num_tokens`` on; ``dropped_block_ids`` leave it."""

    def evict(self, block_id: int) -> None:
        """A cached block's contents are dropped: its memory is about to be reused."""


class PrefixSource(Protocol):
    """Prefixes kept outside the pool (the on-disk prefix store), offered at admission."""

    def find(self, seq: Sequence, hashes: list[bytes], limit: int) -> int:
        """How many of seq's first ``limit`` tokens a stored prefix gives (0: none); ``hashes``
        are the chain hashes of all of seq's full blocks (the last may lie past ``limit``)."""

    def load(self, seq: Sequence, num_tokens: int) -> bool:
        """Put the found prefix's KV for seq's first ``num_tokens`` tokens into its storage
        (its slot is attached, its blocks allocated). False when it cannot: the entry turned
        out bad or the storage refused it; seq's storage is then empty."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, fingerprint: bytes = b"",
                 listener: KVListener | None = None, prefix_source: PrefixSource | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.listener = listener
        self.prefix_source = prefix_source
        self._root_hash = hashlib.blake2b(fingerprint, digest_size=16).digest()
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        # Blocks with refcount 0, least recently used first. Those with a hash still hold a
        # valid prefix and are reused on a hit until their memory is needed.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._seq_hashes: dict[int, list[bytes]] = {}  # seq_id -> chain hashes of its full blocks

    # -- capacity -----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (plain free ones and cached ones with refcount 0)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._block_hash[block_id] is not None

    def free_block_ids(self) -> list[int]:
        """The free list in eviction order (next to be reused first)."""
        return list(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- hashing ------------------------------------------------------------------------

    def _hash_block(self, parent: bytes, token_ids: list[int]) -> bytes:
        return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()

    def prefix_hashes(self, token_ids: list[int], num_blocks: int) -> list[bytes]:
        hashes, parent, bs = [], self._root_hash, self.block_size
        for i in range(num_blocks):
            parent = self._hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return hashes

    # -- allocation ---------------------------------------------------------------------

    def allocate(self, seq: Sequence, max_new_tokens: int) -> int:
        """Make room for up to ``max_new_tokens`` more tokens of ``seq`` after its computed
        ones; returns how many it made room for, or 0 (changing nothing) when the free blocks
        do not suffice.

        A running sequence gets exactly ``max_new_tokens`` (its caller asks for what it
        needs). A new one is first looked up in the prefix cache: hit blocks are shared,
        ``seq.num_computed_tokens`` / ``num_cached_tokens`` move past them, and the rest of its
        tokens, up to ``max_new_tokens``, are allocated. At most (len(seq) - 1) // block_size
        blocks can hit, so the last token is always computed (its logits give the next token).
        """
        if seq.block_table or seq.num_computed_tokens:
            num_new = max_new_tokens
            needed = self.num_blocks_for(seq.num_computed_tokens + num_new) - len(seq.block_table)
            if needed > len(self._free):
                return 0
        else:
            num_new = self._allocate_prefix(seq, max_new_tokens)
            if num_new == 0:
                return 0
            needed = self.num_blocks_for(seq.num_computed_tokens + num_new) - len(seq.block_table)
        for _ in range(needed):
            block_id = next(iter(self._free))
            self._evict(block_id)
            self._take(block_id)
            seq.block_table.append(block_id)
        return num_new

    def _allocate_prefix(self, seq: Sequence, max_new_tokens: int) -> int:
        """Attach a new sequence's cached prefix; returns its number of new tokens, or 0
        (changing nothing) when the blocks for them do not suffice."""
        token_ids = seq.token_ids
        hashes = self.prefix_hashes(token_ids, len(token_ids) // self.block_size)
        hits: list[int] = []
        for h in hashes[:(len(token_ids) - 1) // self.block_size]:  # the last token is computed
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)

        def room_for(num_hits: int, num_free: int, num_cached: int | None = None) -> int:
            if num_cached is None:
                num_cached = num_hits * self.block_size
            num_new = min(len(token_ids) - num_cached, max_new_tokens)
            needed = self.num_blocks_for(num_cached + num_new) - num_hits
            return num_new if needed <= num_free else 0

        if self.prefix_source is not None:
            # A stored prefix at least a block longer than what the pool holds is loaded
            # whole into fresh blocks (the pool's shorter hit is not shared then).
            num_stored = self.prefix_source.find(seq, hashes, len(token_ids) - 1)
            if num_stored >= (len(hits) + 1) * self.block_size:
                num_new = room_for(0, len(self._free), num_stored)
                if num_new:
                    return self._allocate_stored(seq, num_stored, num_new, max_new_tokens)

        # Hit blocks sitting in the free list leave it, so they must not count as free room.
        num_free_hits = sum(1 for b in hits if self._ref_counts[b] == 0)
        if room_for(len(hits), len(self._free) - num_free_hits) == 0:
            return 0
        for block_id in hits:
            self._take(block_id)
        seq.block_table = list(hits)
        if self.listener is not None:
            num_attached = self.listener.attach(seq, len(hits))
            if num_attached < len(hits):  # the storage could not restore them all exactly
                self._release_blocks(seq.block_table[num_attached:])
                del seq.block_table[num_attached:]
        num_hits = len(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_tokens = num_hits * self.block_size
        seq.num_disk_tokens = 0
        self._seq_hashes[seq.seq_id] = self.prefix_hashes(token_ids, num_hits)
        num_new = room_for(num_hits, len(self._free))
        if num_new == 0:  # fewer hits than hoped, and the extra blocks are not there
            self.free(seq)
            seq.num_computed_tokens = seq.num_cached_tokens = 0
        return num_new

    def _allocate_stored(self, seq: Sequence, num_stored: int, num_new: int, max_new_tokens: int) -> int:
        """Admit ``seq`` with its first ``num_stored`` tokens loaded by the prefix source;
        if loading fails it is computed from the start (the blocks taken still fit)."""
        for _ in range(self.num_blocks_for(num_stored + num_new)):
            block_id = next(iter(self._free))
            self._evict(block_id)
            self._take(block_id)
            seq.block_table.append(block_id)
        if self.listener is not None:
            self.listener.attach(seq, 0)
        self._seq_hashes[seq.seq_id] = []
        if not self.prefix_source.load(seq, num_stored):
            seq.num_computed_tokens = seq.num_cached_tokens = seq.num_disk_tokens = 0
            return min(len(seq), max_new_tokens)
        seq.num_computed_tokens = seq.num_cached_tokens = seq.num_disk_tokens = num_stored
        self.cache_full_blocks(seq)  # so that requests admitted next share them from the pool
        return num_new

    def hashes_of(self, seq: Sequence) -> list[bytes]:
        """The chain hashes of seq's computed full blocks (named by cache_full_blocks)."""
        return list(self._seq_hashes.get(seq.seq_id, ()))

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Name the sequence's newly computed full blocks by their chain hashes, so later
        requests find them. Called after the step that computed them."""
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        num_full = seq.num_computed_tokens // self.block_size
        if len(hashes) >= num_full:
            return
        bs = self.block_size
        parent = hashes[-1] if hashes else self._root_hash
        tokens = seq.token_ids if num_full * bs > seq.num_prompt_tokens else seq.prompt_token_ids
        for i in range(len(hashes), num_full):
            parent = self._hash_block(parent, tokens[i * bs:(i + 1) * bs])
            hashes.append(parent)
            block_id = seq.block_table[i]
            # The same content computed twice at once (two identical prompts admitted together):
            # the first block keeps the name, this one stays anonymous and is freed plainly.
            if parent not in self._cached and self._block_hash[block_id] is None:
                self._cached[parent] = block_id
                self._block_hash[block_id] = parent

    def truncate(self, seq: Sequence) -> None:
        """Give back the blocks past ``seq.num_computed_tokens`` (rejected draft tokens), and
        have the listener forget those positions. They were never named by a hash."""
        keep = self.num_blocks_for(seq.num_computed_tokens)
        if self.listener is not None:
            self.listener.truncate(seq, seq.num_computed_tokens, seq.block_table[keep:])
        extra, seq.block_table = seq.block_table[keep:], seq.block_table[:keep]
        self._release_blocks(extra)

    def free(self, seq: Sequence) -> None:
        """Give back all of ``seq``'s blocks. The tail blocks go to the free list first, so a
        prefix is evicted from its end and its head, shared most often, lives longest."""
        kept = [b for b in seq.block_table if self._block_hash[b] is not None]
        dropped = self.listener.release(seq, kept) if self.listener is not None else []
        self._release_blocks(seq.block_table)
        seq.block_table = []
        self._seq_hashes.pop(seq.seq_id, None)
        self.uncache(dropped)

    def uncache(self, block_ids: list[int]) -> None:
        """Forget that these free blocks hold a prefix (their storage no longer has it)."""
        for block_id in block_ids:
            h = self._block_hash[block_id]
            if h is not None and self._ref_counts[block_id] == 0:
                del self._cached[h]
                self._block_hash[block_id] = None

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix held only by free blocks."""
        for block_id in self._free:
            self._evict(block_id)

    # -- internals ----------------------------------------------------------------------

    def _take(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def _release_blocks(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def _evict(self, block_id: int) -> None:
        h = self._block_hash[block_id]
        if h is not None:
            del self._cached[h]
            self._block_hash[block_id] = None
            if self.listener is not None:
                self.listener.evict(block_id)
