"""Write the chat app's screenshots for the docs: docs/chat-main.svg and docs/chat-conversations.svg.

    .venv/bin/python scripts/screenshots.py            # uses the Qwen test model

A real answer from the real model at temperature 0, in a scratch conversation store; the
figures in the status bar are the ones this machine measured.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "tui"))

import test_models  # noqa: E402
from tui_helpers import saved_conversation, send, wait_ready  # noqa: E402

from localllm.config import CacheConfig, EngineConfig  # noqa: E402
from localllm.tui.app import ChatApp  # noqa: E402
from localllm.tui.backend import GenerationSettings, LocalBackend  # noqa: E402
from localllm.tui.conversations import ConversationStore  # noqa: E402

SIZE = (132, 50)
PROMPT = "Write a Python function that checks whether a number is prime."
FOLLOW_UP = "Now add type hints and a one-line docstring."


async def main() -> None:
    model = test_models.default_dest() / test_models.MODELS["qwen2.5-coder-0.5b"]["file"]
    config = EngineConfig(model_path=model, cache=CacheConfig(n_ctx=4096))
    with tempfile.TemporaryDirectory() as tmp:
        store = ConversationStore(Path(tmp) / "conversations.db")
        saved_conversation(store, [("How do I read a CSV file with pandas?", "Use `pd.read_csv(path)`.")],
                           title="Reading CSV with pandas")
        saved_conversation(store, [("Explain Rust lifetimes", "They name how long references live.")],
                           title="Rust lifetimes")
        saved_conversation(store, [("What does git rebase do?", "It replays commits onto a new base.")],
                           title="git rebase vs merge")
        app = ChatApp(lambda m: LocalBackend(dataclasses.replace(config, model_path=Path(m))), str(model),
                      store, settings=GenerationSettings(temperature=0, max_tokens=400))
        async with app.run_test(size=SIZE) as pilot:
            for widget in app.query("TextArea, Input"):
                widget.cursor_blink = False
            await wait_ready(pilot)
            await send(pilot, PROMPT)
            await send(pilot, FOLLOW_UP)  # the second turn starts from the first one's cached KV
            await app._poll_engine()
            await pilot.pause()
            app.save_screenshot("chat-main.svg", str(ROOT / "docs"))
            options = app.query_one("#conversations")
            options.focus()
            options.highlighted = 1
            await pilot.pause()
            app.save_screenshot("chat-conversations.svg", str(ROOT / "docs"))
        store.close()
    print("wrote docs/chat-main.svg and docs/chat-conversations.svg")


if __name__ == "__main__":
    asyncio.run(main())
