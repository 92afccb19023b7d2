"""Every key binding of the app, listed from the bindings themselves so it never goes stale."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def __init__(self, keys: list[tuple[str, str]]):
        super().__init__()
        self.keys = keys

    def compose(self) -> ComposeResult:
        with Vertical(id="help-dialog", classes="dialog"):
            yield Label("localllm chat — keys", classes="dialog-title")
            table = DataTable(show_cursor=False, zebra_stripes=True, id="help-table")
            table.add_columns("key", "what it does")
            for key, what in self.keys:
                table.add_row(key, what)
            yield table
            yield Label("Esc closes · ctrl+p opens the command palette, which lists every action too",
                        classes="dialog-hint")
