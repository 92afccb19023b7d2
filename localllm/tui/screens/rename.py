"""Rename the current conversation."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label


class RenameScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str):
        super().__init__()
        self.title_text = title

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Rename chat", classes="dialog-title")
            yield Input(self.title_text, id="title")
            yield Label("", id="rename-error", classes="error-text")
            yield Label("Enter saves · Esc cancels", classes="dialog-hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if not event.value.split():
            self.query_one("#rename-error", Label).update("A title needs at least one word.")
            return
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)
