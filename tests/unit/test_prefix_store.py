"""The on-disk prefix store with no model: entry format, chain hashing, the SQLite index,
lookup with tails, subsumption, LRU eviction under a budget, failed writes, and the
BlockManager's admission of a stored prefix.

Payloads are plain bytes here (what the runner would export); the store never looks inside.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import time
from array import array
from pathlib import Path

import pytest

from localllm.engine.block_manager import BlockManager
from localllm.engine.prefix_store import (
    HEADER_SIZE, MAGIC, BadEntry, Found, PrefixIndex, PrefixStore, decode_entry, encode_header,
    entry_key, model_digest, parse_size,
)
from localllm.engine.request import SamplingParams, Sequence

BS = 4
FP = b"model-a|runner|f16"


def hashes_for(token_ids: list[int], fingerprint: bytes = FP) -> list[bytes]:
    return BlockManager(1, BS, fingerprint).prefix_hashes(token_ids, len(token_ids) // BS)


def payload_for(token_ids: list[int], size: int = 0) -> bytes:
    """Bytes that stand for the KV of these tokens (distinct per prompt)."""
    body = array("i", token_ids).tobytes()
    return (body * (size // max(1, len(body)) + 1))[:size] if size else body


@pytest.fixture
def store(tmp_path):
    s = PrefixStore(tmp_path / "prefix", FP, BS, budget_bytes=10**9, min_tokens=8, model_name="a.gguf")
    yield s
    s.close()


def save(store: PrefixStore, token_ids: list[int], size: int = 0) -> None:
    assert store.save(token_ids, hashes_for(token_ids), payload_for(token_ids, size))
    assert store.flush(10)


# -- the entry format ----------------------------------------------------------------------

def entry_bytes(token_ids, payload, model=model_digest(FP)) -> bytearray:
    return bytearray(encode_header(model, token_ids, payload) + payload)


def test_entry_round_trip_gives_tokens_and_payload_back():
    data = entry_bytes([1, 2, 70000, 5], b"kv-bytes")
    assert data[:8] == MAGIC and len(data) == HEADER_SIZE + 16 + 8
    tokens, payload = decode_entry(data, model_digest(FP))
    assert tokens == [1, 2, 70000, 5] and bytes(payload) == b"kv-bytes"


@pytest.mark.parametrize("damage, message", [
    (lambda d: d.__setitem__(slice(0, 8), b"NOTMAGIC"), "bad magic"),
    (lambda d: d.__setitem__(slice(8, 10), (2).to_bytes(2, "little")), "format version 2"),
    (lambda d: d.__setitem__(-1, d[-1] ^ 0x01), "checksum mismatch"),  # the payload
    (lambda d: d.__setitem__(HEADER_SIZE, d[HEADER_SIZE] ^ 0x80), "checksum mismatch"),  # a token id
    (lambda d: d.__setitem__(10, 1), "checksum mismatch"),  # the flags field
    (lambda d: d.__delitem__(slice(-3, None)), "truncated or padded"),
    (lambda d: d.extend(b"\0"), "truncated or padded"),
    (lambda d: d.__delitem__(slice(20, None)), "shorter than the header"),
    (lambda d: d.__setitem__(slice(28, 32), (3).to_bytes(4, "little")), "truncated or padded"),  # num_tokens
])
def test_damaged_entries_are_refused_with_the_reason(damage, message):
    data = entry_bytes([1, 2, 3, 4, 5], b"some kv bytes")
    damage(data)
    with pytest.raises(BadEntry, match=message):
        decode_entry(data, model_digest(FP))


def test_an_entry_of_another_model_is_refused():
    data = entry_bytes([1, 2, 3], b"kv", model=model_digest(b"model-b|runner|f16"))
    with pytest.raises(BadEntry, match="another model"):
        decode_entry(data, model_digest(FP))


def test_every_truncation_of_an_entry_is_refused():
    data = bytes(entry_bytes(list(range(10)), b"0123456789" * 3))
    for n in range(len(data)):
        with pytest.raises(BadEntry):
            decode_entry(data[:n], model_digest(FP))


# -- chain hashing -------------------------------------------------------------------------

def test_chain_hashes_are_blake2b_of_parent_and_tokens_rooted_at_the_fingerprint():
    token_ids = [5, 6, 7, 8, 9, 10, 11, 12]
    parent = hashlib.blake2b(FP, digest_size=16).digest()
    expected = []
    for i in range(2):
        parent = hashlib.blake2b(parent + array("q", token_ids[4 * i:4 * i + 4]).tobytes(), digest_size=16).digest()
        expected.append(parent)
    assert hashes_for(token_ids) == expected
    assert hashes_for(token_ids) == BlockManager(7, BS, FP).prefix_hashes(token_ids, 2)  # any instance


def test_a_changed_token_changes_its_block_and_every_later_one_only():
    a = list(range(100, 116))
    b = a[:6] + [999] + a[7:]  # block 1 differs
    ha, hb = hashes_for(a), hashes_for(b)
    assert ha[0] == hb[0] and all(x != y for x, y in zip(ha[1:], hb[1:]))


def test_another_fingerprint_gives_other_hashes_for_every_block():
    a = list(range(16))
    assert not set(hashes_for(a)) & set(hashes_for(a, b"model-b|runner|f16"))


# -- lookup --------------------------------------------------------------------------------

def test_find_gives_the_longest_stored_prefix_within_the_limit(store):
    stored = list(range(100, 110))  # 2 full blocks + a tail of 2
    save(store, stored)
    # The same prompt sent again: everything but its last token (which must be computed).
    assert store.find(stored, hashes_for(stored), len(stored) - 1) == Found(entry_key(store.model, stored), 9)
    # A longer prompt that starts with it: all 10 stored tokens.
    longer = stored + [1, 2, 3]
    assert store.find(longer, hashes_for(longer), len(longer) - 1).num_tokens == 10
    # The tail matches for one token only.
    other_tail = stored[:9] + [7, 7, 7, 7]
    assert store.find(other_tail, hashes_for(other_tail), 12).num_tokens == 9
    # Only the first block is shared.
    diverging = stored[:5] + [0] * 8
    assert store.find(diverging, hashes_for(diverging), 12).num_tokens == 4
    # Nothing shared, or a prompt shorter than a block.
    assert store.find([1] * 12, hashes_for([1] * 12), 11) is None
    assert store.find(stored[:3], hashes_for(stored[:3]), 2) is None


def test_a_prompt_that_is_a_prefix_of_an_entry_gets_its_full_blocks(store):
    stored = list(range(200, 220))  # 5 blocks
    save(store, stored)
    prompt = stored[:11]
    assert store.find(prompt, hashes_for(prompt), 10).num_tokens == 8


def test_read_checks_the_file_and_gives_the_payload(store):
    stored = list(range(300, 313))
    save(store, stored, size=5000)
    found = store.find(stored, hashes_for(stored), 12)
    assert bytes(store.read(found, stored)) == payload_for(stored, 5000)
    assert store.num_hits == 1


@pytest.mark.parametrize("damage", ["garble", "truncate", "foreign", "delete"])
def test_a_bad_entry_is_dropped_with_one_warning_line(store, caplog, damage):
    stored = list(range(400, 420))
    save(store, stored, size=4000)
    path = store.index.file(entry_key(store.model, stored))
    data = bytearray(path.read_bytes())
    if damage == "garble":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)
    elif damage == "truncate":
        path.write_bytes(data[:len(data) // 3])
    elif damage == "foreign":
        payload = bytes(data[HEADER_SIZE + 4 * len(stored):])
        path.write_bytes(entry_bytes(stored, payload, model=model_digest(b"another model")))
    else:
        path.unlink()
    found = store.find(stored, hashes_for(stored), 19)
    with caplog.at_level(logging.WARNING, logger="localllm"):
        assert store.read(found, stored) is None
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    if damage == "delete":  # gone (cleared by another process): not damage, no warning
        assert warnings == []
    else:
        assert len(warnings) == 1 and path.name in warnings[0].getMessage()
    assert store.find(stored, hashes_for(stored), 19) is None and not path.exists()
    # The store keeps working: the prompt is stored again and found.
    save(store, stored, size=4000)
    assert bytes(store.read(store.find(stored, hashes_for(stored), 19), stored)) == payload_for(stored, 4000)


# -- what gets written ---------------------------------------------------------------------

def test_wants_prompts_with_min_tokens_not_yet_stored(store):
    base = list(range(500, 520))  # 20 tokens; min_tokens is 8
    assert not store.wants(base[:7], hashes_for(base[:7]))
    assert store.wants(base, hashes_for(base))
    save(store, base)
    assert not store.wants(base, hashes_for(base))  # stored already
    sibling = base[:16] + [1, 2, 3, 4]  # shares 16: only 4 new tokens
    assert not store.wants(sibling, hashes_for(sibling))
    longer = base + list(range(8))  # 8 new tokens
    assert store.wants(longer, hashes_for(longer))


def test_a_longer_entry_replaces_the_entries_it_contains(store):
    first = list(range(600, 610))
    save(store, first)
    sibling = first[:8] + [9, 9]  # same blocks, another tail: not contained
    save(store, sibling)
    save(store, first + list(range(20)))
    keys = {e.key for e in store.index.entries()}
    assert keys == {entry_key(store.model, sibling), entry_key(store.model, first + list(range(20)))}


def test_saving_the_same_prompt_twice_keeps_one_entry(store):
    t = list(range(700, 720))
    for _ in range(3):  # queued twice, or written and then replaced: one entry either way
        store.save(t, hashes_for(t), payload_for(t))
    store.flush(10)
    assert [e.num_tokens for e in store.index.entries()] == [20]
    assert [p.name for p in store.index.entries_dir.iterdir()] == [entry_key(store.model, t) + ".kv"]


def test_an_entry_bigger_than_the_budget_is_not_queued(tmp_path):
    s = PrefixStore(tmp_path, FP, BS, budget_bytes=1000, min_tokens=8)
    t = list(range(20))
    assert not s.save(t, hashes_for(t), b"x" * 2000)
    s.close()
    assert s.index.entries() == []


# -- the budget ----------------------------------------------------------------------------

def test_the_budget_holds_over_500_distinct_long_prompts(tmp_path):
    budget = 2_000_000
    s = PrefixStore(tmp_path, FP, BS, budget_bytes=budget, min_tokens=8)
    entries_dir = tmp_path / "entries"
    sizes_seen = []
    for i in range(500):
        t = [i] * 3 + list(range(10_000 + 64 * i, 10_000 + 64 * i + 61))  # 64 tokens, distinct
        assert s.save(t, hashes_for(t), payload_for(t, 20_000 + 97 * (i % 50)))
        if i % 25 == 24:
            s.flush(30)
            on_disk = sum(p.stat().st_size for p in entries_dir.iterdir())
            sizes_seen.append(on_disk)
            assert on_disk <= budget and s.index.total_size() <= budget
    s.flush(30)
    assert s.num_writes == 500 and s.num_write_errors == 0
    entries = s.index.entries()
    assert 60 <= len(entries) <= 100  # ~20-25 kB each in 2 MB
    assert min(sizes_seen[4:]) > budget * 0.9  # full once 100 are written, and never over
    assert {p.name for p in entries_dir.iterdir()} == {e.key + ".kv" for e in entries}
    s.close()


def test_eviction_takes_the_least_recently_used_first(tmp_path):
    s = PrefixStore(tmp_path, FP, BS, budget_bytes=3 * (HEADER_SIZE + 4 * 12 + 1000), min_tokens=8)
    prompts = [[k] * 12 for k in (1, 2, 3)]
    for t in prompts:
        save(s, t, size=1000)
        time.sleep(0.01)
    s.read(s.find(prompts[0], hashes_for(prompts[0]), 11), prompts[0])  # 1 is used: now the newest
    s.flush(10)
    time.sleep(0.01)
    save(s, [4] * 12, size=1000)
    assert sorted(e.key for e in s.index.entries()) == sorted(
        entry_key(s.model, t) for t in (prompts[0], prompts[2], [4] * 12))
    s.close()


# -- failed writes and leftovers of a crash ------------------------------------------------

def test_leftover_temporary_and_unindexed_files_are_swept(tmp_path):
    index = PrefixIndex(tmp_path)
    index.entries_dir.mkdir(parents=True)
    old = time.time() - 3600
    for name in (".tmp-123-4-abc", "deadbeef.kv", "young.kv"):
        (index.entries_dir / name).write_bytes(b"x")
    for name in (".tmp-123-4-abc", "deadbeef.kv"):
        os.utime(index.entries_dir / name, (old, old))
    assert index.sweep() == 2
    assert [p.name for p in index.entries_dir.iterdir()] == ["young.kv"]  # maybe another process's


def test_an_index_left_over_its_budget_is_evicted_when_the_store_opens(tmp_path):
    # A kill between indexing a write and evicting for it leaves the index over the budget;
    # the next store on that folder (or one given a smaller budget) evicts it at once.
    one = HEADER_SIZE + 4 * 12 + 1000
    s = PrefixStore(tmp_path, FP, BS, budget_bytes=10**9, min_tokens=8)
    prompts = [[k] * 12 for k in (1, 2, 3)]
    for t in prompts:
        save(s, t, size=1000)
        time.sleep(0.01)
    s.close()
    s = PrefixStore(tmp_path, FP, BS, budget_bytes=2 * one, min_tokens=8)
    s.close()
    index = PrefixIndex(tmp_path)
    assert sorted(e.key for e in index.entries()) == sorted(entry_key(model_digest(FP), t) for t in prompts[1:])
    assert sorted(p.name for p in index.entries_dir.iterdir()) == sorted(e.key + ".kv" for e in index.entries())
    index.close()


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_gives_one_warning_and_the_store_goes_on(tmp_path, caplog):
    mnt = tmp_path / "small"
    if not _tmpfs(mnt, "1m"):
        pytest.skip("cannot mount a small tmpfs here (needs root); test_a_file_size_limit_... covers the path")
    try:
        s = PrefixStore(mnt, FP, BS, budget_bytes=10**9, min_tokens=8)
        with caplog.at_level(logging.WARNING, logger="localllm"):
            for k in range(3):  # each 600 kB: the second does not fit
                t = [k] * 12
                s.save(t, hashes_for(t), payload_for(t, 600_000))
                s.flush(10)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings
        assert s.num_writes == 1 and s.num_write_errors == 2
        assert [p.name for p in (mnt / "entries").iterdir() if p.name.startswith(".tmp")] == []
        s.index.clear()  # room again: writing works again
        save(s, [9] * 12, size=1000)
        assert s.find([9] * 12, hashes_for([9] * 12), 11).num_tokens == 11
        s.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_file_size_limit_during_a_write_gives_a_warning_and_serving_goes_on(tmp_path):
    """The same failure path without root: RLIMIT_FSIZE makes the kernel refuse the write (EFBIG)."""
    script = f"""
