"""The message box: Enter sends, Ctrl+J (or Shift/Alt+Enter where the terminal reports them)
inserts a newline, Up on the first line and Down on the last walk the input history."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")


class PromptInput(TextArea):
    BINDINGS = [
        Binding("enter", "submit", "Send", show=False),
        Binding("ctrl+j", "newline", "Newline", show=False),
        Binding("up", "history_back", "Earlier input", show=False),
        Binding("down", "history_forward", "Later input", show=False),
    ]
    HELP = [("enter", "Send the message"), ("ctrl+j", "New line (also shift+enter / alt+enter where the "
                                                      "terminal reports them)"),
            ("up / down", "Earlier / later input, from the first / last line")]

    @dataclass
    class Submitted(Message):
        text: str

    def __init__(self, history: list[str] | None = None, **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.input_history: list[str] = list(history or [])
        self._history_pos: int | None = None  # index into history while walking it
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.prevent_default()
            event.stop()
            self.action_submit()
        elif event.key in NEWLINE_KEYS:
            event.prevent_default()
            event.stop()
            self.action_newline()
        else:
            await super()._on_key(event)

    def action_submit(self) -> None:
        text = self.text
        if not text.strip():
            return
        if not self.input_history or self.input_history[-1] != text:
            self.input_history.append(text)
        self._history_pos = None
        self.post_message(self.Submitted(text))

    def action_newline(self) -> None:
        self.insert("\n")

    def action_history_back(self) -> None:
        if self.cursor_location[0] > 0 or not self.input_history or self.selection.start != self.selection.end:
            self.action_cursor_up()
            return
        if self._history_pos is None:
            self._draft, self._history_pos = self.text, len(self.input_history)
        if self._history_pos > 0:
            self._history_pos -= 1
            self._show(self.input_history[self._history_pos])

    def action_history_forward(self) -> None:
        if self.cursor_location[0] < self.document.line_count - 1 or self._history_pos is None:
            self.action_cursor_down()
            return
        self._history_pos += 1
        if self._history_pos >= len(self.input_history):
            self._history_pos = None
            self._show(self._draft)
        else:
            self._show(self.input_history[self._history_pos])

    def _show(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)
