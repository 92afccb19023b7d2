"""Tool calls in a model's answer, read the way its chat template's family writes them.

``family_for`` picks the family once from the template's source by the markers llama.cpp's
common_chat_templates_apply_jinja looks for; each follows llama.cpp's parser (chat-parser.cpp):

- ``hermes`` (``<tool_call>`` in the template: Qwen2.5, Hermes 2/3; Hermes 2 Pro's parser):
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (the closing tag may be missing),
  in a fenced ```json block or bare in the text; its other tags (``<function_call>``,
  ``<json>``...); ``<function=NAME>{arguments}</function>``, ``<function name="NAME">``.
- ``llama3`` (an ``ipython`` role or ``<|python_tag|>``): ``{"name": ..., "parameters": ...}``,
  after ``<|python_tag|>`` or not, several separated by ``;``.
- ``mistral`` (``[TOOL_CALLS]``): ``[TOOL_CALLS][{...}, ...]``, ``[TOOL_CALLS]NAME[ARGS]{...}``.
- ``generic`` (any other template, Gemma's too): the Generic envelopes ``{"tool_call": {...}}``
  and ``{"tool_calls": [...]}``, and call objects as above.

Every family reads ``<tool_call>`` blocks (tool_choice "required" forces one), fenced or bare
call objects and arrays of them. A call object's first key is "name" (llama.cpp's rule), its
name is an offered tool's, it has no keys but name, arguments (or parameters), id and type (a
tool's definition is not a call), and its arguments are an object or the JSON text of one,
kept as written. Anything else stays content as written: a block that is not a call, invalid
JSON, an unknown name. Whitespace after a call is dropped, as llama.cpp does; with calls,
content that is only whitespace is dropped too.

``ToolCallParser`` reads a stream: ``feed`` returns at once the content that cannot start a
call and the calls completed; text that may still become a call is held until it is known.
However the text is cut, the pieces add up to the same; ``parse_tool_calls`` feeds it once.
Nothing here raises on model output.

>>> parse_tool_calls('```json\\n{"name": "python", "arguments": {"code": "1"}}\\n```', {"python"})
('', [Call(name='python', arguments='{"code": "1"}')])
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Family:
    tags: tuple[str, ...]  # <tag> ... </tag> around calls
    first_keys: tuple[str, ...] = ("name",)  # the first key of a call object
    functions: bool = False  # <function=NAME>{arguments}</function>
    openers: tuple[str, ...] = ()  # markers before a run of calls: <|python_tag|>, [TOOL_CALLS]
    separators: str = r"\s*"  # what is dropped after a call


FAMILIES = {
    "hermes": Family(("tool_call", "function_call", "tool", "tools", "response", "json", "xml", "JSON"),
                     functions=True),
    "llama3": Family(("tool_call",), ("name", "type"), openers=("<|python_tag|>",), separators=r"[\s;]*"),
    "mistral": Family(("tool_call",), openers=("[TOOL_CALLS]",)),
    "generic": Family(("tool_call",), ("name", "tool_call", "tool_calls")),
}


# (marker in the template, family), in the order llama.cpp looks for them
_MARKERS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3"), ("<|start_header_id|>ipython", "llama3"),
            ("[TOOL_CALLS]", "mistral"))


def family_for(template_source: str | None) -> str:
    """The tool-call family of a chat template (its source text; None: no template)."""
    return next((family for marker, family in _MARKERS if marker in (template_source or "")), "generic")


_MORE = object()  # the text ends before it is known whether a call starts here
_START = re.compile(r"[`<{\[]")  # a call can start only at one of these
_WS = re.compile(r"\s*")
_JSON_TOKEN = re.compile(r'["{}\[\]]')
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OBJECT_HEAD = re.compile(r'\{\s*(?:"([^"\\]*)(?:(")\s*(?::\s*(?:"([^"\\]*)(")?)?)?)?)?')
_NAME = re.compile(r"[\w.-]*")
_FENCES = ("```json\n", "```xml\n", "```\n")


def _literal(text: str, i: int, literal: str, final: bool):
    """The end of ``literal`` at text[i]; _MORE when the text ends inside it; None otherwise."""
    if text.startswith(literal, i):
        return i + len(literal)
    rest = text[i:i + len(literal)]
    return _MORE if not final and len(rest) < len(literal) and literal.startswith(rest) else None


def _first(text: str, i: int, final: bool, alternatives):
    """(end, what) of the first (literal, what) of ``alternatives`` at text[i]; _MORE when one
    may still match; None otherwise."""
    ends = [(_literal(text, i, literal, final), what) for literal, what in alternatives]
    found = next(((end, what) for end, what in ends if end is not None and end is not _MORE), None)
    return found or (_MORE if any(end is _MORE for end, _ in ends) else None)


def _optional(text: str, i: int, literal: str, final: bool):
    """The end of ``literal`` after whitespace at text[i], or i when it is not there."""
    end = _literal(text, _WS.match(text, i).end(), literal, final)
    return i if end is None else end


def _json_at(text: str, i: int, final: bool):
    """(end, value) of the JSON object or array at text[i]; None when it is not valid JSON."""
    depth, start = 0, i
    while True:
        m = _JSON_TOKEN.search(text, i)  # the end by the brackets, then json.loads checks it
        if m is not None and m.group() == '"':  # a string: its brackets are text
            m = _STRING_REST.match(text, m.end())
            if m is not None:
                i = m.end()
                continue
        if m is None:
            return None if final else _MORE
        depth += 1 if m.group() in "{[" else -1
        i = m.end()
        if depth == 0:
            try:
                return i, json.loads(text[start:i])
            except (ValueError, RecursionError):
                return None


def _arguments(value) -> str | None:
    if value is None:
        return "{}"
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    parsed = _json_at(value, 0, True) if isinstance(value, str) and value.startswith("{") else None
    return value if parsed and parsed[0] == len(value) and isinstance(parsed[1], dict) else None


_CALL_KEYS = frozenset({"name", "arguments", "parameters", "id", "type"})


def _call(value, names: frozenset[str]) -> Call | None:
    """A call object; one with other keys (a tool's definition, with its description) is not."""
    if not isinstance(value, dict) or value.get("name") not in names or not _CALL_KEYS.issuperset(value):
        return None
    arguments = _arguments(value["arguments"] if "arguments" in value else value.get("parameters"))
    return None if arguments is None else Call(value["name"], arguments)


def _calls(value, names: frozenset[str]) -> list[Call] | None:
    """The calls a JSON value holds (a call, a list of calls, {"tool_call": call} or
    {"tool_calls": [calls]}); None unless each is a call of an offered tool."""
    if isinstance(value, dict) and "name" not in value:
        value = value["tool_calls"] if "tool_calls" in value else [value.get("tool_call")]
    items = value if isinstance(value, list) else [value]
    calls = [_call(v, names) for v in items]
    return calls if calls and None not in calls else None


class ToolCallParser:
    """Splits streamed answer text into content and tool calls (see the module's docstring)."""

    def __init__(self, tool_names, family: str = "generic") -> None:
        self.names = frozenset(tool_names)
        self.family = FAMILIES[family]
        self._after = re.compile(self.family.separators)
        self._openers = [(f"<{tag}>", f"</{tag}>") for tag in self.family.tags]
        self._openers += [(marker, "") for marker in self.family.openers]  # (opener, closer)
        self._held = ""  # text that may be the start of a call
        self._after_call = False  # dropping what follows a call
        self._blank = ""  # content so far, while it is only whitespace
        self._is_said = False  # some content other than whitespace was returned
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """(content, calls) that ``text`` completes."""
        return self._advance(self._held + text, final=False)

    def finish(self) -> tuple[str, list[Call]]:
        """(content, calls) of what was held, at the end of the answer."""
        return self._advance(self._held, final=True)

    def _advance(self, text: str, final: bool) -> tuple[str, list[Call]]:
        content: list[str] = []
        calls: list[Call] = []
        self._held, i = "", 0
        while i < len(text):
            if self._after_call:
                i = self._after.match(text, i).end()
                if i == len(text):
                    break
                self._after_call = False
            m = _START.search(text, i)
            j = m.start() if m else len(text)
            content.append(text[i:j])
            if m is None:
                break
            found = self._block(text, j, final)
            if found is _MORE:
                self._held = text[j:]
                break
            if found is None:
                content.append(text[j])
                i = j + 1
            else:
                i, new = found
                calls += new
                self._after_call = True
        self.num_calls += len(calls)
        return self._say("".join(content), final), calls

    def _say(self, content: str, final: bool) -> str:
        """Holds content while it is only whitespace: it is dropped when the answer has calls."""
        if self._is_said:
            return content
        content = self._blank + content
        if content.strip():
            self._is_said, self._blank = True, ""
            return content
        self._blank = "" if final else content
        return content if final and not self.num_calls else ""

    # -- what a call looks like -----------------------------------------------------------

    def _block(self, text: str, i: int, final: bool):
        """(end, calls) of the calls written at text[i]: [fence] [opener] item {item} [closer]
        [fence]; None when there are none; _MORE when the text ends before that is known."""
        k, close, is_fenced = i, "", text[i] == "`"
        if is_fenced:
            fenced = _first(text, i, final, ((fence, "") for fence in _FENCES))
            if not isinstance(fenced, tuple):
                return fenced
            k = _WS.match(text, fenced[0]).end()
        opened = _first(text, k, final, self._openers)
        if opened is _MORE:
            return _MORE
        if opened is not None:
            k, close = opened
        calls: list[Call] = []
        while True:
            j = _WS.match(text, k).end()
            if calls and j < len(text) and text[j] in ",;":
                j = _WS.match(text, j + 1).end()
            if j == len(text):
                if not final:
                    return _MORE
                break
            item = self._item(text, j, final)
            if item is _MORE:
                return _MORE
            if item is None:
                break
            k, new = item
            calls += new
            if not (is_fenced or opened):
                break  # a bare call stands alone
        if not calls:
            return None
        for closer in filter(None, (close, "```" if is_fenced else "")):
            k = _optional(text, k, closer, final)
            if k is _MORE:
                return _MORE
        return k, calls

    def _item(self, text: str, i: int, final: bool):  # one call, or a JSON array of them
        if text[i] in "{[":
            return self._json_calls(text, i, final)
        if text[i] == "<" and self.family.functions:
            return self._function(text, i, final)
        if "[TOOL_CALLS]" in self.family.openers:
            return self._named(text, i, final, _NAME.match(text, i).end(), "[ARGS]")
        return None

    def _json_calls(self, text: str, i: int, final: bool):
        """(end, calls) of a call object, or an array of them, at text[i]. Its first key (and
        name) are checked as soon as they are written, so plain JSON is let go early."""
        j = i
        if text[i] == "[":
            j = _WS.match(text, i + 1).end()
            if j == len(text):
                return None if final else _MORE
            if text[j] != "{":
                return None
        m = _OBJECT_HEAD.match(text, j)
        key, key_closed, name, name_closed = m.groups()
        if not key_closed or (key == "name" and not name_closed):  # cut short, or not a call's start
            written, options = (key or "", self.family.first_keys) if not key_closed else (name or "", self.names)
            could_grow = m.end() == len(text) and not final
            return _MORE if could_grow and any(o.startswith(written) for o in options) else None
        if key not in self.family.first_keys or (key == "name" and name not in self.names):
            return None
        found = _json_at(text, i, final)
        if not isinstance(found, tuple):
            return found
        calls = _calls(found[1], self.names)
        return None if calls is None else (found[0], calls)

    def _function(self, text: str, i: int, final: bool):
        """``<function=NAME>{arguments}</function>`` or ``<function name="NAME">...``."""
        k = _literal(text, i, "<function", final)
        if k is None or k is _MORE:
            return k
        form = _first(text, k, final, (("=", ">"), (' name="', '">')))
        if not isinstance(form, tuple):
            return form
        (start, tail), end = form, text.find(form[1], form[0])
        return self._named(text, start, final, end if end >= 0 else len(text), tail, "</function>")

    def _named(self, text: str, i: int, final: bool, name_end: int, after_name: str, closer: str = ""):
        """(end, [call]) of NAME (text[i:name_end]), ``after_name``, an arguments object and
        an optional ``closer``."""
        name = text[i:name_end]
        if name_end == len(text):  # the text may end inside the name or inside after_name
            return _MORE if not final and any((n + after_name).startswith(name) for n in self.names) else None
        k = _literal(text, name_end, after_name, final) if name in self.names else None
        if k is None or k is _MORE:
            return k
        k = _WS.match(text, k).end()
        if k == len(text) or text[k] != "{":
            return _MORE if k == len(text) and not final else None
        found = _json_at(text, k, final)
        if not isinstance(found, tuple) or not isinstance(found[1], dict):
            return found if found is _MORE else None
        end = _optional(text, found[0], closer, final) if closer else found[0]
        return _MORE if end is _MORE else (end, [Call(name, json.dumps(found[1], ensure_ascii=False))])


def parse_tool_calls(text: str, tool_names, family: str = "generic") -> tuple[str, list[Call]]:
    """(content, calls) of a whole answer; content is the text unchanged when it has no call."""
    parser = ToolCallParser(tool_names, family)
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    return content + rest, calls + more
