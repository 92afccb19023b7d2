"""The persistent prefix cache: the KV of long prompts kept on disk, found again after a restart.

After the prefill of a prompt of ``min_tokens`` or more, the engine hands the runner's bytes
for the prompt's KV to ``PrefixStore.save``; a writer thread writes them (the engine never
waits on the disk). On admission the BlockManager asks ``find`` for the longest stored prefix
of a new prompt, and ``read`` gives its bytes back, checked, for the runner to load.

Layout of the store's directory::

    index.sqlite3       entries (one row each) and blocks (one row per full block of each)
    entries/KEY.kv      one entry: header, token ids, the runner's KV bytes

An entry holds the KV of a prompt's first ``num_tokens`` tokens. Its full blocks are indexed
by their chain hashes, the BlockManager's names for them (hash(parent, tokens), the first
parent being the model fingerprint), so the deepest hash of a new prompt found in ``blocks``
names the entry with the longest shared prefix; the tokens after its last full block (the
*tail*, fewer than a block) are kept in the index too, so a prompt sent again matches to its
last token and only that one is computed.

Entry file format (little-endian)::

    magic      8 bytes   b"LLMKVPFX"
    version    u16       FORMAT_VERSION
    flags      u16       0
    model      16 bytes  blake2b-128 of the model fingerprint (file, runner, KV layout)
    num_tokens u32
    size       u64       bytes of the KV payload
    checksum   u32       CRC-32 over the header's other fields, the token ids and the payload
    tokens     num_tokens x i32
    payload    size bytes (llama.cpp: llama_state_seq_get_data of the sequence; torch:
               KVPool.export_slots of its positions)

Nothing in it is executed or unpickled. A file is written to a temporary name, fsynced and
renamed, then indexed; eviction unindexes before it unlinks. So a crash at any moment leaves
each indexed entry complete, or a file nobody indexes (swept later); a damaged or foreign
entry is refused by its header and checksum, dropped with one warning line, and the request
is computed normally.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import sqlite3
import struct
import threading
import time
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path

from localllm.files import fsync_dir

log = logging.getLogger("localllm.prefix_cache")

MAGIC = b"LLMKVPFX"
FORMAT_VERSION = 1
INDEX_VERSION = 1
_HEADER = struct.Struct("<8sHH16sIQI")  # magic, version, flags, model, num_tokens, size, checksum
HEADER_SIZE = _HEADER.size
ENTRY_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"
_STALE_S = 600.0  # temporary / unindexed files older than this are leftovers of a crash
_OPEN_TIMEOUT_S = 10.0  # how long opening the index waits for another connection's lock
_OPENING = threading.Lock()  # one connection of this process opens an index at a time
DEFAULT_BUDGET = 2 * 1024**3
DEFAULT_MIN_TOKENS = 256
MAX_PENDING_BYTES = 512 * 1024**2  # writes queued beyond this are skipped, never waited for


class BadEntry(Exception):
    """An entry file that must not be loaded: damaged, truncated, foreign or of another version."""


def model_digest(fingerprint: bytes) -> bytes:
    return hashlib.blake2b(fingerprint, digest_size=16).digest()


_TOKEN_TYPE = "i" if array("i").itemsize == 4 else "l"  # int32 on every platform CPython runs on


def _tokens_bytes(token_ids) -> bytes:
    return array(_TOKEN_TYPE, token_ids).tobytes()


def encode_header(model: bytes, token_ids: list[int], payload) -> bytes:
    """The header and token ids of an entry whose KV bytes are ``payload`` (any buffer)."""
    tokens = _tokens_bytes(token_ids)
    size = memoryview(payload).nbytes
    fields = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, model, len(token_ids), size, 0)
    crc = zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(fields[:-4])))
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, model, len(token_ids), size, crc) + tokens


def decode_entry(data, model: bytes) -> tuple[list[int], memoryview]:
    """(token ids, payload view) of an entry's bytes, or BadEntry saying what is wrong."""
    view = memoryview(data)
    if view.nbytes < HEADER_SIZE:
        raise BadEntry(f"truncated ({view.nbytes} bytes, shorter than the header)")
    magic, version, _flags, entry_model, num_tokens, size, crc = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise BadEntry("not a localllm prefix-cache entry (bad magic)")
    if version != FORMAT_VERSION:
        raise BadEntry(f"format version {version}, this localllm reads {FORMAT_VERSION}")
    if entry_model != model:
        raise BadEntry("written for another model, runner or KV layout")
    expected = HEADER_SIZE + 4 * num_tokens + size
    if view.nbytes != expected:
        raise BadEntry(f"truncated or padded ({view.nbytes} bytes, the header says {expected})")
    tokens = view[HEADER_SIZE:HEADER_SIZE + 4 * num_tokens]
    payload = view[HEADER_SIZE + 4 * num_tokens:]
    fields = bytes(view[:HEADER_SIZE - 4])
    if zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(fields))) != crc:
        raise BadEntry("checksum mismatch (the file is damaged)")
    return array(_TOKEN_TYPE, tokens.tobytes()).tolist(), payload


