"""Crash consistency of the prefix store: a process writing entries is killed with SIGKILL at
random moments, 10 times (20 under --full); afterwards no damaged entry is ever loaded and the store keeps
working. No model: the payloads are bytes derived from each prompt, so a read can be checked.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localllm.engine.prefix_store import PrefixIndex, PrefixStore, decode_entry, model_digest

HERE = Path(__file__).resolve().parent

# Writes prompts k = 0, 1, 2, ... (each 4-12 MB), saying when each write starts and ends.
CHILD = f"""
import random, sys
sys.path.insert(0, {str(HERE)!r})
from test_prefix_store import FP, BS, hashes_for
from test_prefix_store_crash import prompt, payload
from localllm.engine.prefix_store import PrefixStore
s = PrefixStore(sys.argv[1], FP, BS, budget_bytes=40_000_000, min_tokens=8)
s.flush(10)
k = int(sys.argv[2])
print("ready", flush=True)
while True:
    t = prompt(k)
    print("start", k, flush=True)
    s.save(t, hashes_for(t), payload(k))
    s.flush()
    print("done", k, flush=True)
    k += 1
"""


def prompt(k: int) -> list[int]:
    return [k % 7] * 8 + [1000 + k] * 12  # the first 2 blocks shared by every 7th: siblings, subsumption


def payload(k: int) -> bytes:
    rng = random.Random(k)
    return rng.randbytes(rng.randrange(4_000_000, 12_000_000))


@pytest.mark.heavy
def test_sigkill_during_writes_never_leaves_an_entry_that_loads(tmp_path, caplog, full):
    runs = 20 if full else 10
    from test_prefix_store import BS, FP, hashes_for

    directory = tmp_path / "prefix"
    rng = random.Random(7)
    k, in_write = 0, 0
    for run in range(runs):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), str(k)],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))
        child.send_signal(signal.SIGKILL)
        lines = child.stdout.read().split()  # what it printed before it died
        child.wait(timeout=10)
        assert child.returncode == -signal.SIGKILL
        starts = [int(v) for t, v in zip(lines[::2], lines[1::2]) if t == "start"]
        dones = [int(v) for t, v in zip(lines[::2], lines[1::2]) if t == "done"]
        if starts and (not dones or dones[-1] != starts[-1]):
            in_write += 1  # killed with a write under way
        k = (starts[-1] + 1) if starts else k

        # Every indexed entry is complete and right; every prompt reads back right or not at all.
        index = PrefixIndex(directory)
        for e in index.entries():
            tokens, body = decode_entry(index.file(e.key).read_bytes(), model_digest(FP))
            assert len(tokens) == e.num_tokens
        index.close()
        store = PrefixStore(directory, FP, BS, budget_bytes=40_000_000, min_tokens=8)
        with caplog.at_level(logging.WARNING, logger="localllm"):
            for j in range(k):
                t = prompt(j)
                found = store.find(t, hashes_for(t), len(t))
                if found is not None and found.num_tokens == len(t):
                    assert bytes(store.read(found, t)) == payload(j)
        store.close()
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []

    assert in_write >= runs * 3 // 4, f"only {in_write} of {runs} kills landed during a write"
    # Leftovers of the kills (temporary files, files written but not indexed) are swept, and
    # the store works as before.
    index = PrefixIndex(directory)
    index.sweep(max_age_s=0.0)
    indexed = {e.key + ".kv" for e in index.entries()}
    assert {p.name for p in index.entries_dir.iterdir()} == indexed
    assert index.total_size() <= 40_000_000
    index.close()
    store = PrefixStore(directory, FP, BS, budget_bytes=40_000_000, min_tokens=8)
    t = prompt(10_000)
    assert store.save(t, hashes_for(t), payload(10_000)) and store.flush(30)
    assert bytes(store.read(store.find(t, hashes_for(t), len(t)), t)) == payload(10_000)
    store.close()
    assert os.listdir(directory)  # (the directory is still the store's)
