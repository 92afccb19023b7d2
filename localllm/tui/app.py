"""The chat app: conversations on the left, the chat on the right, the engine at the bottom.

The screen never waits on the model: loading runs in a thread, answers stream in an async
worker, and the engine's figures are polled on a timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, Label, LoadingIndicator

from localllm.errors import ContextOverflowError, LocalLLMError
from localllm.tui.backend import ChatBackend, Figures, GenerationSettings, reserve_for
from localllm.tui.pacer import CPU_BUDGET, PaintPacer
from localllm.tui.conversations import Conversation, ConversationStore, Message, title_for
from localllm.tui.screens.choice import ChoiceScreen
from localllm.tui.screens.help import HelpScreen
from localllm.tui.screens.model_picker import ModelPickerScreen
from localllm.tui.screens.rename import RenameScreen
from localllm.tui.screens.settings import SettingsScreen
from localllm.tui.screens.system_prompt import SystemPromptScreen
from localllm.tui.widgets.conversation_list import ConversationList
from localllm.tui.widgets.message_list import MessageList
from localllm.tui.widgets.message_view import MessageView, code_blocks
from localllm.tui.widgets.prompt_input import PromptInput
from localllm.tui.widgets.status_bar import StatusBar

NEW_CHAT_TITLE = "New chat"


class ChatApp(App[int]):
    CSS_PATH = "chat.tcss"
    TITLE = "localllm"
    BINDINGS = [
        Binding("f1", "help", "Help"),
        Binding("escape", "stop", "Stop answer"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+b", "toggle_sidebar", "Chats"),
        Binding("ctrl+f", "search", "Search chats", show=False),
        Binding("ctrl+r", "rename", "Rename chat", show=False),
        Binding("f8", "delete_chat", "Delete chat", show=False),
        Binding("ctrl+o", "pick_model", "Model"),
        Binding("ctrl+s", "edit_system", "System prompt", show=False),
        Binding("ctrl+g", "settings", "Settings"),
        Binding("f2", "copy_answer", "Copy answer"),
        Binding("f3", "copy_code", "Copy code", show=False),
        Binding("ctrl+q", "quit", "Quit"),
    ]
    # What each action is, for the help screen and the command palette.
    ACTIONS = {
        "help": ("Help", "Every key binding"),
        "stop": ("Stop answer", "Stop the answer being written; what it wrote stays, marked stopped"),
        "new_chat": ("New chat", "Start a new conversation"),
        "toggle_sidebar": ("Show or hide chats", "The panel of saved conversations"),
        "search": ("Search chats", "Find conversations by any text in them"),
        "rename": ("Rename chat", "Give this conversation a title"),
        "delete_chat": ("Delete chat", "Delete this conversation (asks first)"),
        "pick_model": ("Pick model", "Load another installed model for this chat"),
        "edit_system": ("Edit system prompt", "The instructions the model sees first in this chat"),
        "settings": ("Generation settings", "Temperature, top-p and max tokens"),
        "copy_answer": ("Copy answer", "Copy the last answer to the clipboard"),
        "copy_code": ("Copy code block", "Copy the last code block of the last answer"),
        "quit": ("Quit", "Leave localllm chat"),
    }

    def __init__(self, backend_factory: Callable[[str], ChatBackend], model: str, store: ConversationStore,
                 settings: GenerationSettings | None = None, system: str = "",
                 conversation: Conversation | None = None,
                 list_models: Callable[[], list[tuple[str, str]]] | None = None, models=None):
        """``models``: the LocalModels the backends lease from (closed when the app ends)."""
        super().__init__()
        self.models = models
        self.backend_factory = backend_factory
        self.model = conversation.model if conversation is not None and conversation.model else model
        self.store = store
        self.settings = settings or GenerationSettings()
        self.system = conversation.system if conversation is not None else system
        self.conversation = conversation
        self.list_models = list_models or (lambda: [(self.model, self.model)])
        self.backend: ChatBackend | None = None  # set once loaded
        self.is_answering = False
        self._stop_requested = False

    # -- layout ---------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        with Horizontal(id="body"):
            yield ConversationList(id="sidebar")
            with Vertical(id="main"):
                with MessageList(id="messages"):
                    yield Label("Type a message and press Enter · ctrl+j starts a new line · "
                                "F1 lists every key", id="empty-hint")
                    with Vertical(id="loading"):
                        yield LoadingIndicator()
                        yield Label("", id="loading-label")
                yield PromptInput(id="prompt", history=self.store.recent_inputs())
        yield StatusBar(id="status")
        yield Footer()

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    @property
    def status(self) -> StatusBar:
        # A worker may finish after the app has begun closing: its figures then go nowhere.
        found = self.query(StatusBar) if self.screen_stack else None
        return found.first() if found else StatusBar()

    @property
    def messages_view(self) -> MessageList:
        return self.query_one("#messages", MessageList)

    async def on_mount(self) -> None:
        self.prompt.focus()
        self._refresh_sidebar()
        if self.conversation is not None:
            await self._show_conversation(self.conversation)
        self._set_title()
        self.set_interval(1.0, self._poll_engine)
        self._load(self.model)

    async def on_unmount(self) -> None:
        if self.backend is not None:
            self.backend.stop()
            await _close(self.backend)
        if self.models is not None:  # every model the manager still holds
            await self.models.close()

    # -- loading a model ------------------------------------------------------------------

    @work(group="load", exclusive=True)
    async def _load(self, model: str) -> None:
        loading = self.query_one("#loading")
        loading.display = True
        self.query_one("#loading-label", Label).update(f"Loading {Path(model).name or model} …")
        self.status.set_state("loading", model)
        old, self.backend = self.backend, None
        if old is not None:
            await _close(old)
        try:
            backend = self.backend_factory(model)
            if hasattr(backend, "aload"):  # a model leased from the app's model manager
                await backend.aload()
            else:
                await asyncio.to_thread(backend.load)
        except LocalLLMError as e:
            loading.display = False
            self.status.set_state("no model", model)
            await self._show_error(f"{e}\nPick another model with ctrl+o.")
            return
        self.backend, self.model = backend, model
        loading.display = False
        self.status.set_state("ready", backend.model_name or model)
        if getattr(backend, "pool_summary", None):
            self.notify(f"KV cache: {backend.pool_summary}", timeout=8)
        if getattr(backend, "runner_reason", None):
            self.notify(f"Runner: {backend.runner_reason}", timeout=8)
        if self.conversation is not None and self.conversation.messages:
            self._warm()

    @work(group="warm", exclusive=True)
    async def _warm(self) -> None:
        """Compute the KV of a resumed conversation while the person types its next turn."""
        backend, conv = self.backend, self.conversation
        if backend is None or conv is None:
            return
        self.status.set_state("warming the cache")
        try:
            await backend.warm(conv.context_messages())
        except LocalLLMError:
            pass  # the turn itself will say what is wrong
        if not self.is_answering and self.backend is backend:
            self.status.set_state("ready")

    async def _poll_engine(self) -> None:
        if self.backend is not None:
            try:
                self.status.set_engine(await self.backend.engine_figures())
            except LocalLLMError:
                pass

    # -- a turn ---------------------------------------------------------------------------

    def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        if self.backend is None:
            self.notify("The model is not loaded yet; your text stays in the box.", severity="warning")
            return
        if self.is_answering:
            self.notify("An answer is still being written; Esc stops it.", severity="warning")
            return
        self.prompt.load_text("")
        self.is_answering = True
        self._stop_requested = False
        self._answer(event.text)

    @work(group="answer", exclusive=True)
    async def _answer(self, text: str) -> None:
        try:
            while True:
                outcome = await self._run_turn(text)
                if outcome != "retry":
                    return
        finally:
            self.is_answering = False
            if self.backend is not None:
                self.status.set_state("ready")

    async def _run_turn(self, text: str) -> str:
        """One try at answering ``text``: "done", "retry" (after the person made room), or
        "abandoned" (the text went back into the box)."""
        backend = self.backend
        conv = self.conversation
        messages = conv.context_messages() if conv else ([{"role": "system", "content": self.system}]
                                                         if self.system else [])
        messages = messages + [{"role": "user", "content": text}]
        user_view = MessageView("user", text)
        answer_view = MessageView("assistant")
        await self.messages_view.mount_all([user_view, answer_view])
        self._update_hint()
        self.messages_view.follow()
        figures = Figures()
        self.status.set_state("answering")
        self.status.set_answer(figures)
        saved = False

        # Tokens reach the screen in batches, paced so that rendering never takes much CPU
        # from a model running on the same cores (see pacer.py).
        pacer = PaintPacer(budget=CPU_BUDGET if backend.shares_cpu else 1.0)
        painter = None

        async def paint() -> None:
            nonlocal painter
            await answer_view.flush()
            self.status.set_answer(figures)
            if painter is not None:
                painter = self.set_timer(pacer.next_interval(), paint)

        painter = self.set_timer(pacer.interval, paint)
        try:
            async for chunk in backend.stream(messages, self.settings):
                if not saved:
                    conv = self._ensure_conversation(text)
                    user_view.message_id = self.store.add_message(conv.id, self._remember(Message("user", text))).id
                    saved = True
                if self._stop_requested:
                    backend.stop()  # Esc came before the stream had started
                figures.observe(chunk)
                answer_view.add(chunk.text, chunk.reasoning)
        except ContextOverflowError as e:
            if not saved:
                await user_view.remove()
                await answer_view.remove()
                self._update_hint()
                return await self._make_room(text, str(e))
            await answer_view.remove()
            await self._show_error(str(e))
            return "abandoned"
        except Exception as e:
            await answer_view.remove()
            if not saved:
                await user_view.remove()
                self.prompt.load_text(text)
            detail = str(e) if isinstance(e, LocalLLMError) else f"unexpected {type(e).__name__}: {e} (a bug; please report it)"
            await self._show_error(detail + ("\nYour message is back in the box." if not saved else ""))
            return "abandoned"
        finally:
            painter.stop()
            painter = None
        await paint()
        stopped = figures.finish_reason == "abort"
        stats = figures.to_dict()
        answer = self.store.add_message(conv.id, self._remember(Message("assistant", answer_view.content, stopped,
                                                                        stats=stats)))
        answer_view.message_id = answer.id
        await answer_view.finish(stats, stopped)
        self.status.set_answer(stats)
        self._refresh_sidebar()
        n_ctx = backend.n_ctx
        if figures.finish_reason == "length" and n_ctx and (figures.prompt_tokens or 0) + figures.num_tokens >= n_ctx:
            await self._show_notice("The context is full, so the answer stopped here. Start a new chat "
                                    "(ctrl+n), or send your next message and choose to drop the oldest turns.")
        return "done"

    async def _make_room(self, text: str, reason: str) -> str:
        conv = self.conversation
        if conv is None or not any(not m.excluded for m in conv.messages):
            self.prompt.load_text(text)
            await self._show_error(f"{reason}: this message alone does not fit. Shorten it, or start "
                                   "localllm chat with a larger --ctx. Your message is back in the box.")
            return "abandoned"
        choice = await self.push_screen_wait(ChoiceScreen(
            "The conversation is too long",
            f"{reason}. Start a new chat with this message, or drop the oldest turns from what the "
            "model sees (they stay here to read)?",
            [("new", "New chat"), ("drop", "Drop oldest turns"), ("cancel", "Cancel")]))
        if choice == "new":
            await self._start_new_chat()
            return "retry"
        if choice == "drop":
            self._drop_oldest_turns(text)
            return "retry"
        self.prompt.load_text(text)
        return "abandoned"

    def _drop_oldest_turns(self, text: str) -> None:
        """Drop whole turns, oldest first, until the conversation and ``text`` fit (or, when the
        backend cannot count tokens, one turn per try)."""
        conv = self.conversation
        backend = self.backend
        dropped: list[int] = []
        while True:
            turn = conv.oldest_turn()
            if not turn:
                break
            for m in turn:
                m.excluded = True
                dropped.append(m.id)
            n = backend.count_tokens(conv.context_messages() + [{"role": "user", "content": text}])
            if n is None or backend.n_ctx is None or n + reserve_for(self.settings, backend.n_ctx) <= backend.n_ctx:
                break
        self.store.exclude(dropped)
        for view in self.query(MessageView):
            if view.message_id in dropped:
                view.set_excluded()
        self.notify(f"Dropped {len(dropped)} of the oldest messages from the context.")

    def _ensure_conversation(self, first_text: str) -> Conversation:
        if self.conversation is None:
            self.conversation = self.store.create(model=self.model, system=self.system,
                                                  title=title_for(first_text))
            self._set_title()
        elif self.conversation.title == NEW_CHAT_TITLE and not self.conversation.messages:
            self.store.rename(self.conversation.id, title_for(first_text))
            self.conversation.title = title_for(first_text)
            self._set_title()
        return self.conversation

    def _remember(self, message: Message) -> Message:
        self.conversation.messages.append(message)
        return message

    # -- showing things -------------------------------------------------------------------

    async def _show_conversation(self, conv: Conversation) -> None:
        view = self.messages_view
        await view.query(MessageView).remove()
        await view.mount_all([MessageView(m.role, m.content, stopped=m.stopped, excluded=m.excluded,
                                          stats=m.stats, message_id=m.id) for m in conv.messages])
        self._update_hint()
        view.follow()
        last = next((m for m in reversed(conv.messages) if m.role == "assistant"), None)
        self.status.set_answer(last.stats if last else {})

    def _update_hint(self) -> None:
        self.query_one("#empty-hint").display = not self.query(MessageView)

    async def _show_error(self, text: str) -> None:
        await self.messages_view.mount(MessageView("error", error=text))
        self._update_hint()
        self.messages_view.follow()

    async def _show_notice(self, text: str) -> None:
        await self.messages_view.mount(MessageView("notice", error=text))
        self.messages_view.follow()

    def _set_title(self) -> None:
        self.sub_title = self.conversation.title if self.conversation else NEW_CHAT_TITLE

    def _refresh_sidebar(self) -> None:
        sidebar = self.query_one(ConversationList)
        current = self.conversation.id if self.conversation else None
        sidebar.show(self.store.list(sidebar.search_text), current)

    def _last_answer(self) -> str | None:
        if self.conversation is None:
            return None
        return next((m.content for m in reversed(self.conversation.messages)
                     if m.role == "assistant" and m.content), None)

    # -- actions --------------------------------------------------------------------------

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.key_help()))

    def key_help(self) -> list[tuple[str, str]]:
        keys = [(b.key, self.ACTIONS[b.action][1]) for b in self.BINDINGS]
        keys += PromptInput.HELP + ConversationList.HELP
        keys.append(("ctrl+p", "Command palette: every action by name"))
        return keys

    def action_stop(self) -> None:
        if self.is_answering and self.backend is not None:
            self._stop_requested = True
            self.backend.stop()
        elif self.focused is not self.prompt:
            self.prompt.focus()

    async def action_new_chat(self) -> None:
        if self.is_answering:
            self.notify("An answer is still being written; Esc stops it first.", severity="warning")
            return
        await self._start_new_chat()

    async def _start_new_chat(self) -> None:
        self.conversation = None
        await self.messages_view.query(MessageView).remove()
        self._update_hint()
        self.status.set_answer({})
        self._set_title()
        self._refresh_sidebar()
        self.prompt.focus()

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one(ConversationList)
        sidebar.display = not sidebar.display
        if not sidebar.display:
            self.prompt.focus()

    def action_search(self) -> None:
        sidebar = self.query_one(ConversationList)
        sidebar.display = True
        sidebar.query_one("#search").focus()

    def action_rename(self) -> None:
        conv = self.conversation
        if conv is None:
            self.notify("Nothing to rename yet: send a message first.", severity="warning")
            return

        def done(title: str | None) -> None:
            if title:
                self.store.rename(conv.id, title)
                conv.title = " ".join(title.split())
                self._set_title()
                self._refresh_sidebar()

        self.push_screen(RenameScreen(conv.title), done)

    def action_delete_chat(self, conversation_id: str | None = None) -> None:
        target = conversation_id or (self.conversation.id if self.conversation else None)
        if target is None:
            self.notify("Nothing to delete: this chat is not saved yet.", severity="warning")
            return
        conv = self.store.get(target)
        if conv is None:
            return

        async def done(answer: str | None) -> None:
            if answer != "delete":
                return
            if self.conversation is not None and self.conversation.id == target:
                if self.is_answering:
                    self.notify("An answer is still being written; Esc stops it first.", severity="warning")
                    return
                await self._start_new_chat()
            self.store.delete(target)
            self._refresh_sidebar()
            self.notify(f"Deleted “{conv.title}”.")

        self.push_screen(ChoiceScreen("Delete chat", f"Delete “{conv.title}” and its {len(conv.messages)} "
                                      "messages? This cannot be undone.",
                                      [("delete", "Delete"), ("cancel", "Cancel")]), done)

    def action_pick_model(self) -> None:
        if self.is_answering:
            self.notify("An answer is still being written; Esc stops it first.", severity="warning")
            return

        def done(model: str | None) -> None:
            if model and model != self.model:
                if self.conversation is not None:
                    self.store.set_model(self.conversation.id, model)
                    self.conversation.model = model
                self._load(model)

        self.push_screen(ModelPickerScreen(self.list_models(), self.model), done)

    def action_edit_system(self) -> None:
        def done(system: str | None) -> None:
            if system is None:
                return
            self.system = system
            if self.conversation is not None:
                self.store.set_system(self.conversation.id, system)
                self.conversation.system = system
            self.notify("System prompt saved; it applies from the next message.")

        self.push_screen(SystemPromptScreen(self.system), done)

    def action_settings(self) -> None:
        def done(settings: GenerationSettings | None) -> None:
            if settings is not None:
                self.settings = settings
                self.notify(f"temperature {settings.temperature} · top-p {settings.top_p} · "
                            f"max tokens {settings.max_tokens}")

        self.push_screen(SettingsScreen(self.settings), done)

    def action_copy_answer(self) -> None:
        answer = self._last_answer()
        if answer is None:
            self.notify("No answer to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(answer)
        self.notify(f"Copied the last answer ({len(answer):,} characters).")

    def action_copy_code(self) -> None:
        answer = self._last_answer()
        blocks = code_blocks(answer) if answer else []
        if not blocks:
            self.notify("The last answer has no code block.", severity="warning")
            return
        self.copy_to_clipboard(blocks[-1])
        self.notify(f"Copied the last code block ({blocks[-1].count(chr(10)) + 1} lines).")

    # -- the side panel -------------------------------------------------------------------

    async def on_conversation_list_selected(self, event: ConversationList.Selected) -> None:
        if self.conversation is not None and event.conversation_id == self.conversation.id:
            self.prompt.focus()
            return
        if self.is_answering:
            self.notify("An answer is still being written; Esc stops it first.", severity="warning")
            return
        conv = self.store.get(event.conversation_id)
        if conv is None:
            self._refresh_sidebar()
            return
        self.conversation, self.system = conv, conv.system
        await self._show_conversation(conv)
        self._set_title()
        self.prompt.focus()
        if conv.model and conv.model != self.model:
            self._load(conv.model)  # warms the conversation once loaded
        elif self.backend is not None:
            self._warm()

    def on_conversation_list_delete_requested(self, event: ConversationList.DeleteRequested) -> None:
        self.action_delete_chat(event.conversation_id)

    def on_conversation_list_search_changed(self, event: ConversationList.SearchChanged) -> None:
        self._refresh_sidebar()

    # -- the command palette --------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        for action, (title, help_text) in self.ACTIONS.items():
            if action == "quit":
                continue  # Textual's own palette has Quit
            yield SystemCommand(title, help_text, getattr(self, f"action_{action}"))
        yield from super().get_system_commands(screen)


async def _close(backend) -> None:
    """Close a backend, or give its model back to the app's model manager."""
    if hasattr(backend, "aclose"):
        await backend.aclose()
    else:
        await asyncio.to_thread(backend.close)
