"""Snapshots of the main screen, the conversation panel and the help screen (SVG, compared
character by character by pytest-textual-snapshot; update with --snapshot-update)."""

from __future__ import annotations

import pytest

from tui_helpers import SIZE, saved_conversation, wait_ready

pytestmark = pytest.mark.model

# A fixed count, so the status bar's "2 threads" is the same on every machine and under any load.
THREADS = 2
RUNNER = "llamacpp"  # named, not auto: the status bar names it, the same on every CPU

ANSWER = """Use a list comprehension:

```python
def squares(n: int) -> list[int]:
    return [i * i for i in range(n)]
```

`squares(4)` gives `[0, 1, 4, 9]`."""


def _chats(store) -> str:
    saved_conversation(store, [("What is a closure in JavaScript?", "A function with its scope.")],
                       title="Closures in JavaScript")
    saved_conversation(store, [("Explain Rust lifetimes", "They name how long references live.")],
                       title="Rust lifetimes")
    return saved_conversation(store, [("Write a Python function that returns the first n squares.", ANSWER)],
                              title="First n squares")


def _no_blink(app) -> None:
    for widget in app.query("TextArea, Input"):  # a blinking cursor differs from shot to shot
        widget.cursor_blink = False


async def _settled(pilot) -> None:
    _no_blink(pilot.app)
    await wait_ready(pilot)
    pilot.app.clear_notifications()  # the KV-cache toast of loading comes and goes with time
    await pilot.app._poll_engine()  # the engine's figures now, not whenever the timer last ran
    await pilot.pause()


def test_main_screen(snap_compare, make_app, store):
    conv_id = _chats(store)
    app = make_app(conversation=store.get(conv_id), n_threads=THREADS, runner=RUNNER)
    assert snap_compare(app, terminal_size=SIZE, run_before=_settled)


def test_conversation_panel_searching(snap_compare, make_app, store):
    _chats(store)
    app = make_app(n_threads=THREADS, runner=RUNNER)

    async def search(pilot) -> None:
        await _settled(pilot)
        await pilot.press("ctrl+f", *"rust")
        _no_blink(pilot.app)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=search)


def test_help_screen(snap_compare, make_app, store):
    app = make_app(n_threads=THREADS, runner=RUNNER)

    async def help_screen(pilot) -> None:
        await _settled(pilot)
        await pilot.press("f1")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=help_screen)
