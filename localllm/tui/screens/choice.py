"""A question with a few answers as buttons (delete this chat? the context is full: what now?)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label


class ChoiceScreen(ModalScreen[str | None]):
    """Answers are (id, label) pairs; the screen returns the chosen id, or None on Esc."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, text: str, answers: list[tuple[str, str]]):
        super().__init__()
        self.title_text, self.text, self.answers = title, text, answers

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title")
            yield Label(self.text, classes="dialog-text")
            with Horizontal(classes="buttons"):
                for i, (answer_id, label) in enumerate(self.answers):
                    yield Button(label, id=f"answer-{answer_id}", variant="primary" if i == 0 else "default")

    def on_mount(self) -> None:
        self.query(Button).first().focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id.removeprefix("answer-"))

    def action_cancel(self) -> None:
        self.dismiss(None)
