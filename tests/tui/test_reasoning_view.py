"""A thinking model's reasoning in the chat app: dimmed, folded under "Thinking" above the
answer, never in the answer's text (what is saved and copied). Below the model line: a backend
that streams scripted chunks as LocalBackend and RemoteBackend give them (their splitting is
tested at the doors, test_reasoning_doors)."""

from __future__ import annotations

from textual.widgets import Collapsible, Static

from localllm.tui.app import ChatApp
from localllm.tui.backend import Chunk, GenerationSettings, _parse_event
from localllm.tui.widgets.message_view import MessageView
from tui_helpers import SIZE, send, wait_ready

REASONING, ANSWER = "The user greets me. ", "Hi there!"


class ThinkingBackend:
    model_name, n_ctx, pool_summary, shares_cpu = "thinker", 4096, None, False

    def load(self) -> None:
        pass

    def count_tokens(self, messages):
        return None

    async def stream(self, messages, settings):
        for reasoning in ("The user ", "greets me. "):
            yield Chunk(reasoning=reasoning, num_tokens=2)
        yield Chunk(text="Hi ", num_tokens=1)
        yield Chunk(text="there!", num_tokens=1, finished=True, finish_reason="stop")

    def stop(self) -> None:
        pass

    async def warm(self, messages) -> None:
        pass

    async def engine_figures(self):
        return None

    def close(self) -> None:
        pass


async def test_reasoning_is_folded_apart_from_the_answer(store):
    app = ChatApp(lambda model: ThinkingBackend(), "thinker", store, settings=GenerationSettings(max_tokens=16))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "Hello")
        answer = app.query(MessageView).last()
        assert answer.content == ANSWER and answer.reasoning == REASONING
        fold = answer.query_one(".reasoning-fold", Collapsible)
        assert fold.collapsed and fold.title == "Thinking"
        assert str(fold.query_one(".reasoning", Static).render()) == REASONING
        saved = store.get(app.conversation.id)
        assert [m.content for m in saved.messages] == ["Hello", ANSWER]


def test_a_remote_stream_gives_reasoning_apart():
    llama_server = _parse_event('data: {"choices": [{"delta": {"reasoning_content": "hm"}, "index": 0}]}')
    vllm = _parse_event('data: {"choices": [{"delta": {"reasoning": "hm", "content": null}, "index": 0}]}')
    assert (llama_server.reasoning, llama_server.text) == (vllm.reasoning, vllm.text) == ("hm", "")
