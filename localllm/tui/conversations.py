"""The chat app's saved conversations: one SQLite file, one transaction per change, so a
crash leaves each conversation as it was before or after a change, never in between."""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from localllm.errors import UsageError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    model TEXT NOT NULL DEFAULT '',
    system TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    stopped INTEGER NOT NULL DEFAULT 0,   -- the person stopped this answer
    excluded INTEGER NOT NULL DEFAULT 0,  -- dropped from the context (kept for reading)
    stats TEXT NOT NULL DEFAULT '{}',     -- JSON: the answer's figures
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""

TITLE_CHARS = 48


@dataclass
class Message:
    role: str  # "user" | "assistant"
    content: str
    stopped: bool = False
    excluded: bool = False
    stats: dict = field(default_factory=dict)
    id: int | None = None


@dataclass
class Conversation:
    id: str
    title: str
    model: str = ""
    system: str = ""
    created: float = 0.0
    updated: float = 0.0
    messages: list[Message] = field(default_factory=list)

    def context_messages(self) -> list[dict]:
        """The chat-template messages the model sees: system, then the turns not dropped."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        out += [{"role": m.role, "content": m.content} for m in self.messages if not m.excluded]
        return out

    def oldest_turn(self) -> list[Message]:
        """The oldest messages still in the context that make one turn: a message and the
        answers up to the next user message. Empty when nothing is left to drop."""
        kept = [m for m in self.messages if not m.excluded]
        turn = kept[:1]
        for m in kept[1:]:
            if m.role == "user":
                break
            turn.append(m)
        return turn


def title_for(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


class ConversationStore:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = None
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA foreign_keys=ON")
            db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as e:
            if db is not None:
                db.close()
            raise UsageError(f"the conversation store {self.path} cannot be opened ({e}); "
                             "move it aside and start again") from None
        self._db = db
        # SQLite's LIKE and lower() fold ASCII only; search folds case the way Python does.
        self._db.create_function("casefold", 1, lambda text: text.casefold(), deterministic=True)

    def close(self) -> None:
        self._db.close()

    # -- conversations --------------------------------------------------------------------

    def create(self, model: str = "", system: str = "", title: str = "New chat") -> Conversation:
        now = time.time()
        conv = Conversation(uuid.uuid4().hex[:12], title, model, system, now, now)
        self._db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?, ?, ?)",
                         (conv.id, conv.title, conv.model, conv.system, now, now))
        return conv

    def get(self, conversation_id: str) -> Conversation | None:
        row = self._db.execute("SELECT id, title, model, system, created, updated FROM conversations "
                               "WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            return None
        conv = Conversation(*row)
        conv.messages = [
            Message(role, content, bool(stopped), bool(excluded), json.loads(stats), mid)
            for mid, role, content, stopped, excluded, stats in self._db.execute(
                "SELECT id, role, content, stopped, excluded, stats FROM messages "
                "WHERE conversation_id = ? ORDER BY id", (conversation_id,))
        ]
        return conv

    def latest(self) -> Conversation | None:
        row = self._db.execute("SELECT id FROM conversations ORDER BY updated DESC LIMIT 1").fetchone()
        return self.get(row[0]) if row else None

    def list(self, search: str = "") -> list[Conversation]:
        """Conversations, most recently used first; with ``search``, those whose title or any
        message contains it (case-insensitive, taken literally)."""
        columns = "c.id, c.title, c.model, c.system, c.created, c.updated"
        if not search:
            rows = self._db.execute(f"SELECT {columns} FROM conversations c ORDER BY c.updated DESC")
        else:
            rows = self._db.execute(
                f"SELECT {columns} FROM conversations c WHERE instr(casefold(c.title), ?1) OR EXISTS "
                "(SELECT 1 FROM messages m WHERE m.conversation_id = c.id AND instr(casefold(m.content), ?1)) "
                "ORDER BY c.updated DESC", (search.casefold(),))
        return [Conversation(*row) for row in rows]

    def recent_inputs(self, limit: int = 200) -> list[str]:
        """What the person typed lately, oldest first: the message box's history."""
        rows = self._db.execute("SELECT content FROM messages WHERE role = 'user' ORDER BY id DESC LIMIT ?",
                                (limit,)).fetchall()
        return [r[0] for r in reversed(rows)]

    def rename(self, conversation_id: str, title: str) -> None:
        title = " ".join(title.split())
        if not title:
            raise UsageError("a conversation's title cannot be empty; type a few words")
        self._touch(conversation_id, title=title)

    def set_system(self, conversation_id: str, system: str) -> None:
        self._touch(conversation_id, system=system)

    def set_model(self, conversation_id: str, model: str) -> None:
        self._touch(conversation_id, model=model)

    def delete(self, conversation_id: str) -> None:
        self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # -- messages -------------------------------------------------------------------------

    def add_message(self, conversation_id: str, message: Message) -> Message:
        now = time.time()
        with self._db:  # one transaction: the message and the conversation's new time together
            self._db.execute("BEGIN")
            cur = self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
            if cur.rowcount == 0:  # raising here rolls the transaction back
                raise _no_conversation(conversation_id)
            cur = self._db.execute(
                "INSERT INTO messages (conversation_id, role, content, stopped, excluded, stats, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, message.role, message.content, int(message.stopped),
                 int(message.excluded), json.dumps(message.stats), now))
            message.id = cur.lastrowid
        return message

    def exclude(self, message_ids: list[int]) -> None:
        """Drop these messages from the context; they stay in the conversation to read. One
        transaction: a crash never leaves half a turn dropped (an answer without its question)."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany("UPDATE messages SET excluded = 1 WHERE id = ?", [(i,) for i in message_ids])

    def _touch(self, conversation_id: str, **columns: str) -> None:
        sets = ", ".join(f"{name} = ?" for name in columns)
        cur = self._db.execute(f"UPDATE conversations SET {sets}, updated = ? WHERE id = ?",
                               (*columns.values(), time.time(), conversation_id))
        if cur.rowcount == 0:
            raise _no_conversation(conversation_id)


def _no_conversation(conversation_id: str) -> UsageError:
    return UsageError(f"no conversation {conversation_id!r}; it may have been deleted")
