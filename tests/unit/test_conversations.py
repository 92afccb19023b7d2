"""ConversationStore on a real SQLite file in tmp_path, with a fake clock so that every
`created` / `updated` value, and so every ordering, is exact."""

from __future__ import annotations

import sqlite3

import pytest

from localllm.errors import UsageError
from localllm.tui import conversations
from localllm.tui.conversations import TITLE_CHARS, Conversation, ConversationStore, Message, title_for


class Clock:
    """time.time() as 1000.0, 1001.0, 1002.0, ...: each call one second later."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def time(self) -> float:
        t = self.now
        self.now += 1.0
        return t


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(conversations, "time", clock)
    return clock


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "sub" / "chats.sqlite"


@pytest.fixture
def store(db_path, clock):
    store = ConversationStore(db_path)
    yield store
    store.close()


def ids(convs: list[Conversation]) -> list[str]:
    return [c.id for c in convs]


def rows(path, sql: str, *args) -> list[tuple]:
    with sqlite3.connect(path) as db:
        return db.execute(sql, args).fetchall()


# -- conversations -------------------------------------------------------------------------


def test_create_and_get(store, db_path):
    conv = store.create(model="qwen.gguf", system="Be brief.", title="Hello")
    assert len(conv.id) == 12 and int(conv.id, 16) >= 0
    assert (conv.title, conv.model, conv.system, conv.created, conv.updated) == (
        "Hello", "qwen.gguf", "Be brief.", 1000.0, 1000.0)
    assert store.get(conv.id) == conv
    assert db_path.exists()  # the parent folder was made
    assert store.get("nope") is None


def test_new_conversation_defaults(store):
    conv = store.create()
    assert (conv.title, conv.model, conv.system, conv.messages) == ("New chat", "", "", [])


def test_ids_are_distinct(store):
    assert len({store.create().id for _ in range(50)}) == 50


def test_list_and_latest_order_by_last_use(store):
    assert store.list() == [] and store.latest() is None
    a, b, c = store.create(title="a"), store.create(title="b"), store.create(title="c")  # t=1000, 1001, 1002
    assert ids(store.list()) == [c.id, b.id, a.id]
    assert store.latest().id == c.id

    store.add_message(a.id, Message("user", "hi"))  # a used at 1003
    assert ids(store.list()) == [a.id, c.id, b.id]
    assert store.get(a.id).updated == 1003.0
    store.rename(b.id, "bee")  # b at 1004
    assert ids(store.list()) == [b.id, a.id, c.id]
    store.set_system(c.id, "sys")  # c at 1005
    assert ids(store.list()) == [c.id, b.id, a.id]
    store.set_model(a.id, "m.gguf")  # a at 1006
    assert ids(store.list()) == [a.id, c.id, b.id]
    assert store.latest().id == a.id
    listed = store.list()[0]
    assert (listed.title, listed.model, listed.system, listed.created, listed.updated) == (
        "a", "m.gguf", "", 1000.0, 1006.0)
    assert listed.messages == []  # list() gives the conversations only


def test_rename_collapses_whitespace(store):
    conv = store.create()
    store.rename(conv.id, "  Plans \t for\n\n  Paris  ")
    assert store.get(conv.id).title == "Plans for Paris"


@pytest.mark.parametrize("title", ["", "   ", "\t\n "])
def test_rename_rejects_an_empty_title(store, title):
    conv = store.create(title="Kept")
    with pytest.raises(UsageError, match="title cannot be empty"):
        store.rename(conv.id, title)
    assert store.get(conv.id).title == "Kept"
    assert store.get(conv.id).updated == conv.updated


def test_changing_a_deleted_conversation_raises(store):
    conv = store.create()
    store.delete(conv.id)
    for change in (lambda: store.rename(conv.id, "x"), lambda: store.set_system(conv.id, "x"),
                   lambda: store.set_model(conv.id, "x")):
        with pytest.raises(UsageError, match=f"no conversation '{conv.id}'"):
            change()
    with pytest.raises(UsageError, match=f"no conversation '{conv.id}'"):
        store.add_message(conv.id, Message("user", "hello?"))
    assert store.get(conv.id) is None
    assert rows(store.path, "SELECT COUNT(*) FROM messages") == [(0,)]
    store.add_message(store.create().id, Message("user", "the store still works"))  # no transaction left open
    assert store.recent_inputs() == ["the store still works"]


def test_set_system_and_model(store):
    conv = store.create()
    store.set_system(conv.id, "You are terse.")
    store.set_model(conv.id, "gemma.gguf")
    got = store.get(conv.id)
    assert (got.system, got.model) == ("You are terse.", "gemma.gguf")


def test_delete_cascades_to_messages(store, db_path):
    keep, gone = store.create(), store.create()
    kept = store.add_message(keep.id, Message("user", "stay"))
    for text in ("one", "two", "three"):
        store.add_message(gone.id, Message("user", text))
    assert rows(db_path, "SELECT COUNT(*) FROM messages WHERE conversation_id = ?", gone.id) == [(3,)]
    store.delete(gone.id)
    assert store.get(gone.id) is None
    assert ids(store.list()) == [keep.id]
    assert rows(db_path, "SELECT COUNT(*) FROM messages WHERE conversation_id = ?", gone.id) == [(0,)]
    assert rows(db_path, "SELECT id, content FROM messages") == [(kept.id, "stay")]


# -- search --------------------------------------------------------------------------------


def test_search_finds_titles_and_messages_case_insensitively(store):
    by_title = store.create(title="Paris trip")
    by_message = store.create(title="Untitled")
    store.add_message(by_message.id, Message("user", "What is the capital of FRANCE?"))
    store.add_message(by_message.id, Message("assistant", "It is PARIS."))
    other = store.create(title="Rome")
    store.add_message(other.id, Message("user", "Pasta"))

    assert ids(store.list("paris")) == [by_message.id, by_title.id]
    assert ids(store.list("PaRiS TrIp")) == [by_title.id]
    assert ids(store.list("france")) == [by_message.id]
    assert ids(store.list("capital of f")) == [by_message.id]
    assert ids(store.list("Pasta")) == [other.id]
    assert store.list("london") == []
    assert ids(store.list("")) == [other.id, by_message.id, by_title.id]


def test_search_is_case_insensitive_beyond_ascii(store):
    conv = store.create(title="Été à Zürich")
    assert ids(store.list("été")) == [conv.id]
    assert ids(store.list("ZÜRICH")) == [conv.id]


@pytest.mark.parametrize("needle, expected", [
    ("%", ["percent"]),
    ("_", ["underscore"]),
    ("\\", ["backslash"]),
    ("50%", ["percent"]),
    ("a_b", ["underscore"]),
    ("a%b", []),
    ("x\\y", ["backslash"]),
])
def test_search_is_literal(store, needle, expected):
    made = {}
    for name, text in (("percent", "a 50% discount"), ("underscore", "call a_b()"),
                       ("backslash", "path x\\y"), ("plain", "axb and a b and 50 percent")):
        conv = made[name] = store.create(title=name)
        store.add_message(conv.id, Message("user", text))
    assert {c.title for c in store.list(needle)} == set(expected)
    assert ids(store.list(needle)) == [made[n].id for n in reversed(list(made)) if n in expected]


# -- messages ------------------------------------------------------------------------------


def test_messages_round_trip_in_order_with_stats(store):
    conv = store.create()
    stats = {"ttft": 0.25, "tokens_per_s": 54.5, "tokens": 12, "prompt_tokens": 30, "cached_tokens": 16,
             "finish_reason": "abort", "note": "ünïcode"}
    u = store.add_message(conv.id, Message("user", "Count to three."))
    a = store.add_message(conv.id, Message("assistant", "1, 2", stopped=True, stats=stats))
    assert isinstance(u.id, int) and a.id == u.id + 1
    got = store.get(conv.id)
    assert got.messages == [
        Message("user", "Count to three.", False, False, {}, u.id),
        Message("assistant", "1, 2", True, False, stats, a.id),
    ]
    assert got.messages[1].stats is not stats


def test_exclude_and_context_messages(store):
    conv = store.create(system="Answer in French.")
    m = [store.add_message(conv.id, Message(role, text)) for role, text in
         (("user", "hi"), ("assistant", "salut"), ("user", "bye"), ("assistant", "au revoir"))]
    before = store.get(conv.id).updated
    store.exclude([m[0].id, m[1].id])
    got = store.get(conv.id)
    assert [x.excluded for x in got.messages] == [True, True, False, False]
    assert [x.content for x in got.messages] == ["hi", "salut", "bye", "au revoir"]  # kept to read
    assert got.updated == before
    assert got.context_messages() == [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "au revoir"},
    ]
    store.exclude([])
    assert [x.excluded for x in store.get(conv.id).messages] == [True, True, False, False]


def test_context_messages_without_a_system_prompt():
    conv = Conversation("c", "t", messages=[Message("user", "a"), Message("assistant", "b", excluded=True),
                                            Message("user", "c")])
    assert conv.context_messages() == [{"role": "user", "content": "a"}, {"role": "user", "content": "c"}]


def test_recent_inputs(store):
    a, b = store.create(), store.create()
    store.add_message(a.id, Message("user", "first"))
    store.add_message(a.id, Message("assistant", "not typed"))
    store.add_message(b.id, Message("user", "second"))
    store.add_message(a.id, Message("user", "third"))
    store.add_message(b.id, Message("user", "fourth", excluded=True))
    assert store.recent_inputs() == ["first", "second", "third", "fourth"]
    assert store.recent_inputs(limit=2) == ["third", "fourth"]
    assert store.recent_inputs(limit=1) == ["fourth"]


def test_recent_inputs_of_an_empty_store(store):
    assert store.recent_inputs() == []


# -- the file ------------------------------------------------------------------------------


def test_a_reopened_store_sees_everything(db_path, clock):
    first = ConversationStore(db_path)
    conv = first.create(model="qwen.gguf", system="sys", title="Kept")
    m1 = first.add_message(conv.id, Message("user", "hello"))
    m2 = first.add_message(conv.id, Message("assistant", "hi", stopped=True, stats={"tokens": 2}))
    first.exclude([m1.id])
    gone = first.create(title="Gone")
    first.delete(gone.id)
    expected = first.get(conv.id)
    first.close()

    second = ConversationStore(db_path)
    try:
        assert second.get(conv.id) == expected
        assert expected.messages == [Message("user", "hello", False, True, {}, m1.id),
                                     Message("assistant", "hi", True, False, {"tokens": 2}, m2.id)]
        assert ids(second.list()) == [conv.id]
        assert second.get(gone.id) is None
        assert second.recent_inputs() == ["hello"]
        m3 = second.add_message(conv.id, Message("user", "again"))
        assert m3.id == m2.id + 1
    finally:
        second.close()


def test_a_file_that_is_not_sqlite_is_refused_by_name(tmp_path):
    path = tmp_path / "chats.sqlite"
    path.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(UsageError) as e:
        ConversationStore(path)
    assert str(path) in str(e.value)
    assert "move it aside" in str(e.value)
    assert path.read_bytes() == bytes(range(256)) * 64  # left as it was


def test_a_folder_in_the_store_s_place_is_refused_by_name(tmp_path):
    path = tmp_path / "chats.sqlite"
    path.mkdir()
    with pytest.raises(UsageError, match="cannot be opened") as e:
        ConversationStore(path)
    assert str(path) in str(e.value)


# -- titles --------------------------------------------------------------------------------


def test_title_for():
    assert title_for("  What is\n the   capital?  ") == "What is the capital?"
    exact = "x" * TITLE_CHARS
    assert title_for(exact) == exact
    long = "y" * (TITLE_CHARS + 1)
    assert title_for(long) == "y" * (TITLE_CHARS - 1) + "…"
    assert len(title_for(long)) == TITLE_CHARS
    assert title_for("") == ""


def test_oldest_turn_is_a_user_message_and_its_answers(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create(title="t")
    for role, text in [("user", "a"), ("assistant", "b"), ("assistant", "c"), ("user", "d"), ("assistant", "e")]:
        store.add_message(conv.id, Message(role, text))
    conv = store.get(conv.id)
    assert [m.content for m in conv.oldest_turn()] == ["a", "b", "c"]
    for m in conv.oldest_turn():
        m.excluded = True
    assert [m.content for m in conv.oldest_turn()] == ["d", "e"]
    for m in conv.oldest_turn():
        m.excluded = True
    assert conv.oldest_turn() == []
    store.close()
