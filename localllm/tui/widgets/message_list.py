"""The scrolling list of messages. While its end is in view it follows new content down, the
way a terminal does; scrolling up stops that, scrolling back to the end starts it again."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.geometry import Size


class MessageList(VerticalScroll):
    def __init__(self, *children, **kwargs):
        super().__init__(*children, **kwargs)
        self.is_following = True

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        self.is_following = new_value >= self.max_scroll_y - 1

    def watch_virtual_size(self, old_size: Size, new_size: Size) -> None:
        if self.is_following and new_size.height != old_size.height:
            self.scroll_end(animate=False, immediate=True)

    def follow(self) -> None:
        """Show the end now and keep following it (a new turn, a resumed chat)."""
        self.is_following = True
        self.scroll_end(animate=False)
