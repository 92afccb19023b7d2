"""`localllm chat` end to end in a real terminal: tmux runs the app on the real Qwen model, the
test types into it with send-keys and reads the screen with capture-pane, then checks the
SQLite file the app saved. Timings are printed (run with -s), never asserted."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.model,
    # In the test command (scripts/test.sh installs tmux) a missing tmux fails, never skips.
    pytest.mark.skipif(shutil.which("tmux") is None and not os.environ.get("LOCALLLM_REQUIRE_MODELS"),
                       reason="tmux is not installed"),
]

WIDTH, HEIGHT = 160, 45
POLL_S = 0.2
NOTICE_TIMEOUT_S = 15  # the app shows it for 8 s
READY_TIMEOUT_S = 60  # model load (and, with --resume, the warming prefill)
ANSWER_TIMEOUT_S = 60
READY_HELD_S = 2  # after --resume, when the warming was too quick to see
STOP_TIMEOUT_S = 15  # Escape to "ready"; the whole essay would take minutes
EXIT_TIMEOUT_S = 30

QUESTION = "What is 2+2? Answer in one sentence."
ESSAY = "Write a 3000 word essay about the history of computing, with many sections."
FOLLOW_UP = "Thanks. Name one early computer."

# The status bar: "MODEL · STATE │ TTFT 152 ms │ 32.8 tok/s │ prompt 34 / cached 0 │ KV 0% of 4,096
# │ 2 threads", with "│ draft 41/43 │" before "prompt" after an answer that drafted (greedy, as
# here), and "1/2 threads" while the load leaves decode fewer threads than the most.
STATUS = re.compile(r"· (?P<state>[a-z][a-z ]*?)\s+│\s+TTFT (?P<ttft>\d+ ms|-)\s+│\s+(?P<speed>[\d.]+|-) tok/s"
                    r"(?:\s+│\s+draft (?P<draft>[\d,]+/[\d,]+))?"
                    r"\s+│\s+prompt (?P<prompt>\d[\d,]*|-) / cached (?P<cached>\d[\d,]*|-)"
                    r"(?:\s+│\s+KV (?P<kv>\S.*?))?"
                    r"(?:\s+│\s+(?P<threads>\d+(?:/\d+)?) threads?)?\s*$")
KV_USED = re.compile(r"^(\d+)% of [\d,]+")
# A message's last line: "■ stopped  TTFT 138 ms · 28.3 tok/s · 85 tokens · prompt 78 (48 cached)"
FOOTER = re.compile(r"^(■ stopped)?\s*(TTFT \d+ ms · .*)?$")


class Tmux:
    """One tmux server on its own socket; each run of the app is a session on it."""

    def __init__(self, socket: str):
        self.socket = socket

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        # -u: UTF-8 whatever the locale says; -f /dev/null: no user configuration. The server
        # passes its environment to the app: not pytest's COLUMNS/LINES (Textual would take
        # them over the real size), nor an outer tmux's.
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX", "TMUX_PANE")}
        return subprocess.run(["tmux", "-u", "-L", self.socket, "-f", "/dev/null", *args], env=env,
                              capture_output=True, text=True, check=check, timeout=10)

    def start(self, session: str, argv: list[str], env: dict[str, str], rc_file: Path) -> None:
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        script = f"export {exports}; {shlex.join(argv)}; echo $? > {shlex.quote(str(rc_file))}"
        # remain-on-exit keeps the last screen (a traceback, say) for the failure message.
        self("new-session", "-d", "-s", session, "-x", str(WIDTH), "-y", str(HEIGHT), "sh", "-c", script,
             ";", "set-option", "-t", session, "remain-on-exit", "on")

    def capture(self, session: str) -> str:
        return self("capture-pane", "-p", "-t", session).stdout

    def type(self, session: str, text: str) -> None:
        self("send-keys", "-t", session, "-l", text)
        self("send-keys", "-t", session, "Enter")

    def key(self, session: str, key: str) -> None:
        self("send-keys", "-t", session, key)

    def kill(self) -> None:
        self("kill-server", check=False)
        # tmux leaves its socket file behind: /tmp/tmux-UID/NAME (or under TMUX_TMPDIR).
        folder = Path(os.environ.get("TMUX_TMPDIR") or "/tmp") / f"tmux-{os.getuid()}"
        (folder / self.socket).unlink(missing_ok=True)


@pytest.fixture
def tmux():
    server = Tmux(f"localllm-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    # The server outlives its sessions: by default it exits with its last one, and a session
    # started just after a kill-session could reach it while it exits ("server exited
    # unexpectedly", seen once in a full run).
    server("start-server", ";", "set-option", "-g", "exit-empty", "off")
    try:
        yield server
    finally:
        server.kill()


# -- reading the screen -------------------------------------------------------------------


def status(pane: str) -> dict | None:
    """The status bar's fields, or None while it is not drawn."""
    for line in reversed(pane.splitlines()):
        m = STATUS.search(line)
        if m:
            return m.groupdict()
    return None


