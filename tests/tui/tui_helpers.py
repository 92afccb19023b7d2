"""Helpers for the chat app's tests: waiting on the pilot, sending a turn, a saved chat."""

from __future__ import annotations

import time

from localllm.tui.conversations import ConversationStore, Message

SIZE = (120, 36)
LOAD_TIMEOUT_S = 60
ANSWER_TIMEOUT_S = 90
LONG_PROMPT = "Write a 3000 word essay about the history of computing, with many sections."


async def wait_for(pilot, condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await pilot.pause(0.05)


async def wait_ready(pilot) -> None:
    """The model is loaded and no worker (load, warm, answer) is running."""
    app = pilot.app
    await wait_for(pilot, lambda: app.backend is not None and app.status.state == "ready"
                   and not app.is_answering, LOAD_TIMEOUT_S, "the model to load")
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


async def send(pilot, text: str) -> None:
    """Type ``text`` into the box, press Enter and wait for the whole answer."""
    from localllm.tui.widgets.message_view import MessageView

    app = pilot.app
    before = len(app.query(MessageView))
    app.prompt.load_text(text)
    await pilot.press("enter")
    await wait_for(pilot, lambda: not app.is_answering and len(app.query(MessageView)) >= before + 2,
                   ANSWER_TIMEOUT_S, "the answer")
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def saved_conversation(store: ConversationStore, turns: list[tuple[str, str]], title: str = "Saved chat",
                       system: str = "", model: str = "") -> str:
    """A conversation in the store, as an earlier run would have left it; returns its id."""
    conv = store.create(model=model, system=system, title=title)
    for user, answer in turns:
        store.add_message(conv.id, Message("user", user))
        store.add_message(conv.id, Message("assistant", answer, stats={
            "ttft": 0.125, "tokens_per_s": 60.5, "tokens": 12, "prompt_tokens": 40,
            "cached_tokens": 32, "finish_reason": "stop"}))
    return conv.id


async def stop_a_long_answer(pilot) -> None:
    """Ask for a long answer, press Esc once some of it has streamed, wait for the stop."""
    from localllm.tui.widgets.message_view import MessageView

    app = pilot.app
    app.prompt.load_text(LONG_PROMPT)
    await pilot.press("enter")
    await wait_for(pilot, lambda: len(app.query(MessageView).last().content) > 40, 60, "some answer text")
    await pilot.press("escape")
    await wait_for(pilot, lambda: not app.is_answering, 10, "the answer to stop")
