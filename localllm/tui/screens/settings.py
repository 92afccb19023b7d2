"""Generation settings: temperature, top-p, max tokens; checked as the engine checks them."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from localllm.errors import UsageError
from localllm.tui.backend import GenerationSettings


class SettingsScreen(ModalScreen[GenerationSettings | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, settings: GenerationSettings):
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(classes="dialog"):
            yield Label("Generation settings", classes="dialog-title")
            with Grid(id="settings-grid"):
                yield Label("temperature")
                yield Input(str(s.temperature), id="temperature")
                yield Label("top-p")
                yield Input(str(s.top_p), id="top_p")
                yield Label("max tokens")
                yield Input(str(s.max_tokens), id="max_tokens")
            yield Label("", id="settings-error", classes="error-text")
            yield Label("Enter saves · Esc cancels", classes="dialog-hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        values = {i.id: i.value.strip() for i in self.query(Input)}
        try:
            try:
                temperature, top_p = float(values["temperature"]), float(values["top_p"])
            except ValueError:
                raise UsageError("temperature and top-p are numbers, like 0.7 and 0.95") from None
            try:
                max_tokens = int(values["max_tokens"])
            except ValueError:
                raise UsageError("max tokens is a whole number, like 1024") from None
            settings = GenerationSettings(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        except UsageError as e:
            self.query_one("#settings-error", Label).update(str(e))
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        self.dismiss(None)
