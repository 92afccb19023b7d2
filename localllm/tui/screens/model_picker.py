"""Pick the model for this chat from the installed ones."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option


class ModelPickerScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, models: list[tuple[str, str]], current: str):
        """``models``: (model, label) pairs; the model is what the app loads."""
        super().__init__()
        self.models, self.current = models, current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Label("Model", classes="dialog-title")
            options = OptionList(*[Option(label, id=model) for model, label in self.models], id="models")
            yield options
            if not self.models:
                yield Label("No models found. Put .gguf files in the models folder "
                            "(see `localllm chat --help`).", classes="dialog-text")
            yield Label("Enter loads the model · Esc cancels", classes="dialog-hint")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        for i, (model, _) in enumerate(self.models):
            if model == self.current:
                options.highlighted = i
        options.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
