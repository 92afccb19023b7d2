"""The responses `localllm serve` keeps for OpenAI's Responses API: each stored response's JSON
and the conversation it ended (the chat as the template takes it, its answer last), so that a
later request continues it by `previous_response_id`, after a restart too, and
`GET`/`DELETE /v1/responses/{id}` find it.

SQLite in the data folder, opened on first use: every write is one transaction (WAL,
synchronous=FULL), so a crash leaves a response whole or absent. The newest ``max_responses``
are kept; older ones are dropped as new ones come. JSON text, never pickle.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from localllm.errors import UsageError

MAX_RESPONSES = 1000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    response TEXT NOT NULL,      -- the response object as served (JSON)
    conversation TEXT NOT NULL   -- the chat it ended, as template messages (JSON list)
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created);
"""


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    conversation: list[dict]


class ResponseStore:
    def __init__(self, path: Path, max_responses: int = MAX_RESPONSES):
        self.path, self.max_responses = Path(path), max_responses
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = None
            try:
                db = sqlite3.connect(self.path, timeout=10, isolation_level=None, check_same_thread=False)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=FULL")
                db.executescript(_SCHEMA)
            except sqlite3.DatabaseError as e:
                if db is not None:
                    db.close()
                raise UsageError(f"the response store {self.path} cannot be opened ({e}); move it aside "
                                 "and start again") from None
            self._db = db
        return self._db

    def put(self, response_id: str, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            db = self._conn()
            with db:  # one transaction: the row and the trimming
                db.execute("BEGIN IMMEDIATE")
                db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                           (response_id, time.time(), json.dumps(response, ensure_ascii=False),
                            json.dumps(conversation, ensure_ascii=False)))
                db.execute("DELETE FROM responses WHERE id NOT IN "
                           "(SELECT id FROM responses ORDER BY created DESC LIMIT ?)", (self.max_responses,))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._conn().execute("SELECT response, conversation FROM responses WHERE id = ?",
                                       (response_id,)).fetchone()
        if row is None:
            return None
        try:
            response, conversation = json.loads(row[0]), json.loads(row[1])
        except ValueError:  # a damaged row is no response
            return None
        if not isinstance(response, dict) or not isinstance(conversation, list):
            return None
        return StoredResponse(response, conversation)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._conn().execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