import logging, resource, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from test_prefix_store import FP, BS, hashes_for, payload_for
from localllm.engine.prefix_store import PrefixStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
logging.basicConfig(format="WARN %(message)s")
s = PrefixStore({str(tmp_path)!r}, FP, BS, budget_bytes=10**9, min_tokens=8)
s.flush(10)  # the index exists before the limit
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
for k in range(3):
    t = [k] * 12
    s.save(t, hashes_for(t), payload_for(t, 300_000 if k < 2 else 1000))
    s.flush(10)
print("writes", s.num_writes, "errors", s.num_write_errors)
f = s.find([2] * 12, hashes_for([2] * 12), 11)
print("found", f.num_tokens if f else None)
s.close()
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "writes 1 errors 2" in r.stdout and "found 11" in r.stdout
    warnings = [line for line in r.stderr.splitlines() if line.startswith("WARN")]
    assert len(warnings) == 1 and "File too large" in warnings[0]
    assert not [p for p in (tmp_path / "entries").iterdir() if p.name.startswith(".tmp")]


# -- the BlockManager admits a stored prefix -----------------------------------------------

class FakeSource:
    """A PrefixSource that offers ``num_tokens`` of every prompt and loads (or fails to)."""

    def __init__(self, num_tokens: int, loads: bool = True):
        self.num_tokens, self.loads = num_tokens, loads
        self.calls: list[tuple] = []

    def find(self, seq, hashes, limit):
        self.calls.append(("find", len(hashes), limit))
        return min(self.num_tokens, limit)

    def load(self, seq, num_tokens):
        self.calls.append(("load", num_tokens, list(seq.block_table)))
        return self.loads


