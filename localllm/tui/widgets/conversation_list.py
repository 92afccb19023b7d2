"""The side panel of saved conversations: a search box over a list, most recent first."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from localllm.tui.conversations import Conversation


class ConversationList(Vertical):
    BINDINGS = [Binding("delete", "delete", "Delete chat", show=False)]
    HELP = [("delete", "In the chat list: delete the highlighted chat")]

    @dataclass
    class Selected(Message):
        conversation_id: str

    @dataclass
    class DeleteRequested(Message):
        conversation_id: str

    @dataclass
    class SearchChanged(Message):
        text: str

    def compose(self) -> ComposeResult:
        yield Label("Chats", classes="panel-title")
        yield Input(placeholder="Search chats", id="search")
        yield OptionList(id="conversations")

    def show(self, conversations: list[Conversation], current_id: str | None) -> None:
        options = self.query_one(OptionList)
        options.clear_options()
        options.add_options([Option(c.title, id=c.id) for c in conversations])
        if not conversations:
            options.add_option(Option("No chats yet" if not self.search_text else "No chat matches",
                                      id="", disabled=True))
        for i, c in enumerate(conversations):
            if c.id == current_id:
                options.highlighted = i

    @property
    def search_text(self) -> str:
        return self.query_one(Input).value

    @property
    def highlighted_id(self) -> str | None:
        options = self.query_one(OptionList)
        if options.highlighted is None:
            return None
        return options.get_option_at_index(options.highlighted).id or None

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.post_message(self.SearchChanged(event.value))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id:
            self.post_message(self.Selected(event.option.id))

    def action_delete(self) -> None:
        conversation_id = self.highlighted_id
        if conversation_id:
            self.post_message(self.DeleteRequested(conversation_id))
