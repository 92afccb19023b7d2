"""The chat app over `--endpoint`: the same screen on a real `localllm serve` process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tui"))
from tui_helpers import SIZE, send, stop_a_long_answer, wait_for, wait_ready  # noqa: E402

from localllm.tui.app import ChatApp  # noqa: E402
from localllm.tui.backend import GenerationSettings, RemoteBackend  # noqa: E402
from localllm.tui.conversations import ConversationStore  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path / "conversations.db")
    yield s
    s.close()


def make_app(live_server, store, api_key: str | None = "sk-test", max_tokens: int = 24) -> ChatApp:
    return ChatApp(lambda model: RemoteBackend(live_server.base_url, model or None, api_key), "", store,
                   settings=GenerationSettings(temperature=0, max_tokens=max_tokens))


async def test_a_turn_over_the_endpoint(live_server, store):
    app = make_app(live_server, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        assert app.backend.model_name == live_server.model_path.stem
        await send(pilot, "Reply with the word hello.")
        answer = store.get(app.conversation.id).messages[-1]
        assert answer.role == "assistant" and answer.content and answer.stats["finish_reason"] in ("stop", "length")
        assert answer.stats["prompt_tokens"] > 0 and answer.stats["cached_tokens"] is not None
        status = app.status.render_text()
        assert status.startswith(live_server.model_path.stem[:31]) and "· ready" in status and "KV -" in status


async def test_escape_stops_a_remote_answer(live_server, store):
    app = make_app(live_server, store, max_tokens=1500)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await stop_a_long_answer(pilot)
        answer = store.get(app.conversation.id).messages[-1]
        assert answer.stopped and answer.stats["finish_reason"] == "abort"


async def test_a_wrong_key_is_an_inline_error(live_server, store):
    app = make_app(live_server, store, api_key="wrong")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.query("MessageView.error"), 30, "the error")
        assert "--api-key" in app.query_one("MessageView.error").content
        assert app.backend is None and "no model" in app.status.render_text()