def make_seq(token_ids):
    return Sequence(prompt_token_ids=list(token_ids), params=SamplingParams())


def test_a_stored_prefix_longer_than_the_pool_hit_is_loaded_into_fresh_blocks():
    bm = BlockManager(16, BS, FP, prefix_source=FakeSource(10))
    seq = make_seq(range(100, 113))  # 13 tokens: 3 full blocks
    assert bm.allocate(seq, 64) == 3  # tokens 10, 11, 12 are left to compute
    assert bm.prefix_source.calls == [("find", 3, 12), ("load", 10, [0, 1, 2, 3])]
    assert (seq.num_computed_tokens, seq.num_cached_tokens, seq.num_disk_tokens) == (10, 10, 10)
    assert bm.num_cached_blocks == 2  # its full loaded blocks are named for the next request
    other = make_seq(list(range(100, 108)) + [1, 2, 3])
    bm.prefix_source.num_tokens = 0
    assert bm.allocate(other, 64) == 3 and other.block_table[:2] == seq.block_table[:2]


def test_a_failed_load_computes_the_prompt_from_the_start_within_the_budget():
    bm = BlockManager(16, BS, FP, prefix_source=FakeSource(10, loads=False))
    seq = make_seq(range(100, 113))
    assert bm.allocate(seq, 6) == 6
    assert (seq.num_computed_tokens, seq.num_cached_tokens, seq.num_disk_tokens) == (0, 0, 0)
    assert len(seq.block_table) == 4  # room for the 10 + 3 it planned, more than the 6 it computes


