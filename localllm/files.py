"""Files that are never left half-written: write a temporary file beside the target, fsync it,
rename it over the target, fsync the folder. A crash at any moment leaves the old file or the
new one (a power cut too, once the folder is synced), plus at most a temporary file that no
reader looks at and the next write sweeps."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

STALE_TEMPORARY_S = 60.0  # a temporary file this old belongs to a writer that died


def write_atomic(path: Path, data: bytes, tmp_dir: Path | None = None) -> None:
    """Replace ``path`` with ``data`` atomically. The temporary file is ``.NAME.*.tmp`` in
    ``tmp_dir`` (default: path's folder; give another folder on the same file system where
    readers list path's folder, as huggingface_hub does refs/)."""
    path = Path(path)
    folder = Path(tmp_dir) if tmp_dir is not None else path.parent
    folder.mkdir(parents=True, exist_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_temporaries(folder, path.name)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def sweep_temporaries(folder: Path, name: str, max_age_s: float = STALE_TEMPORARY_S) -> int:
    """Delete the temporary files of ``name`` that writers killed before their rename left in
    ``folder``; returns how many. Young ones may be another process's write under way."""
    removed, now = 0, time.time()
    for tmp in Path(folder).glob(f".{name}.*.tmp"):
        try:
            if now - tmp.stat().st_mtime > max_age_s:
                tmp.unlink()
                removed += 1
        except OSError:
            pass  # gone already, or not ours to remove
    return removed


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in ``directory`` durable (a no-op where folders cannot be
    opened, as on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
