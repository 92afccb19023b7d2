"""Crash consistency of the chat app's conversations: a process saving conversations as the app
does (create, a user message, its answer, three turns, the oldest turn dropped from the
context, a rename) is killed with SIGKILL at random moments, 10 times (20 under --full). After each kill the
store opens, passes SQLite's integrity check, and holds only whole messages with the exact
bytes written, in order, each conversation a prefix of what the process meant to save, a turn
never half dropped; the next process carries on in the same file."""

from __future__ import annotations

import functools
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localllm.tui.conversations import ConversationStore, Message

HERE = Path(__file__).resolve().parent
NUM_TURNS = 3

# Saves conversations k = start, start + 1, ..., saying when each starts and ends.
CHILD = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from test_conversations_crash import content
from localllm.tui.conversations import ConversationStore, Message
store = ConversationStore(sys.argv[1])
k = int(sys.argv[2])
print("ready", flush=True)
while True:
    print("start", k, flush=True)
    conv = store.create(model="m", system=f"k={{k}}", title=f"chat {{k}}")
    first = []
    for j in range({NUM_TURNS}):
        first.append(store.add_message(conv.id, Message("user", content(k, j, "user"))).id)
        first.append(store.add_message(conv.id, Message("assistant", content(k, j, "assistant"),
                                                        stats={{"k": k, "j": j}})).id)
    store.exclude(first[:2])
    store.rename(conv.id, f"done {{k}}")
    print("done", k, flush=True)
    k += 1
"""


# Random bytes to letters, spaces and two characters of more than one UTF-8 byte (a quarter of
# the time of random.choices, so the child spends its time saving, not making text).
LETTERS = str.maketrans({chr(i): "abcdefghij klmnopqrstuvwxyzé€"[i % 29] for i in range(256)})


@functools.lru_cache(maxsize=None)
def content(k: int, j: int, role: str) -> str:
    """Message j of conversation k: 2 KB to 1.5 MB of text that names itself at both ends."""
    rng = random.Random(f"{k}-{j}-{role}")
    body = rng.randbytes(rng.randrange(2_000, 1_500_000)).decode("latin-1").translate(LETTERS)
    return f"<{k}/{j}/{role}>{body}</{k}/{j}/{role}>"


def expected_messages(k: int) -> list[tuple[str, str]]:
    return [(role, content(k, j, role)) for j in range(NUM_TURNS) for role in ("user", "assistant")]


def check_store(path: Path, since: int = 0) -> int:
    """Every conversation from k = since on is a prefix of what was meant; returns how many of
    them are complete. (After each kill only the new ones are read; the end reads them all.)"""
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    store = ConversationStore(path)
    num_done = 0
    try:
        for listed in store.list():
            k = int(listed.system.removeprefix("k="))
            if k < since:
                continue
            conv = store.get(listed.id)
            got = [(m.role, m.content) for m in conv.messages]
            assert got == expected_messages(k)[:len(got)], f"conversation {k} holds other bytes"
            assert [m.stats for m in conv.messages if m.role == "assistant"] == [
                {"k": k, "j": j} for j in range(len(got) // 2)]
            excluded = [m.excluded for m in conv.messages]
            assert excluded in ([False] * len(got), [True, True] + [False] * (len(got) - 2)), \
                f"conversation {k}: a turn half dropped: {excluded}"
            if conv.title == f"done {k}":
                assert len(got) == 2 * NUM_TURNS and excluded[:2] == [True, True]
                num_done += 1
            else:
                assert conv.title == f"chat {k}"
        assert all(text.endswith("/user>") for text in store.recent_inputs())
    finally:
        store.close()
    return num_done


@pytest.mark.heavy
def test_sigkill_during_saves_leaves_only_whole_conversations(tmp_path, full):
    runs = 20 if full else 10
    path = tmp_path / "history.db"
    rng = random.Random(11)
    k, in_save, num_done = 0, 0, 0
    for run in range(runs):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(k)], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.8))
        child.send_signal(signal.SIGKILL)
        lines = child.stdout.read().split()
        child.wait(timeout=10)
        assert child.returncode == -signal.SIGKILL
        starts = [int(v) for t, v in zip(lines[::2], lines[1::2]) if t == "start"]
        dones = [int(v) for t, v in zip(lines[::2], lines[1::2]) if t == "done"]
        if starts and (not dones or dones[-1] != starts[-1]):
            in_save += 1
        first, k = k, (starts[-1] + 1 if starts else k)

        num_done = check_store(path, since=first)
        assert num_done >= len(dones)  # every conversation the process finished is there, whole

    assert in_save >= runs * 3 // 4, f"only {in_save} of {runs} kills landed during a save"
    # The file goes on working: a new conversation is saved and read back.
    store = ConversationStore(path)
    conv = store.create(model="m", system="k=999999", title="chat 999999")
    store.add_message(conv.id, Message("user", content(999999, 0, "user")))
    store.close()
    check_store(path)


def test_a_failed_exclude_drops_nothing(tmp_path):
    """exclude() is one transaction: when its second update fails, the first is undone."""
    store = ConversationStore(tmp_path / "history.db")
    conv = store.create()
    question = store.add_message(conv.id, Message("user", "q"))
    answer = store.add_message(conv.id, Message("assistant", "a"))
    with sqlite3.connect(tmp_path / "history.db") as db:
        db.execute(f"CREATE TRIGGER fail BEFORE UPDATE ON messages WHEN NEW.id = {answer.id} "
                   "BEGIN SELECT RAISE(ABORT, 'disk gone'); END")
    with pytest.raises(sqlite3.DatabaseError, match="disk gone"):
        store.exclude([question.id, answer.id])
    assert [m.excluded for m in store.get(conv.id).messages] == [False, False]
    store.close()
