"""Every key binding and screen of the chat app, driven by Textual's pilot on the real model."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest
from textual.command import CommandPalette
from textual.widgets import Input, Label, OptionList

from localllm.config import physical_cores
from localllm.tui.screens.choice import ChoiceScreen
from localllm.tui.screens.help import HelpScreen
from localllm.tui.screens.model_picker import ModelPickerScreen
from localllm.tui.screens.rename import RenameScreen
from localllm.tui.screens.settings import SettingsScreen
from localllm.tui.screens.system_prompt import SystemPromptScreen
from localllm.tui.widgets.conversation_list import ConversationList
from localllm.tui.widgets.message_view import MessageView, code_blocks
from tui_helpers import LONG_PROMPT, SIZE, saved_conversation, send, stop_a_long_answer, wait_for, wait_ready

pytestmark = pytest.mark.model

CODE_ANSWER = "Here it is:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nAnd a test:\n\n```python\nassert add(1, 2) == 3\n```\n"


def focus_first_chat(app) -> None:
    """Put the focus on the side panel's list, on its first (most recent) chat."""
    options = app.query_one(ConversationList).query_one(OptionList)
    options.focus()
    options.highlighted = 0


def views(app) -> list[tuple[str, str]]:
    return [(v.role, v.content) for v in app.query(MessageView)]


# -- sending, the message box -------------------------------------------------------------------

async def test_enter_sends_streams_and_saves(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "Reply with the word hello.")
        conv = store.get(app.conversation.id)
        assert [m.role for m in conv.messages] == ["user", "assistant"]
        assert conv.messages[0].content == "Reply with the word hello."
        answer = conv.messages[1]
        assert answer.content and not answer.stopped
        assert answer.stats["finish_reason"] == "stop"
        assert answer.stats["prompt_tokens"] == app.backend.count_tokens(
            [{"role": "user", "content": "Reply with the word hello."}])
        assert answer.stats["ttft"] > 0
        assert views(app) == [("user", "Reply with the word hello."), ("assistant", answer.content)]
        assert conv.title == "Reply with the word hello."
        assert app.prompt.text == ""
        status = app.status.render_text()
        assert "· ready" in status and "TTFT" in status and f"prompt {answer.stats['prompt_tokens']}" in status
        assert app.backend.runner in ("llamacpp", "torch")  # the runner that answers (auto chose it)
        # The threads decode runs on: chosen from the machine's load, up to its physical cores
        # (none on a GPU build of llama.cpp, where the GPU computes the steps).
        await app._poll_engine()
        engine = app.status.engine
        if llama_cpp.llama_supports_gpu_offload():
            assert (engine.threads, engine.threads_max) == (0, 0) and "thread" not in app.status.render_text()
        else:
            n, most = engine.threads, engine.threads_max
            assert most == physical_cores() and 1 <= n <= most
            count = f"{n}" if n == most else f"{n}/{most}"
            assert app.status.render_text().endswith(f" │ {count} thread{'s' if most > 1 else ''}")