def entry_key(model: bytes, token_ids: list[int]) -> str:
    return hashlib.blake2b(model + _tokens_bytes(token_ids), digest_size=16).hexdigest()


@dataclass(frozen=True)
class EntryInfo:
    key: str
    model: str  # hex of the model digest
    model_name: str
    num_tokens: int
    size: int  # bytes of the file
    created: float
    last_used: float


@dataclass(frozen=True)
class Found:
    """The stored entry with the longest prefix of a prompt."""

    key: str
    num_tokens: int  # tokens of the prompt it gives


_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    model_name TEXT NOT NULL,
    num_tokens INTEGER NOT NULL,
    num_blocks INTEGER NOT NULL,
    tail BLOB NOT NULL,
    size INTEGER NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS blocks (
    hash BLOB NOT NULL,
    key TEXT NOT NULL,
    idx INTEGER NOT NULL,
    PRIMARY KEY (hash, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_by_key ON blocks (key);
CREATE INDEX IF NOT EXISTS entries_by_use ON entries (last_used);
"""


class PrefixIndex:
    """The SQLite index of a store directory; one connection per thread. It needs no model, so
    `localllm cache ls|stats|clear` use it directly."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.entries_dir = self.directory / "entries"
        self.path = self.directory / "index.sqlite3"
        self._local = threading.local()

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            self.entries_dir.mkdir(parents=True, exist_ok=True)
            # Turning a new file to WAL takes its exclusive lock, and a connection refused it
            # there is refused at once, its busy timeout unused: this process's threads (the
            # engine's first lookup, the writer's start-up sweep) open one at a time, and a
            # connection that lost to another process's tries again.
            deadline = time.monotonic() + _OPEN_TIMEOUT_S
            with _OPENING:
                while True:
                    try:
                        db = self._connect()
                        break
                    except sqlite3.OperationalError as e:
                        if "locked" not in str(e) or time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)
            self._local.db = db
        return db

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=_OPEN_TIMEOUT_S, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, INDEX_VERSION):
                raise OSError(f"the prefix-cache index {self.path} is of version {version}; "
                              f"run `localllm cache clear`")
            db.executescript(_SCHEMA)
            db.execute(f"PRAGMA user_version={INDEX_VERSION}")
        except BaseException:
            db.close()
            raise
        return db

    def file(self, key: str) -> Path:
        return self.entries_dir / (key + ENTRY_SUFFIX)

    # -- lookup -------------------------------------------------------------------------

    def deepest(self, hashes: list[bytes]) -> int:
        """The index of the deepest of these chain hashes that some entry holds, or -1."""
        if not hashes:
            return -1
        db, best = self._db(), -1
        for start in range(0, len(hashes), 900):  # SQLite's bound on parameters
            part = hashes[start:start + 900]
            row = db.execute(f"SELECT MAX(idx) FROM blocks WHERE hash IN ({','.join('?' * len(part))})",
                             part).fetchone()
            if row[0] is not None:
                best = max(best, row[0])
        return best

    def holders(self, block_hash: bytes) -> list[tuple[str, int, int, bytes]]:
        """(key, num_tokens, num_blocks, tail) of the entries holding this block."""
        return self._db().execute(
            "SELECT e.key, e.num_tokens, e.num_blocks, e.tail FROM blocks b JOIN entries e ON e.key = b.key "
            "WHERE b.hash = ? ORDER BY e.last_used DESC", (block_hash,)).fetchall()

    # -- changes (the writer thread, and clear) -----------------------------------------

    def add(self, key: str, model: str, model_name: str, num_tokens: int, hashes: list[bytes],
            tail: bytes, size: int, now: float) -> None:
        db = self._db()
        with _transaction(db):
            db.execute("DELETE FROM blocks WHERE key = ?", (key,))
            db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (key, model, model_name, num_tokens, len(hashes), tail, size, now, now))
            db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?)",
                           [(h, key, i) for i, h in enumerate(hashes)])

    def touch(self, key: str, now: float) -> None:
        self._db().execute("UPDATE entries SET last_used = ? WHERE key = ?", (now, key))

    def remove(self, key: str) -> bool:
        """Unindex an entry, then delete its file; True if it was indexed."""
        db = self._db()
        with _transaction(db):
            n = db.execute("DELETE FROM entries WHERE key = ?", (key,)).rowcount
            db.execute("DELETE FROM blocks WHERE key = ?", (key,))
        self.file(key).unlink(missing_ok=True)
        return n > 0

    def subsumed_by(self, hashes: list[bytes], tokens: bytes, block_size: int, key: str) -> list[str]:
        """Entries whose tokens are all a prefix of ``tokens`` (int32 bytes), so redundant."""
        if not hashes:
            return []
        out = []
        db = self._db()
        for start in range(0, len(hashes), 900):
            part = hashes[start:start + 900]
            rows = db.execute(
                "SELECT e.key, e.num_tokens, e.num_blocks, e.tail FROM blocks b JOIN entries e ON e.key = b.key "
                f"WHERE b.hash IN ({','.join('?' * len(part))}) AND b.idx = e.num_blocks - 1", part).fetchall()
            for other, n, nb, tail in rows:
                at = 4 * nb * block_size
                if other != key and 4 * n <= len(tokens) and tokens[at:at + len(tail)] == tail:
                    out.append(other)
        return out

    def total_size(self) -> int:
        return self._db().execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0]

    def evict_to(self, budget: int) -> list[str]:
        """Remove least recently used entries until the total fits ``budget``."""
        removed, total = [], self.total_size()
        while total > budget:
            row = self._db().execute("SELECT key, size FROM entries ORDER BY last_used, created LIMIT 1").fetchone()
            if row is None:
                break
            self.remove(row[0])
            removed.append(row[0])
            total -= row[1]
        return removed

    def entries(self) -> list[EntryInfo]:
        rows = self._db().execute(
            "SELECT key, model, model_name, num_tokens, size, created, last_used FROM entries "
            "ORDER BY last_used DESC").fetchall()
        return [EntryInfo(*r) for r in rows]

    def clear(self) -> tuple[int, int]:
        """Remove every entry; (entries removed, bytes freed)."""
        entries = self.entries()
        db = self._db()
        with _transaction(db):
            db.execute("DELETE FROM entries")
            db.execute("DELETE FROM blocks")
        for e in entries:
            self.file(e.key).unlink(missing_ok=True)
        self.sweep(max_age_s=0.0)
        return len(entries), sum(e.size for e in entries)

    def sweep(self, max_age_s: float = _STALE_S) -> int:
        """Delete temporary and unindexed files older than ``max_age_s`` (left by a crash);
        younger ones may belong to another process writing now. Returns how many."""
        try:
            names = list(os.scandir(self.entries_dir))
        except FileNotFoundError:
            return 0
        indexed = {k for (k,) in self._db().execute("SELECT key FROM entries")}
        now, removed = time.time(), 0
        for item in names:
            stale = item.name.startswith(_TMP_PREFIX) or (
                item.name.endswith(ENTRY_SUFFIX) and item.name[:-len(ENTRY_SUFFIX)] not in indexed)
            try:
                if stale and now - item.stat().st_mtime >= max_age_s:
                    os.unlink(item.path)
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None


