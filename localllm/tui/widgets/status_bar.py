"""The bottom line: what the engine is doing and how the current answer goes."""

from __future__ import annotations

from rich.cells import cell_len
from textual.widgets import Static

from localllm.tui.backend import EngineFigures, Figures


def _fmt_int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _fmt_threads(threads: int, threads_max: int) -> str:
    """'2 threads'; '1/2 threads' while the load of the machine leaves fewer than the most."""
    count = f"{threads}/{threads_max}" if threads < threads_max else f"{threads}"
    return f"{count} thread{'' if threads_max == 1 else 's'}"


class StatusBar(Static):
    def __init__(self, **kwargs):
        super().__init__("", markup=False, **kwargs)  # one line, fixed height: a repaint, never a layout
        self.state = "starting"  # loading | ready | answering | warming | error
        self.model = ""
        self.answer: dict = {}  # the current or last answer's figures (Figures.to_dict())
        self.engine: EngineFigures | None = None

    def set_state(self, state: str, model: str | None = None) -> None:
        self.state = state
        if model is not None:
            self.model = model
        self.refresh_text()

    def set_answer(self, figures: Figures | dict) -> None:
        self.answer = figures.to_dict() if isinstance(figures, Figures) else dict(figures)
        self.refresh_text()

    def set_engine(self, engine: EngineFigures | None) -> None:
        self.engine = engine
        self.refresh_text()

    def render_text(self, width: int | None = None) -> str:
        """The line; with a width, the parts that do not fit left out from the end (whole, so
        no figure is shown cut short: "KV 0% of 2,0")."""
        a = self.answer
        ttft = f"{a['ttft'] * 1000:.0f} ms" if a.get("ttft") is not None else "-"
        speed = f"{a['tokens_per_s']:.1f}" if a.get("tokens_per_s") is not None else "-"
        model = self.model.removesuffix(".gguf") or "no model"
        if len(model) > 32:
            model = model[:31] + "…"
        parts = [f"{model} · {self.state}",
                 f"TTFT {ttft}", f"{speed} tok/s"]
        if a.get("draft_proposed"):  # only answers that drafted (on the local engine)
            parts.append(f"draft {a['draft_accepted']:,}/{a['draft_proposed']:,}")
        parts.append(f"prompt {_fmt_int(a.get('prompt_tokens'))} / cached {_fmt_int(a.get('cached_tokens'))}")
        if self.engine is not None and self.engine.kv_total:
            e = self.engine
            parts.append(f"KV {100 * e.kv_used / e.kv_total:.0f}% of {e.kv_total:,}")
        else:
            parts.append("KV -")
        if self.engine is not None and self.engine.threads:
            parts.append(_fmt_threads(self.engine.threads, self.engine.threads_max))
        while width and len(parts) > 1 and cell_len(" │ ".join(parts)) > width:
            parts.pop()
        return " │ ".join(parts)

    def render(self) -> str:
        return self.render_text(self.content_size.width)

    def refresh_text(self) -> None:
        self.refresh()  # not update(): that would lay the whole screen out again