async def test_ctrl_j_inserts_a_newline_and_enter_on_empty_box_sends_nothing(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("enter")
        assert not app.is_answering and app.conversation is None
        await pilot.press(*"one", "ctrl+j", *"two", "shift+enter", *"three", "alt+enter")
        assert app.prompt.text == "one\ntwo\nthree\n"
        assert store.list() == []


async def test_up_and_down_walk_the_input_history(make_app, store):
    saved_conversation(store, [("first question", "a"), ("second question", "b")])
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press(*"draft")
        await pilot.press("up")
        assert app.prompt.text == "second question"
        await pilot.press("up")
        assert app.prompt.text == "first question"
        await pilot.press("up")  # the oldest stays
        assert app.prompt.text == "first question"
        await pilot.press("down")
        assert app.prompt.text == "second question"
        await pilot.press("down")
        assert app.prompt.text == "draft"


async def test_loading_shows_the_kv_cache_it_got(make_app):
    app = make_app(n_ctx=2048)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        messages = [n.message for n in app._notifications]
        assert messages[0] == "KV cache: 2,048 tokens (24 MiB, f16): 1 conversation of 2k"
        # and which runner `--runner auto` took, and why
        reason = app.backend.runner_reason
        assert reason.startswith(f"the {app.backend.runner} runner" if app.backend.runner == "torch" else "llama.cpp")
        assert messages[1:] == [f"Runner: {reason}"]


async def test_sending_while_loading_keeps_the_text(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        app.backend = None  # as in the first moments, before the load worker finishes
        app.prompt.load_text("early")
        await pilot.press("enter")
        assert app.prompt.text == "early"
        assert app.conversation is None
        await wait_ready(pilot)


# -- stopping -----------------------------------------------------------------------------------

async def test_escape_stops_the_answer_and_frees_its_blocks(make_app, store):
    app = make_app(max_tokens=1500)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await stop_a_long_answer(pilot)
        answer = store.get(app.conversation.id).messages[-1]
        assert answer.stopped and answer.stats["finish_reason"] == "abort"
        assert 0 < answer.stats["tokens"] < 1500
        view = app.query(MessageView).last()
        assert view.content == answer.content and view.has_class("stopped")
        assert "stopped" in str(view.query_one(".footer", Label).render())
        figures = await app.backend.engine_figures()
        assert figures.kv_used == 0 and figures.num_running == 0


async def test_escape_elsewhere_returns_to_the_box(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("ctrl+f")
        assert isinstance(app.focused, Input) and app.focused.id == "search"
        await pilot.press("escape")
        assert app.focused is app.prompt


# -- conversations ------------------------------------------------------------------------------

async def test_ctrl_n_starts_a_new_chat(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "Say yes.")
        first = app.conversation.id
        await pilot.press("ctrl+n")
        assert app.conversation is None and views(app) == []
        await send(pilot, "Say no.")
        assert app.conversation.id != first
        assert [c.title for c in store.list()] == ["Say no.", "Say yes."]


async def test_ctrl_b_toggles_the_panel(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        sidebar = app.query_one(ConversationList)
        assert sidebar.display
        await pilot.press("ctrl+b")
        assert not sidebar.display and app.focused is app.prompt
        await pilot.press("ctrl+b")
        assert sidebar.display


async def test_ctrl_f_searches_chats_by_text(make_app, store):
    saved_conversation(store, [("tell me about tomatoes", "They are red.")], title="Vegetables")
    saved_conversation(store, [("what is rust", "A language.")], title="Programming")
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("ctrl+b")  # hidden: ctrl+f shows it again
        await pilot.press("ctrl+f")
        sidebar = app.query_one(ConversationList)
        assert sidebar.display
        options = sidebar.query_one(OptionList)
        assert [options.get_option_at_index(i).prompt for i in range(options.option_count)] == [
            "Programming", "Vegetables"]
        await pilot.press(*"RED")  # in an answer, any case
        assert [options.get_option_at_index(i).prompt for i in range(options.option_count)] == ["Vegetables"]
        await pilot.press(*"zzz")
        assert options.option_count == 1 and options.get_option_at_index(0).disabled


async def test_selecting_a_chat_resumes_it_and_reuses_its_prefix(make_app, store):
    conv_id = saved_conversation(store, [("Write a Python function that reverses a string.",
                                          "def reverse(s):\n    return s[::-1]\n")] * 3)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        focus_first_chat(app)
        await pilot.press("enter")
        await wait_ready(pilot)  # loaded, and the conversation's KV warmed
        assert app.conversation.id == conv_id
        assert len(views(app)) == 6
        await send(pilot, "Now make it uppercase too.")
        answer = store.get(conv_id).messages[-1]
        assert answer.stats["cached_tokens"] > 0
        assert answer.stats["cached_tokens"] % 16 == 0
        assert f"cached {answer.stats['cached_tokens']}" in app.status.render_text()


async def test_ctrl_r_renames(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("ctrl+r")  # nothing saved yet: a warning, no screen
        assert not isinstance(app.screen, RenameScreen)
        await send(pilot, "Say yes.")
        await pilot.press("ctrl+r")
        assert isinstance(app.screen, RenameScreen)
        field = app.screen.query_one(Input)
        field.value = "   "
        await pilot.press("enter")
        assert isinstance(app.screen, RenameScreen)
        assert "at least one word" in str(app.screen.query_one("#rename-error", Label).render())
        field.value = "My   chat"
        await pilot.press("enter")
        assert not isinstance(app.screen, RenameScreen)
        assert store.get(app.conversation.id).title == "My chat" and app.sub_title == "My chat"


async def test_f8_deletes_after_asking(make_app, store):
    saved_conversation(store, [("keep me", "ok")], title="Keep")
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "Say yes.")
        doomed = app.conversation.id
        await pilot.press("f8")
        assert isinstance(app.screen, ChoiceScreen)
        await pilot.press("escape")  # cancel keeps it
        assert store.get(doomed) is not None
        await pilot.press("f8")
        await pilot.click("#answer-delete")
        await pilot.pause()
        assert store.get(doomed) is None
        assert app.conversation is None and views(app) == []
        assert [c.title for c in store.list()] == ["Keep"]


async def test_delete_key_in_the_list_deletes_the_highlighted_chat(make_app, store):
    keep = saved_conversation(store, [("a", "b")], title="Keep")
    doomed = saved_conversation(store, [("c", "d")], title="Doomed")  # newest: listed first
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        focus_first_chat(app)
        await pilot.press("delete")
        assert isinstance(app.screen, ChoiceScreen)
        await pilot.press("enter")  # the first button, Delete, has the focus
        await pilot.pause()
        assert store.get(doomed) is None and store.get(keep) is not None


# -- model, system prompt, settings -------------------------------------------------------------

async def test_ctrl_o_picks_another_model(make_app, qwen_path, gemma_path, store):
    app = make_app(list_models=lambda: [(str(qwen_path), "qwen"), (str(gemma_path), "gemma")])
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, ModelPickerScreen)
        await pilot.press("down", "enter")
        await wait_ready(pilot)
        assert app.model == str(gemma_path) and app.backend.model_name == gemma_path.name
        assert gemma_path.stem in app.status.render_text()
        # Gemma 270M base has no chat template: the turn fails inline, in red, and the text comes back.
        app.prompt.load_text("hello")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.is_answering and app.query("MessageView.error"), 30, "the error")
        error = app.query_one("MessageView.error")
        assert "chat template" in error.content
        assert app.prompt.text == "hello"
        assert store.list() == []
        # Back to Qwen: the model manager kept it loaded (memory allows both), so no second load.
        await pilot.press("ctrl+o")
        await pilot.press("up", "enter")
        await wait_ready(pilot)
        assert app.model == str(qwen_path) and app.backend.model_name == qwen_path.name
        loads = {Path(s.name).name: (s.state, s.num_loads, s.in_flight) for s in app.models.manager.status()}
        assert loads == {qwen_path.name: ("loaded", 1, 1), gemma_path.name: ("loaded", 1, 0)}


async def test_a_model_that_fails_to_load_says_so_inline(make_app, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a model file")
    app = make_app(list_models=lambda: [(str(app.model), "qwen"), (str(bad), "broken")])
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("ctrl+o")
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.query("MessageView.error"), 30, "the load error")
        assert "ctrl+o" in app.query_one("MessageView.error").content
        assert app.backend is None and "no model" in app.status.render_text()


async def test_ctrl_s_edits_the_system_prompt(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send(pilot, "Say yes.")
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SystemPromptScreen)
        app.screen.query_one("#system").load_text("You answer in French.")
        await pilot.press("ctrl+s")
        assert not isinstance(app.screen, SystemPromptScreen)
        assert app.system == "You answer in French."
        assert store.get(app.conversation.id).system == "You answer in French."
        assert app.conversation.context_messages()[0] == {"role": "system", "content": "You answer in French."}
        await pilot.press("ctrl+s", "escape")  # Esc cancels
        assert app.system == "You answer in French."


async def test_ctrl_g_changes_generation_settings(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("ctrl+g")
        assert isinstance(app.screen, SettingsScreen)
        screen = app.screen
        screen.query_one("#temperature", Input).value = "-1"
        screen.query_one("#temperature", Input).focus()
        await pilot.press("enter")
        assert "temperature=-1.0 is invalid" in str(screen.query_one("#settings-error", Label).render())
        screen.query_one("#temperature", Input).value = "0.3"
        screen.query_one("#top_p", Input).value = "0.5"
        screen.query_one("#max_tokens", Input).value = "77"
        await pilot.press("enter")
        assert (app.settings.temperature, app.settings.top_p, app.settings.max_tokens) == (0.3, 0.5, 77)


# -- clipboard ----------------------------------------------------------------------------------

async def test_f2_and_f3_copy_the_answer_and_its_last_code_block(make_app, store):
    conv_id = saved_conversation(store, [("write add", CODE_ANSWER)])
    app = make_app(conversation=store.get(conv_id))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("f2")
        assert app.clipboard == CODE_ANSWER
        await pilot.press("f3")
        assert app.clipboard == "assert add(1, 2) == 3\n"


async def test_copy_with_nothing_to_copy_warns(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("f2", "f3")
        assert app.clipboard == ""


def test_code_blocks_of_an_unfinished_answer():
    assert code_blocks(CODE_ANSWER) == ["def add(a, b):\n    return a + b\n", "assert add(1, 2) == 3\n"]
    assert code_blocks("stopped in code:\n```py\nx = 1\ny =") == ["x = 1\ny ="]
    assert code_blocks("no code") == []


# -- help, palette, quit ------------------------------------------------------------------------

async def test_f1_shows_every_key_binding(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        keys = [row[0] for row in app.screen.keys]
        for binding in app.BINDINGS:
            assert binding.key in keys
        for key in ("enter", "ctrl+j", "up / down", "delete", "ctrl+p"):
            assert key in keys
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await wait_ready(pilot)


async def test_command_palette_lists_and_runs_every_action(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for action, (title, _) in app.ACTIONS.items():
            if action != "quit":
                assert title in titles
        assert "Quit" in titles
        await pilot.press("ctrl+p")
        assert isinstance(app.screen, CommandPalette)
        await pilot.press(*"Generation settings")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), 5, "the settings screen")


async def test_ctrl_q_quits_with_code_0(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await pilot.press("ctrl+q")
    assert app.return_code == 0


# -- the context fills up -----------------------------------------------------------------------

LONG_TURN = ("Explain, in detail, every step of how a compiler turns source code into machine code. " * 6,
             "A compiler reads the source text, splits it into tokens, parses them into a tree, "
             "checks types, lowers the tree to an intermediate form, optimizes it, allocates "
             "registers and emits machine code. " * 4)


async def send_into_a_full_context(pilot) -> None:
    """Send "Summarize." into a conversation that leaves it no room; the question appears."""
    app = pilot.app
    app.prompt.load_text("Summarize.")
    await pilot.press("enter")
    await wait_for(pilot, lambda: isinstance(app.screen, ChoiceScreen), 10, "the context-full question")


async def test_a_full_context_offers_dropping_the_oldest_turns(make_app, store):
    conv_id = saved_conversation(store, [LONG_TURN] * 3)
    app = make_app(n_ctx=512, max_tokens=16, conversation=store.get(conv_id))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send_into_a_full_context(pilot)
        assert "too long" in app.screen.title_text
        await pilot.click("#answer-drop")
        await wait_for(pilot, lambda: not app.is_answering, 60, "the answer")
        messages = store.get(conv_id).messages
        assert [m.excluded for m in messages[:6]] == [True, True, True, True, False, False]
        assert [m.role for m in messages[6:]] == ["user", "assistant"]
        assert messages[6].content == "Summarize." and messages[7].stats["finish_reason"] in ("stop", "length")
        excluded_views = [v for v in app.query(MessageView) if v.has_class("excluded")]
        assert len(excluded_views) == 4


async def test_a_full_context_can_start_a_new_chat_or_give_the_text_back(make_app, store):
    conv_id = saved_conversation(store, [LONG_TURN] * 3)
    app = make_app(n_ctx=512, max_tokens=16, conversation=store.get(conv_id))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        await send_into_a_full_context(pilot)
        await pilot.click("#answer-cancel")
        await wait_for(pilot, lambda: not app.is_answering, 10, "the turn to end")
        assert app.prompt.text == "Summarize."
        assert len(store.get(conv_id).messages) == 6
        await send_into_a_full_context(pilot)
        await pilot.click("#answer-new")
        await wait_for(pilot, lambda: not app.is_answering, 60, "the answer")
        assert app.conversation.id != conv_id
        assert [m.content for m in app.conversation.messages][:1] == ["Summarize."]
        assert len(store.get(conv_id).messages) == 6  # the old chat is untouched


async def test_a_message_longer_than_the_context_is_refused_inline(make_app, store):
    app = make_app(n_ctx=256)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot)
        text = "word " * 400
        app.prompt.load_text(text)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.query("MessageView.error"), 10, "the error")
        assert "does not fit" in app.query_one("MessageView.error").content
        assert app.prompt.text == text and store.list() == []


async def test_the_view_follows_the_answer_until_the_person_scrolls_up(make_app):
    app = make_app(max_tokens=1500)
    async with app.run_test(size=(100, 14)) as pilot:  # a short view: a few lines outgrow it
        await wait_ready(pilot)
        view = app.messages_view
        app.prompt.load_text(LONG_PROMPT)
        await pilot.press("enter")
        await wait_for(pilot, lambda: view.max_scroll_y > 5 and view.scroll_y == view.max_scroll_y, 60,
                       "the answer to outgrow the screen, followed")
        view.scroll_home(animate=False, immediate=True)
        assert not view.is_following
        grown = view.max_scroll_y
        await wait_for(pilot, lambda: view.max_scroll_y > grown + 2, 60, "more answer")
        assert view.scroll_y == 0  # left where the person put it
        view.scroll_end(animate=False, immediate=True)
        assert view.is_following
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.is_answering, 10, "the answer to stop")
        await pilot.pause(0.3)
        assert view.scroll_y == view.max_scroll_y