def number(text: str) -> int:
    return int(text.replace(",", ""))


def messages(pane: str) -> list[tuple[str, list[str]]]:
    """The messages on screen, oldest first: (heading, text lines without the footer)."""
    out: list[tuple[str, list[str]]] = []
    for line in pane.splitlines():
        _, sep, rest = line.partition("│ █")
        if not sep:
            continue
        text = rest.strip()
        if text in ("You", "Assistant", "Error", "localllm"):
            out.append((text, []))
        elif out and not FOOTER.match(text):
            out[-1][1].append(text)
    return out


def settled(tmux: Tmux, session: str, timeout_s: float = 10) -> str:
    """The screen once its messages stop changing: the status bar can say ready a frame before
    the answer's last Markdown render reaches the screen (a run read "2 plus" of "2 plus 2
    equals 4")."""
    pane = tmux.capture(session)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(4 * POLL_S)
        again = tmux.capture(session)
        if messages(again) == messages(pane):
            return again
        pane = again
    raise AssertionError(f"the messages still changed {timeout_s} s later; the screen:\n{pane}")


def words(text: str) -> list[str]:
    """Words, so Markdown's rendering (emphasis, bullets, wrapping) does not matter."""
    return re.findall(r"\w+", text)


def wait_for(tmux: Tmux, session: str, what: str, predicate, timeout_s: float, poll_s: float = POLL_S) -> str:
    """Poll the screen until ``predicate(pane)`` holds; the pane it held on."""
    deadline = time.monotonic() + timeout_s
    pane = ""
    while time.monotonic() < deadline:
        pane = tmux.capture(session)
        if predicate(pane):
            return pane
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; the screen:\n{pane}")


def state_is(state: str):
    def check(pane: str) -> bool:
        s = status(pane)
        return s is not None and s["state"] == state
    return check


def wait_exit_code(rc_file: Path, tmux: Tmux, session: str) -> int:
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while time.monotonic() < deadline:
        if rc_file.exists() and rc_file.read_text().strip():
            return int(rc_file.read_text())
        time.sleep(POLL_S)
    raise AssertionError(f"the app did not exit within {EXIT_TIMEOUT_S} s; the screen:\n{tmux.capture(session)}")


def saved_messages(db_path: Path) -> list[tuple[str, str, int, dict]]:
    """(role, content, stopped, stats) of every saved message, in order."""
    db = sqlite3.connect(db_path)
    try:
        assert db.execute("SELECT count(*) FROM conversations").fetchone() == (1,)
        rows = db.execute("SELECT role, content, stopped, stats FROM messages ORDER BY id").fetchall()
    finally:
        db.close()
    return [(role, content, stopped, json.loads(stats)) for role, content, stopped, stats in rows]


# -- the test -----------------------------------------------------------------------------


