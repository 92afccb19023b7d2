"""Edit the conversation's system prompt."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, TextArea


class SystemPromptScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("ctrl+s", "save", "Save"), Binding("escape", "cancel", "Cancel")]

    def __init__(self, system: str):
        super().__init__()
        self.system = system

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Label("System prompt", classes="dialog-title")
            yield TextArea(self.system, id="system", soft_wrap=True)
            yield Label("Ctrl+S saves (empty: the model's default) · Esc cancels", classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()

    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)
