"""The reasoning split: a thinking model's output as (reasoning, content).

Thinking models (Qwen3, the DeepSeek-R1 distills) write their reasoning in a block before
the answer::

    <think>
    Okay, the user asks ...
    </think>

    The answer is 4.

Which text is which, both for the whole text (``split_reasoning``) and for a stream
(``ReasoningParser``, same answer however the text is cut):

- Only a block at the start of the output is reasoning: the start marker may follow
  whitespace, nothing else. A model that skips the block gives everything as content, and a
  ``<think>`` written later (text before it, or after the block) is content as written.
- When the prompt already opened the block (``starts_inside``: the R1 distills end their
  generation prompt with ``<think>\\n``) the output begins as reasoning; a repeated start
  marker right at the start is dropped.
- A block never closed (generation stopped while thinking) is all reasoning.
- Whitespace at the start of the reasoning and of the content is dropped (Qwen3 writes
  ``<think>\\n`` and ``</think>\\n\\n``); everything else is kept as written.
- Reasoning is None when there is none: no block, or only whitespace in it.

The stream holds back only text that may be the start of a marker, at most
``len(marker) - 1`` characters; leading whitespace is dropped as it comes, not held.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningMarkers:
    start: str  # "<think>"
    end: str  # "</think>"
    starts_inside: bool  # the rendered prompt already opened the block


# The marker pairs of the thinking families localllm knows, looked up in the chat template.
_KNOWN_MARKERS = (("<think>", "</think>"),)


def reasoning_markers(chat_template: str | None, rendered_prompt_tail: str = "") -> ReasoningMarkers | None:
    """The markers of a thinking model, or None for a template that does not think.

    A template thinks when its text holds both markers (Qwen3's and the R1 distills' write
    ``<think>`` and strip ``</think>`` blocks from past turns). ``rendered_prompt_tail`` is the
    end of the rendered generation prompt (any length; only its end is read):
    ``starts_inside`` is True when it ends with the start marker, whitespace aside, as the R1
    distills' ``<｜Assistant｜><think>\\n`` does. Qwen3 with ``enable_thinking=False`` ends its
    prompt with an empty, closed block (``<think>\\n\\n</think>\\n\\n``): starts_inside is
    False, and the model then writes plain content.
    """
    if not chat_template:
        return None
    tail = rendered_prompt_tail.rstrip()
    for start, end in _KNOWN_MARKERS:
        if start in chat_template and end in chat_template:
            return ReasoningMarkers(start, end, starts_inside=tail.endswith(start))
    return None


def split_reasoning(text: str, markers: ReasoningMarkers) -> tuple[str | None, str]:
    """The whole output as (reasoning, content); see the module's docstring for the rules.

    >>> split_reasoning("<think>\\nhmm\\n</think>\\n\\nHi", ReasoningMarkers("<think>", "</think>", False))
    ('hmm\\n', 'Hi')
    """
    rest = text.lstrip()
    if rest.startswith(markers.start):
        rest = rest[len(markers.start):]
    elif not markers.starts_inside:
        return None, rest
    reasoning, _, content = rest.partition(markers.end)
    return reasoning.lstrip() or None, content.lstrip()


_OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"


class ReasoningParser:
    """Splits streamed model text into (reasoning, content).

    ``feed`` returns the deltas safe to emit now; ``finish`` flushes what was held back. The
    deltas joined equal ``split_reasoning`` of the whole text (None as "").
    """

    def __init__(self, markers: ReasoningMarkers) -> None:
        self._markers = markers
        self._state = _OPENING
        self._drops_whitespace = True  # at the start of the reasoning or the content
        self._held = ""  # a possible marker start, never longer than the marker less one

    def feed(self, text: str) -> tuple[str, str]:
        return self._advance(self._held + text, is_final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(self._held, is_final=True)

    def _advance(self, text: str, is_final: bool) -> tuple[str, str]:
        start, end = self._markers.start, self._markers.end
        reasoning, content = "", ""
        self._held = ""
        while text:
            if self._drops_whitespace:
                text = text.lstrip()
                if not text:
                    break
            if self._state == _OPENING:
                if text.startswith(start):
                    text = text[len(start):]
                    self._state = _REASONING
                elif start.startswith(text) and not is_final:
                    self._held = text
                    break
                else:  # no start marker: inside the block the prompt opened, or content
                    self._state = _REASONING if self._markers.starts_inside else _CONTENT
                continue
            self._drops_whitespace = False
            if self._state == _CONTENT:
                content += text
                break
            i = text.find(end)
            if i >= 0:
                reasoning += text[:i]
                text = text[i + len(end):]
                self._state, self._drops_whitespace = _CONTENT, True
                continue
            num_held = 0 if is_final else _num_marker_prefix(text, end)
            reasoning += text[: len(text) - num_held]
            self._held = text[len(text) - num_held:]
            break
        return reasoning, content


def _num_marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of text that is a proper start of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def markers_for(tokenizer, prompt_ids: list[int]) -> ReasoningMarkers | None:
    """How the answer to a chat prompt (``tokenizer``'s chat template, rendered and tokenized
    as ``prompt_ids``) marks its reasoning; None when the template does not think. The
    prompt's last tokens say whether it already opened the block (the R1 distills)."""
    template = getattr(tokenizer, "template_source", None)
    if reasoning_markers(template) is None:
        return None
    return reasoning_markers(template, tokenizer.decode(prompt_ids[-8:]))


class Answer:
    """An answer's text as it streams, split into reasoning and content (all content when the
    template does not think): ``feed`` each piece, ``finish`` at the end; ``split`` a whole text."""

    def __init__(self, markers: ReasoningMarkers | None):
        self.markers = markers
        self._parser = ReasoningParser(markers) if markers is not None else None

    def feed(self, text: str) -> tuple[str, str]:
        return self._parser.feed(text) if self._parser is not None else ("", text)

    def finish(self) -> tuple[str, str]:
        return self._parser.finish() if self._parser is not None else ("", "")

    def split(self, text: str) -> tuple[str | None, str]:
        return split_reasoning(text, self.markers) if self.markers is not None else (None, text)