def test_the_pool_is_preferred_unless_the_store_gives_a_block_more():
    bm = BlockManager(16, BS, FP, prefix_source=FakeSource(8))
    first = make_seq(range(100, 113))
    bm.prefix_source.num_tokens = 0
    bm.allocate(first, 64)
    first.num_computed_tokens = 13
    bm.cache_full_blocks(first)
    bm.prefix_source.num_tokens = 12 + BS - 1  # (a longer prompt) only 3 tokens more than the pool
    second = make_seq(range(100, 120))
    assert bm.allocate(second, 64) == 8  # 12 from the pool, none loaded
    assert second.num_disk_tokens == 0 and "load" not in [c[0] for c in bm.prefix_source.calls]
    bm.prefix_source.num_tokens = 12 + BS  # a whole block more: loaded
    third = make_seq(range(100, 120))
    assert bm.allocate(third, 64) == 4 and third.num_disk_tokens == 16


# -- sizes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("0", 0), ("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("2G", 2 * 10**9), ("500MB", 500 * 10**6),
    ("1.5g", 1_500_000_000), ("1000", 1000), ("64 kb", 64_000),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "2x", "-1G", "G", "nanG", "infG", "1.2.3M"])
def test_parse_size_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="like 2GiB"):
        parse_size(text)