def test_chat_stop_quit_and_resume_in_tmux(tmux, tmp_path, qwen_path):
    env = {"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "TERM": "xterm-256color"}
    argv = [str(Path(sys.executable).parent / "localllm"), "chat", str(qwen_path),
            "--ctx", "4096", "--temperature", "0"]
    db_path = tmp_path / "data" / "localllm" / "conversations.db"

    # 1. Start, and wait for the model to load.
    rc_file = tmp_path / "rc1"
    spawned = time.monotonic()
    tmux.start("chat", argv, env, rc_file)
    pane = wait_for(tmux, "chat", "the status bar to say ready", state_is("ready"), READY_TIMEOUT_S)
    print(f"\nready {time.monotonic() - spawned:.1f} s after the spawn")
    assert status(pane)["ttft"] == "-" and status(pane)["prompt"] == "-"  # no answer yet
    # The loaded model's KV cache is announced in a notice over the messages' corner (it can
    # reach the screen a frame after the status bar says ready).
    wait_for(tmux, "chat", "the KV-cache notice", lambda p: "KV cache: 4,096 tokens (48 MiB, f16)" in p, 5)
    wait_for(tmux, "chat", "the KV-cache notice to go", lambda p: "KV cache:" not in p, NOTICE_TIMEOUT_S)

    # 2. A short question: the answer shows, and the status bar gets its figures.
    tmux.type("chat", QUESTION)
    wait_for(tmux, "chat", "the first answer to finish",
             lambda p: state_is("ready")(p) and status(p)["ttft"] != "-", ANSWER_TIMEOUT_S)
    pane = settled(tmux, "chat")
    first = status(pane)
    assert re.fullmatch(r"\d+ ms", first["ttft"]) and re.fullmatch(r"\d+\.\d", first["speed"]), first
    assert number(first["cached"]) == 0  # nothing was cached before the first turn
    shown = messages(pane)
    assert [role for role, _ in shown] == ["You", "Assistant"], pane
    assert shown[0][1] == [QUESTION]
    first_answer = " ".join(shown[1][1])
    assert words(first_answer), pane
    print(f"first answer: TTFT {first['ttft']}, {first['speed']} tok/s, prompt {first['prompt']}")

    # 3. A question with a very long answer, stopped with Escape once some of it has streamed.
    tmux.type("chat", ESSAY)

    def streaming(p: str) -> bool:
        shown = messages(p)
        return (state_is("answering")(p) and len(shown) == 4 and shown[-1][0] == "Assistant"
                and len(" ".join(shown[-1][1])) >= 150)

    wait_for(tmux, "chat", "the essay to stream a few lines", streaming, ANSWER_TIMEOUT_S)
    tmux.key("chat", "Escape")
    pressed = time.monotonic()
    pane = wait_for(tmux, "chat", "'■ stopped' and the state back to ready",
                    lambda p: "■ stopped" in p and state_is("ready")(p), STOP_TIMEOUT_S)
    print(f"ready {time.monotonic() - pressed:.1f} s after Escape")
    stopped_answer = " ".join(messages(settled(tmux, "chat"))[-1][1])
    # The stopped request gave its KV blocks back (the engine figures are polled each second).
    wait_for(tmux, "chat", "the KV cache in use to drop to 0%",
             lambda p: (m := KV_USED.match(status(p)["kv"] or "")) is not None and m.group(1) == "0", 10)

    # 4. Quit: exit code 0.
    tmux.key("chat", "C-q")
    assert wait_exit_code(rc_file, tmux, "chat") == 0
    saved = saved_messages(db_path)
    assert [(role, stopped) for role, _, stopped, _ in saved] == [
        ("user", 0), ("assistant", 0), ("user", 0), ("assistant", 1)]
    assert saved[0][1] == QUESTION and saved[2][1] == ESSAY
    # What was saved is what the screen showed, and the status bar showed the saved figures.
    assert words(saved[1][1]) == words(first_answer)
    assert words(saved[3][1]) == words(stopped_answer)
    stats = saved[1][3]
    assert first["ttft"] == f"{stats['ttft'] * 1000:.0f} ms" and first["speed"] == f"{stats['tokens_per_s']:.1f}"
    assert (number(first["prompt"]), number(first["cached"])) == (stats["prompt_tokens"], stats["cached_tokens"])
    assert stats["finish_reason"] == "stop"
    assert saved[3][3]["finish_reason"] == "abort"
    tmux("kill-session", "-t", "chat")

    # 5. --resume: the conversation comes back, its KV is warmed, and the next turn hits it.
    rc_file = tmp_path / "rc2"
    spawned = time.monotonic()
    tmux.start("resume", argv + ["--resume"], env, rc_file)

    # loading, ready (for a moment), warming the cache, ready. The warming prefill may be too
    # quick to see between two looks; "ready" held for READY_HELD_S means it is over.
    states_seen: set[str] = set()
    ready_since: list[float] = []

    def warmed(p: str) -> bool:
        s = status(p)
        if s is None or s["state"] != "ready":
            states_seen.add(s and s["state"])
            ready_since.clear()
            return False
        ready_since[:] = ready_since or [time.monotonic()]
        return "warming the cache" in states_seen or time.monotonic() - ready_since[0] >= READY_HELD_S

    pane = wait_for(tmux, "resume", "ready after warming the cache", warmed, READY_TIMEOUT_S, poll_s=0.05)
    print(f"resumed and warmed {time.monotonic() - spawned:.1f} s after the spawn "
          f"(warming {'seen' if 'warming the cache' in states_seen else 'not seen'})")
    shown = messages(pane)
    assert [role for role, _ in shown] == ["You", "Assistant", "You", "Assistant"], pane
    assert shown[0][1] == [QUESTION] and shown[2][1] == [ESSAY]
    assert words(" ".join(shown[1][1])) == words(saved[1][1])
    assert words(" ".join(shown[3][1])) == words(saved[3][1])
    assert "■ stopped" in pane
    before = status(pane)
    assert before["prompt"] == f"{saved[3][3]['prompt_tokens']:,}"  # the last answer's figures

    tmux.type("resume", FOLLOW_UP)
    # The state reads "answering" until the answer is saved, and the new prompt is longer.
    wait_for(tmux, "resume", "the answer after resuming to finish",
             lambda p: state_is("ready")(p) and status(p)["prompt"] != before["prompt"], ANSWER_TIMEOUT_S)
    pane = settled(tmux, "resume")
    shown = messages(pane)
    assert shown[-2] == ("You", [FOLLOW_UP]) and shown[-1][0] == "Assistant", pane
    last_answer = " ".join(shown[-1][1])
    last = status(pane)
    cached = number(last["cached"])
    print(f"answer after resuming: TTFT {last['ttft']}, prompt {last['prompt']} / cached {cached}")
    # A fresh process has nothing cached, so only the warming prefill can explain cached
    # tokens, and it covered the stopped answer too: more than the whole turn-2 prompt.
    assert cached > saved[3][3]["prompt_tokens"]

    tmux.key("resume", "C-q")
    assert wait_exit_code(rc_file, tmux, "resume") == 0
    saved = saved_messages(db_path)
    assert [(role, stopped) for role, _, stopped, _ in saved] == [
        ("user", 0), ("assistant", 0), ("user", 0), ("assistant", 1), ("user", 0), ("assistant", 0)]
    assert saved[4][1] == FOLLOW_UP
    assert words(saved[5][1]) == words(last_answer)
    stats = saved[5][3]
    assert stats["finish_reason"] == "stop"
    assert (stats["prompt_tokens"], stats["cached_tokens"]) == (number(last["prompt"]), cached)
    assert stats["cached_tokens"] > 0
