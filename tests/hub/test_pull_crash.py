"""Crash consistency of `localllm pull`: a pull of a two-part model from the fake hub (over a
slow link) is killed with SIGKILL at random moments, 10 times (20 under --full). After each kill every file in
the Hugging Face cache and the data folder is complete and verified (a blob's bytes hash to its
name, a snapshot link leads to such a blob, refs/main names the commit, models.json parses and
lists only whole models) or is a partial download under a name nothing reads (blobs/*.incomplete,
holding a prefix of the true bytes); huggingface_hub's own cache scan finds nothing corrupt;
`localllm ls` works; and the next pull resumes and finishes with the right bytes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fake_hub import tiny_gguf

from localllm.cli import main

REPO = "acme/crash-GGUF"
NAME = f"hf.co/{REPO}:Q4_K_M"
MiB = 1 << 20
PARTS = {f"crash-Q4_K_M-0000{i + 1}-of-00002.gguf": tiny_gguf(6 * MiB, 10 + i, split=(i, 2)) for i in range(2)}
SHAS = {hashlib.sha256(data).hexdigest(): data for data in PARTS.values()}
_TEMPORARY = re.compile(r"\.main\.[^/]+\.tmp")  # write_atomic's, in the repo folder: never read


def start_pull() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "localllm.cli", "pull", NAME, "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def cache_state(hub_env, commit: str) -> str:
    """Checks every file of the repo's cache folder; returns how far the pull had come."""
    root = hub_env.storage(REPO)
    if not root.exists():
        return "nothing"
    stages = {"nothing"}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_dir() and not path.is_symlink():
            continue
        if rel.startswith("blobs/") and rel.endswith(".incomplete"):
            sha = path.name.removesuffix(".incomplete")
            have = path.read_bytes()
            assert sha in SHAS and SHAS[sha].startswith(have), f"{rel}: not a prefix of the file's bytes"
            stages.add("partial")
        elif rel.startswith("blobs/"):
            assert path.name in SHAS, f"{rel}: a blob of no file of the repo"
            assert hashlib.sha256(path.read_bytes()).hexdigest() == path.name, f"{rel}: its bytes do not match its name"
            stages.add("blob")
        elif rel.startswith(f"snapshots/{commit}/"):
            assert path.is_symlink() and path.exists(), f"{rel}: a snapshot entry that leads to no blob"
            assert path.read_bytes() == PARTS[path.name], f"{rel}: the wrong bytes"
            stages.add("snapshot")
        elif rel == "refs/main":
            assert path.read_text() == commit, f"refs/main holds {path.read_text()!r}"
            stages.add("ref")
        else:
            assert _TEMPORARY.fullmatch(rel), f"{rel}: a file nothing should have left"
    # A partial download outranks a linked part: a kill in the second part's download lands
    # mid-file too (after a kill the next pull keeps the first part, so on a quiet machine most
    # kills land in the second part).
    for stage in ("ref", "partial", "snapshot", "blob"):
        if stage in stages:
            return stage
    return "nothing"


def scan_is_clean(hub_env) -> None:
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub_env.cache) if hub_env.cache.exists() else None
    assert info is None or info.warnings == [], [str(w) for w in info.warnings]


def ls_models(capsys) -> list[dict]:
    capsys.readouterr()
    assert main(["ls", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def check_recorded(models: list[dict]) -> bool:
    """Whether the model is recorded; if it is, whole and verified."""
    assert [m["name"] for m in models] in ([], [NAME])
    if not models:
        return False
    (model,) = models
    assert model["present"] and "error" not in model
    assert [Path(f).read_bytes() for f in model["files"]] == list(PARTS.values())
    return True


@pytest.mark.heavy
def test_sigkill_at_random_moments_of_a_pull(hub_env, capsys, full):
    runs = 20 if full else 10
    commit = hub_env.hub.add_repo(REPO, PARTS).commit
    for name in PARTS:
        hub_env.hub.file(REPO, name).chunk_delay_s = 0.04  # about 0.25 s a part on the wire

    # One pull to the end measures how long the kills have to land in, from its first request.
    start, first = len(hub_env.hub.requests), None
    proc = start_pull()
    while proc.poll() is None:
        if first is None and len(hub_env.hub.requests) > start:
            first = time.monotonic()
        time.sleep(0.005)
    assert proc.returncode == 0, proc.stderr.read()
    window = time.monotonic() - (first or time.monotonic())
    assert check_recorded(ls_models(capsys))
    assert main(["rm", "-y", NAME]) == 0 and hub_env.cache_files(REPO) == []

    rng = random.Random(20261130)
    stages = []
    for run in range(runs):
        start = len(hub_env.hub.requests)
        proc = start_pull()
        deadline = time.monotonic() + 120
        while len(hub_env.hub.requests) == start and proc.poll() is None:  # it has started talking
            assert time.monotonic() < deadline, "the pull never reached the hub"
            time.sleep(0.002)
        # Stratified: kill k lands in the k-th twentieth of 0.8 of a whole pull's time.
        time.sleep(window * 0.8 * (run + rng.random()) / runs)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)

        stage = cache_state(hub_env, commit)
        scan_is_clean(hub_env)
        recorded = check_recorded(ls_models(capsys))
        stages.append("recorded" if recorded else stage)
        if recorded:  # start over, so that the next kill lands in a download again
            assert main(["rm", "-y", NAME]) == 0

    # The kills landed all along the way (by construction), among them mid-file and after the
    # record. (Which other stages they meet depends on the machine's speed: on a quiet one
    # nearly every kill finds a download under way.) ...
    with capsys.disabled():
        print(f"\nstages at the kills: {stages}")
    assert {"partial", "recorded"} <= set(stages), stages
    # ... and the next pull resumes from what is there and ends with the right files.
    before = len(hub_env.hub.requests)
    proc = start_pull()
    assert proc.wait(120) == 0, proc.stderr.read()
    assert check_recorded(ls_models(capsys))
    assert cache_state(hub_env, commit) == "ref"
    scan_is_clean(hub_env)
    ranged = [r for r in hub_env.hub.requests[before:] if r.method == "GET" and r.range]
    sent = sum(r.bytes_sent for r in hub_env.hub.requests[before:] if r.method == "GET")
    assert sent <= sum(len(d) for d in PARTS.values()), (sent, ranged)
    os.sync()