def test_threads_opening_a_new_index_at_once_all_get_it(tmp_path):
    """The engine's first lookup and the writer thread's start-up sweep open a new store's
    index at the same moment. Turning a new SQLite file to WAL needs its exclusive lock, and
    the one that waits for it is refused at once, its busy timeout unused: each open must
    still succeed (it warned "database is locked" and lost the start-up eviction)."""
    import threading

    for attempt in range(30):
        index = PrefixIndex(tmp_path / f"store{attempt}")
        start, errors = threading.Barrier(4), []

        def open_it():
            start.wait()
            try:
                index.total_size()
            except Exception as e:  # noqa: BLE001 - every failure is the finding
                errors.append(e)
            finally:
                index.close()

        threads = [threading.Thread(target=open_it) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], errors


def test_processes_opening_a_new_index_at_once_all_get_it(tmp_path):
    """The same across processes (a server and a chat app started together on a new cache
    folder): the one refused the lock tries again. Three processes open each of four new
    stores at one moment (without the retry about one process in five failed)."""
    child = ("import sys, time\nfrom pathlib import Path\nfrom localllm.engine.prefix_store import PrefixIndex\n"
             "at = float(sys.argv[2])\nwhile time.time() < at:\n    pass\n"
             "print(PrefixIndex(Path(sys.argv[1])).total_size())\n")
    for attempt in range(4):
        at = time.time() + 1.0  # after the three have started
        procs = [subprocess.Popen([sys.executable, "-c", child, str(tmp_path / f"store{attempt}"), str(at)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
        results = [p.communicate(timeout=60) for p in procs]
        assert [(p.returncode, out, err) for p, (out, err) in zip(procs, results)] == [(0, "0\n", "")] * 3
