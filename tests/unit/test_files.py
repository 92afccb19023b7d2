"""localllm.files: atomic replacement and the sweep of temporaries that killed writers left."""

from __future__ import annotations

import os
import time

import pytest

from localllm.files import sweep_temporaries, write_atomic


def test_write_atomic_replaces_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "sub" / "models.json"
    write_atomic(target, b"one")
    write_atomic(target, b"two")
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["models.json"]


def test_temporary_in_another_folder(tmp_path):
    target = tmp_path / "refs" / "main"
    write_atomic(target, b"abc123", tmp_dir=tmp_path)
    assert target.read_text() == "abc123"
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["refs", "refs/main"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path, monkeypatch):
    target = tmp_path / "models.json"
    write_atomic(target, b"old")

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["models.json"]


def test_sweep_removes_stale_temporaries_of_that_name_only(tmp_path):
    stale, young = tmp_path / ".models.json.a1.tmp", tmp_path / ".models.json.b2.tmp"
    other = tmp_path / ".main.c3.tmp"
    for p in (stale, young, other):
        p.write_bytes(b"half")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    assert sweep_temporaries(tmp_path, "models.json") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".main.c3.tmp", ".models.json.b2.tmp"]
    write_atomic(tmp_path / "main", b"x")  # a write sweeps its own name's stale temporaries
    assert sorted(p.name for p in tmp_path.iterdir()) == [".models.json.b2.tmp", "main"]
