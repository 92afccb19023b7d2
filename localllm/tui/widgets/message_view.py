"""One message of the chat: who said it, the text as Markdown, and how the answer went."""

from __future__ import annotations

import re

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Label, Markdown, Static

_FENCE = re.compile(r"^(`{3,}|~{3,})[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)


def code_blocks(markdown: str) -> list[str]:
    """The fenced code blocks of a Markdown text, in order; an unclosed last fence counts
    (an answer stopped in the middle of its code)."""
    matches = list(_FENCE.finditer(markdown))
    blocks = [m.group(2) for m in matches]
    tail = markdown[matches[-1].end():] if matches else markdown
    m = re.search(r"^(`{3,}|~{3,})[^\n]*\n(.*)\Z", tail, re.S | re.M)
    if m:
        blocks.append(m.group(2))
    return blocks


def describe(stats: dict) -> str:
    """An answer's figures in one line: 'TTFT 120 ms · 61.5 tok/s · 42 tokens'."""
    parts = []
    if stats.get("ttft") is not None:
        parts.append(f"TTFT {stats['ttft'] * 1000:.0f} ms")
    if stats.get("tokens_per_s") is not None:
        parts.append(f"{stats['tokens_per_s']:.1f} tok/s")
    if stats.get("tokens"):
        parts.append(f"{stats['tokens']} tokens")
    if stats.get("prompt_tokens") is not None:
        cached = stats.get("cached_tokens")
        parts.append(f"prompt {stats['prompt_tokens']}" + (f" ({cached} cached)" if cached is not None else ""))
    return " · ".join(parts)


class MessageView(Vertical):
    """A user or assistant message. An assistant message streams in through ``append``."""

    def __init__(self, role: str, content: str = "", *, stopped: bool = False, excluded: bool = False,
                 stats: dict | None = None, error: str | None = None, message_id: int | None = None):
        super().__init__(classes=f"message {role}")
        self.role = role
        self.content = content if error is None else error  # an error or notice: its text
        self.message_id = message_id
        self._stopped = stopped
        self._stats = stats or {}
        self._error = error
        self._stream = None
        self._pending = ""
        self.reasoning = ""  # a thinking model's reasoning: shown dimmed, folded, never in content
        self._reasoning_shown = ""
        if excluded:
            self.add_class("excluded")

    def compose(self) -> ComposeResult:
        yield Label(self._heading(), classes="heading")
        if self._error is not None:
            yield Label(self._error, classes="error-text", markup=False)
        else:
            yield Markdown(self.content, classes="body")
        yield Label(self._footer(), classes="footer")

    def _heading(self) -> str:
        names = {"user": "You", "assistant": "Assistant", "error": "Error", "notice": "localllm"}
        text = names.get(self.role, self.role)
        if self.has_class("excluded"):
            text += "  [dim](dropped from the context)[/dim]"
        return text

    def _footer(self) -> str:
        parts = []
        if self._stopped:
            parts.append("[b]■ stopped[/b]")
        if self._stats and self.role == "assistant":
            parts.append(describe(self._stats))
            reason = self._stats.get("finish_reason")
            if reason == "length":
                parts.append("cut at the token limit")
        return "  ".join(parts)

    def add(self, text: str, reasoning: str = "") -> None:
        """Take more of the answer (and of its reasoning); it reaches the screen at the next ``flush``."""
        self.content += text
        self._pending += text
        self.reasoning += reasoning

    async def flush(self) -> None:
        """Render what came since the last flush (Markdown re-renders its last block); the
        reasoning goes into a folded "Thinking" section above the answer."""
        if self.reasoning != self._reasoning_shown:
            self._reasoning_shown = self.reasoning
            folds = self.query(".reasoning-fold")
            if folds:
                folds.first(Collapsible).query_one(".reasoning", Static).update(self.reasoning)
            else:
                fold = Collapsible(Static(self.reasoning, classes="reasoning", markup=False), title="Thinking",
                                   collapsed=True, classes="reasoning-fold")
                await self.mount(fold, before=self.query_one(".body"))
        if not self._pending:
            return
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        text, self._pending = self._pending, ""
        await self._stream.write(text)

    async def finish(self, stats: dict, stopped: bool) -> None:
        await self.flush()
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self._stats, self._stopped = stats, stopped
        self.set_class(stopped, "stopped")
        self.query_one(".footer", Label).update(self._footer())

    def set_excluded(self) -> None:
        self.add_class("excluded")
        self.query_one(".heading", Label).update(self._heading())