class _transaction:
    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb):
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        return False


@dataclass
class _Write:
    key: str
    token_ids: list[int]
    hashes: list[bytes]
    payload: object  # a buffer; owned by the write from here on
    size: int


class PrefixStore:
    """One model's view of a store directory: find, read and (in the background) save entries.

    ``find`` and ``read`` run on the engine's thread; ``save`` only queues, and the writer
    thread writes, indexes and evicts down to ``budget_bytes``. A failed write (a full disk, a
    read-only directory) gives one warning line and the store goes on; so does a bad entry,
    which is dropped.
    """

    def __init__(self, directory: Path, fingerprint: bytes, block_size: int,
                 budget_bytes: int = DEFAULT_BUDGET, min_tokens: int = DEFAULT_MIN_TOKENS,
                 model_name: str = ""):
        self.index = PrefixIndex(directory)
        self.model = model_digest(fingerprint)
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.min_tokens = max(min_tokens, block_size)
        self.model_name = model_name
        self.num_writes = self.num_write_errors = self.num_hits = self.num_bad = 0
        self.bytes_written = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[str, int] = {}  # key -> bytes, queued and not yet written
        self._pending_lock = threading.Lock()
        self._write_failing = False
        self._warned: set[str] = set()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._writer, name="localllm-prefix-writer", daemon=True)
        self._thread.start()
        self._queue.put(("sweep",))

    # -- the engine's side --------------------------------------------------------------

    def find(self, token_ids: list[int], hashes: list[bytes], limit: int) -> Found | None:
        """The entry giving the most of ``token_ids[:limit]``; ``hashes`` are the chain hashes
        of token_ids' full blocks. None when nothing is stored for them."""
        try:
            return self._find(token_ids, hashes, limit)
        except (sqlite3.Error, OSError) as e:
            self._warn_once(f"the prefix-cache index {self.index.path} cannot be read ({e}); prompts are "
                            "computed in full (`localllm cache clear` starts it afresh)")
            return None

    def _find(self, token_ids: list[int], hashes: list[bytes], limit: int) -> Found | None:
        deepest = self.index.deepest(hashes[:-(-limit // self.block_size)])
        if deepest < 0:
            return None
        bs = self.block_size
        base = (deepest + 1) * bs
        best: Found | None = None
        for key, num_tokens, num_blocks, tail in self.index.holders(hashes[deepest]):
            n = base
            if num_blocks == deepest + 1 and tail:
                mine = _tokens_bytes(token_ids[base:base + len(tail) // 4])
                k = 0
                while k < len(mine) and mine[k:k + 4] == tail[k:k + 4]:
                    k += 4
                n += k // 4
            n = min(n, limit, num_tokens)
            if best is None or n > best.num_tokens:
                best = Found(key, n)
        return best

    def read(self, found: Found, token_ids: list[int]) -> memoryview | None:
        """The checked KV payload of a found entry, or None (a bad entry is dropped with one
        warning line; the caller computes the prompt instead)."""
        path = self.index.file(found.key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data = bytearray(size)
                if f.readinto(data) != size:
                    raise BadEntry("truncated while being read")
            stored, payload = decode_entry(data, self.model)
            if stored[:found.num_tokens] != list(token_ids[:found.num_tokens]):
                raise BadEntry("its token ids do not match its index entry")
        except FileNotFoundError:
            self._drop(found.key, None)  # removed behind our back (cache clear): not damage
            return None
        except (BadEntry, OSError) as e:
            self._drop(found.key, f"dropped prefix-cache entry {path.name}: {e}; the prompt is computed in full")
            return None
        self.num_hits += 1
        self._queue.put(("touch", found.key, time.time()))
        return payload

    def reject(self, found: Found, reason: str) -> None:
        """Drop an entry whose checked bytes the runner would not take."""
        self._drop(found.key, f"dropped prefix-cache entry {found.key}{ENTRY_SUFFIX}: {reason}; "
                              "the prompt is computed in full")

    def covered(self, token_ids: list[int], hashes: list[bytes]) -> int:
        """How many of these tokens a stored or queued entry already gives."""
        with self._pending_lock:
            if entry_key(self.model, token_ids) in self._pending:
                return len(token_ids)
        found = self.find(token_ids, hashes, len(token_ids))
        return found.num_tokens if found is not None else 0

    def wants(self, token_ids: list[int], hashes: list[bytes]) -> bool:
        """Whether a prompt is worth storing: long enough, and at least ``min_tokens`` of it
        not on disk already (so requests that share a long system prompt and differ in their
        last lines write it once)."""
        if len(token_ids) < self.min_tokens:
            return False
        return len(token_ids) - self.covered(token_ids, hashes) >= self.min_tokens

    def save(self, token_ids: list[int], hashes: list[bytes], payload) -> bool:
        """Queue an entry for ``token_ids`` whose KV bytes are ``payload`` (a buffer the store
        keeps). False when it is skipped: bigger than the budget, or too much is queued."""
        size = memoryview(payload).nbytes
        key = entry_key(self.model, token_ids)
        total = HEADER_SIZE + 4 * len(token_ids) + size
        if total > self.budget_bytes:
            return False
        with self._pending_lock:
            if key in self._pending or sum(self._pending.values()) + total > MAX_PENDING_BYTES:
                return False
            self._pending[key] = total
            self._idle.clear()
        self._queue.put(("write", _Write(key, list(token_ids), list(hashes), payload, total)))
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False if ``timeout`` passed first."""
        self._queue.put(("noop",))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._pending_lock:
                if not self._pending:
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._idle.wait(0.05)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued writes (up to ``timeout``), then stop the writer."""
        self.flush(timeout)
        self._queue.put(("stop",))
        self._thread.join(timeout=5.0)
        self.index.close()

    # -- the writer thread --------------------------------------------------------------

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            kind = item[0]
            try:
                if kind == "stop":
                    self.index.close()
                    return
                if kind == "write":
                    self._write(item[1])
                elif kind == "touch":
                    self.index.touch(item[1], item[2])
                elif kind == "drop":
                    self.index.remove(item[1])
                elif kind == "sweep":
                    # Leftovers of a crash: temporary files, files not indexed, and an index
                    # over the budget (a kill between indexing a write and evicting for it).
                    self.index.sweep()
                    self.index.evict_to(self.budget_bytes)
            except (sqlite3.Error, OSError) as e:
                self._warn_once(f"the prefix cache could not update its index ({e})")
            finally:
                if kind == "write":
                    with self._pending_lock:
                        self._pending.pop(item[1].key, None)
                        if not self._pending:
                            self._idle.set()

    def _write(self, w: _Write) -> None:
        index = self.index
        path = index.file(w.key)
        tmp = path.with_name(f"{_TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{w.key}")
        header = encode_header(self.model, w.token_ids, w.payload)
        try:
            index.entries_dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(w.payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(index.entries_dir)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.num_write_errors += 1
            if not self._write_failing:
                self._write_failing = True
                log.warning("the prefix cache could not write an entry to %s (%s); serving goes on "
                            "without storing prompts until a write succeeds", index.entries_dir, e.strerror or e)
            return
        w.payload = None
        bs = self.block_size
        num_blocks = len(w.hashes)
        tail = _tokens_bytes(w.token_ids[num_blocks * bs:])
        now = time.time()
        index.add(w.key, self.model.hex(), self.model_name, len(w.token_ids), w.hashes, tail, w.size, now)
        self._write_failing = False
        self.num_writes += 1
        self.bytes_written += w.size
        tokens = _tokens_bytes(w.token_ids)
        for other in index.subsumed_by(w.hashes, tokens, bs, w.key):
            index.remove(other)
        index.evict_to(self.budget_bytes)

    # -- helpers ------------------------------------------------------------------------

    def _drop(self, key: str, message: str | None) -> None:
        if message is not None:
            self.num_bad += 1
            log.warning("%s", message)
        try:
            self.index.remove(key)
        except (sqlite3.Error, OSError):
            self._queue.put(("drop", key))

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("%s", message)


def parse_size(text: str) -> int:
    """Bytes from a size: '2GiB', '512MiB' (powers of 1024), '2G', '500MB', '1.5G' (powers of
    1000, as `localllm ls` prints sizes), '0'. Raises ValueError naming the form it wants."""
    s = text.strip().replace(" ", "")
    number = s.rstrip("KMGTBikmgtb")
    unit = s[len(number):].lower()
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
             "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not 0 <= value < float("inf"):
        raise ValueError(f"{text!r} is not a size; give a number with a unit, like 2GiB, 500MB or 0")
    return int(value * units[unit])
