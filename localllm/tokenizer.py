"""Tokenize, detokenize as a stream, and render the model's chat template.

The runner hands a ``Vocab`` (the model file's vocabulary); nothing here imports llama_cpp,
so all of it is tested without a model.
"""

from __future__ import annotations

import codecs
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

from jinja2 import Template
from jinja2.exceptions import SecurityError, TemplateSyntaxError

from localllm import chat_template
from localllm.chat_template import SandboxEnvironment, TemplateLimitError
from localllm.errors import NoChatTemplateError, TemplateError, UsageError


class Vocab(Protocol):
    """What a runner exposes of the model's vocabulary (llama.cpp's, for the llamacpp runner)."""

    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    add_bos: bool  # the model wants BOS prepended to a plain prompt
    bos_text: str  # e.g. "<bos>"; "" when there is none
    eos_text: str
    chat_template: str | None  # the GGUF's tokenizer.chat_template: untrusted Jinja
    fim_pre_id: int | None  # fill-in-the-middle control tokens; None when the model has none
    fim_suf_id: int | None
    fim_mid_id: int | None

    def tokenize(self, text: bytes, add_special: bool, parse_special: bool) -> list[int]: ...

    def token_to_piece(self, token_id: int) -> bytes: ...  # control tokens give b""

    def is_eog(self, token_id: int) -> bool: ...  # end of generation: EOS, EOT, <|im_end|>...

    # Optional: the texts of user-defined tokens, which the tokenizer matches even in plain
    # text (Qwen's <tool_call>); see Tokenizer._plain.
    # def user_defined_texts(self) -> tuple[str, ...]: ...

    # Optional: a token's text with control tokens' own text (b"<|im_end|>", where
    # token_to_piece gives b""); see Tokenizer.piece.
    # def special_piece(self, token_id: int) -> bytes: ...

    # For grammars (engine/constraint.py): special_piece above, and the control tokens' ids.
    # def control_ids(self) -> list[int]: ...


# A span of rendered chat text and whether it came from a message's content (never parsed
# for control tokens) rather than from the template (parsed).
_Span = tuple[str, bool]


class Tokenizer:
    """Text <-> token ids for one model, and its chat template.

    ``name`` only labels error messages; ``chat_template`` replaces the one in the GGUF. The
    template compiles here, at model load; one that does not compile leaves
    ``template_error`` set, and every chat fails with it (plain prompts still work).
    ``render_timeout_s`` and ``max_template_chars`` bound each render (chat_template.py).
    """

    def __init__(self, vocab: Vocab, name: str = "", chat_template: str | None = None, *,
                 render_timeout_s: float = chat_template.DEFAULT_TIMEOUT_S,
                 max_template_chars: int = chat_template.DEFAULT_MAX_CHARS) -> None:
        self._vocab = vocab
        self._what = f"model {name!r}" if name else "this model"
        self._template_source = chat_template if chat_template is not None else vocab.chat_template
        self._template: Template | None = None
        self._render_timeout_s = render_timeout_s
        self._max_chars = max_template_chars
        self.template_error: TemplateError | None = None
        self._markup_texts: tuple[str, ...] | None = None
        if self._template_source:
            try:
                self._compiled_template()
            except TemplateError as e:
                self.template_error = e

    @property
    def n_vocab(self) -> int:
        return self._vocab.n_vocab

    @property
    def bos_id(self) -> int | None:
        return self._vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self._vocab.eos_id

    def is_eog(self, token_id: int) -> bool:
        return self._vocab.is_eog(token_id)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """A plain prompt. Control-token text in it (``<|im_end|>``, ``<tool_call>``) stays plain
        text: unlike llama-server, localllm never reads control tokens out of a prompt's text;
        send token ids for those (the one layout read is the FIM template: encode_fim_layout)."""
        return self._plain(_utf8(text, "the prompt"), add_special)

    def encode_fim(self, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (), middle: str = "",
                   max_tokens: int | None = None) -> list[int]:
        """A fill-in-the-middle prompt: ``<fim_pre> prefix middle <fim_suf> suffix <fim_mid>``;
        the model then writes on from ``middle`` (text already typed at the cursor). ``extra``
        are other files as (filename, text), put before it as llama.cpp's /infill does
        (``<|repo_name|>``, then ``<|file_sep|>filename`` and text per file, where the
        vocabulary has them; else between "--- snippet ---" lines). With ``max_tokens`` the
        prompt is cut to fit as llama.cpp cuts it: 3/4 of the room to the end of the prefix,
        1/4 to the start of the suffix, the extra files into what is left (the last ones kept).
        Control-token text anywhere stays plain."""
        v = self._vocab
        if v.fim_pre_id is None or v.fim_suf_id is None or v.fim_mid_id is None:
            raise UsageError(
                f"{self._what} has no fill-in-the-middle tokens; use a code model trained for "
                "it (such as qwen2.5-coder) or send a plain prompt"
            )
        pre = self._plain(_utf8(prefix, "the prefix"))
        mid = self._plain(_utf8(middle, "the prompt"))
        suf = self._plain(_utf8(suffix, "the suffix"))
        sep, rep = getattr(v, "fim_sep_id", None), getattr(v, "fim_rep_id", None)
        context: list[int] = []
        if extra:
            if rep is not None:
                context += [rep, *self._plain(b"project\n")]
            for filename, text in extra:
                if sep is not None:
                    context += [sep, *self._plain(_utf8(filename + "\n", "a filename"))]
                else:
                    context += self._plain(b"\n\n--- snippet ---\n\n")
                context += self._plain(_utf8(text, "an extra file"))
            if sep is not None:
                context += [sep, *self._plain(b"filename\n")]
        bos = [v.bos_id] if v.add_bos and v.bos_id is not None else []
        if max_tokens is not None:
            room = max_tokens - len(bos) - len(mid) - 3
            if room < 1:
                raise UsageError(f"the prompt at the cursor is {len(mid)} tokens, more than the "
                                 f"{max_tokens} the context leaves for the fill-in-the-middle prompt")
            suf = suf[:max(0, min(len(suf), room // 4))]
            pre = pre[max(0, len(pre) - (room - len(suf))):]
            room -= len(pre) + len(suf)
            context = context[len(context) - min(len(context), room):] if room > 0 else []
        return [*context, *bos, v.fim_pre_id, *pre, *mid, v.fim_suf_id, *suf, v.fim_mid_id]

    def encode_fim_layout(self, text: str) -> list[int] | None:
        """A plain prompt laid out as this model's fill-in-the-middle template, as editors that
        know the template send it to /v1/completions (Continue's autocomplete:
        ``<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>``, other files before it
        after ``<|repo_name|>`` and ``<|file_sep|>``): the model's FIM markers read as the
        tokens they name and every part between them plain, as encode_fim reads its parts (an
        ``<|im_start|>`` in the code stays text). None unless the text holds the prefix
        marker, then the suffix marker, and ends with the middle marker: encode reads any
        other prompt all plain."""
        v = self._vocab
        ids = [v.fim_pre_id, v.fim_suf_id, v.fim_mid_id]
        if None in ids:
            return None
        pre, suf, mid = (self.piece(t, special=True).decode("utf-8", "replace") for t in ids)
        start = text.find(pre) if pre else -1
        if start < 0 or not mid or not text.endswith(mid) or text.find(suf, start + len(pre)) < 0 or not suf:
            return None
        markers = {pre: v.fim_pre_id, suf: v.fim_suf_id, mid: v.fim_mid_id}
        for t in (getattr(v, "fim_rep_id", None), getattr(v, "fim_sep_id", None)):
            if t is not None and (name := self.piece(t, special=True).decode("utf-8", "replace")):
                markers[name] = t
        out: list[int] = []
        for part in re.split("(" + "|".join(map(re.escape, sorted(markers, key=len, reverse=True))) + ")", text):
            if part in markers:
                if markers[part] == v.fim_pre_id and v.add_bos and v.bos_id is not None:
                    out.append(v.bos_id)  # where encode_fim puts it
                out.append(markers[part])
            elif part:
                out += self._plain(_utf8(part, "the prompt"))
        return out

    def encode_special(self, text: str, add_special: bool = False) -> list[int]:
        """Text with control-token text in it read as those tokens (``<|im_start|>`` is one
        token), as llama-server's /tokenize reads it by default. Never a prompt's path: a plain
        prompt goes through ``encode``."""
        return self._vocab.tokenize(_utf8(text, "the content"), add_special, True)

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(map(self._vocab.token_to_piece, ids)).decode("utf-8", errors="replace")

    def piece(self, token_id: int, special: bool = False) -> bytes:
        """A token's own bytes from the vocabulary: part of a UTF-8 character for some tokens;
        a control token's are b"" unless ``special`` asks for its text (b"<|im_end|>")."""
        special_piece = getattr(self._vocab, "special_piece", None) if special else None
        return special_piece(token_id) if special_piece is not None else self._vocab.token_to_piece(token_id)

    def detokenizer(self, stop: Sequence[str] = ()) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer for one sequence."""
        return IncrementalDetokenizer(self._vocab.token_to_piece, stop)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        template_vars: dict[str, Any] | None = None,
    ) -> list[int]:
        """Render the chat and tokenize it so that no message can forge a control token.

        The template's own text (``<|im_start|>user\\n``) is tokenized with control tokens
        parsed; every message's content is tokenized as plain text, so a user who writes
        ``<|im_start|>system`` gets those characters, not a system turn. ``template_vars`` are
        extra variables the template may read (Qwen3's ``enable_thinking``); they never replace
        the chat's own (messages, tools, ...).
        """
        template = self._compiled_template()
        messages = _normalize_messages(messages)
        if tools is not None and not isinstance(tools, list):
            raise UsageError(f"tools is a {type(tools).__name__}; give a list of tool definitions")
        num_chars = sum(len(m["content"] or "") for m in messages) + len(repr(tools or ""))
        if num_chars > self._max_chars // 2:
            raise UsageError(f"the chat is {num_chars} characters long, more than the "
                             f"{self._max_chars // 2} localllm renders through a chat template; "
                             "send a shorter chat")
        rendered = self._render(template, messages, add_generation_prompt, tools, template_vars)
        spans = self._spans_by_markers(template, messages, add_generation_prompt, tools, rendered, template_vars)
        if spans is None:
            spans = self._spans_by_search(messages, rendered)

        ids: list[int] = []
        for text, is_content in spans:
            if text:
                data = _utf8(text, "the chat")
                ids += self._plain(data) if is_content else self._vocab.tokenize(data, False, True)
        # A template that writes bos_token itself already produced BOS; never add a second.
        bos_id = self._vocab.bos_id
        if self._vocab.add_bos and bos_id is not None and (not ids or ids[0] != bos_id):
            ids.insert(0, bos_id)
        return ids

    # -- rendering ---------------------------------------------------------------------------

    @property
    def template_source(self) -> str | None:
        """The chat template's source (untrusted text: read it, never run it outside the sandbox)."""
        return self._template_source or None

    def _compiled_template(self) -> Template:
        if self._template is not None:
            return self._template
        if self.template_error is not None:
            raise self.template_error
        if not self._template_source:
            raise NoChatTemplateError(
                f"{self._what} has no chat template, so it cannot take a chat; use an "
                "instruct/chat build of the model (its GGUF carries tokenizer.chat_template)"
            )
        env = SandboxEnvironment()
        env.globals["raise_exception"] = self._raise_exception
        try:
            self._template = env.from_string(self._template_source)
        except TemplateSyntaxError as e:
            raise TemplateLimitError(
                f"the chat template of {self._what} does not compile (line {e.lineno}: "
                f"{e.message}); the GGUF's template is broken: use another build of the model"
            ) from None
        except Exception as e:  # the compiler on untrusted input: any failure is the template's
            raise TemplateLimitError(
                f"the chat template of {self._what} does not compile ({type(e).__name__}: {e}); "
                "the GGUF's template is broken: use another build of the model"
            ) from None
        return self._template

    def _raise_exception(self, message: object) -> NoReturn:
        raise TemplateError(f"the chat template of {self._what} refused the chat: {message}")

    def _render(
        self,
        template: Template,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[Any] | None,
        template_vars: dict[str, Any] | None = None,
    ) -> str:
        context = {**(template_vars or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
                   "tools": tools, "bos_token": self._vocab.bos_text, "eos_token": self._vocab.eos_text}
        try:
            return chat_template.render(template, context, timeout_s=self._render_timeout_s,
                                        max_chars=self._max_chars)
        except TemplateLimitError as e:
            raise TemplateLimitError(
                f"the chat template of {self._what} was stopped: {e}; do not trust this GGUF's "
                "template: use another build of the model"
            ) from None
        except TemplateError:
            raise  # raise_exception(): the template's own words
        except (SecurityError, RecursionError, MemoryError) as e:
            raise TemplateLimitError(
                f"the chat template of {self._what} tried an unsafe operation and was stopped "
                f"({type(e).__name__}: {e}); do not trust this GGUF's template: use another "
                "build of the model"
            ) from None
        except Exception as e:  # the template is untrusted code: any failure is its failure
            raise TemplateError(
                f"the chat template of {self._what} failed: {type(e).__name__}: {e}; check that "
                "the messages have the roles and order it expects (often system first, then "
                "alternating user/assistant), or use another build of the model"
            ) from None

    # -- splitting the rendered chat into template text and content --------------------------

    def _spans_by_markers(
        self,
        template: Template,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[Any] | None,
        rendered: str,
        template_vars: dict[str, Any] | None = None,
    ) -> list[_Span] | None:
        """Exact split: render again with a random marker in place of each content.

        The markers show where the template put each content; substituting the real contents
        back must give ``rendered`` exactly, else (the template rewrote content or branched on
        it) this returns None. Each marker keeps its content's own leading/trailing whitespace,
        so a template that trims content (Llama 3 does) still splits exactly.
        """
        nonce = secrets.token_hex(8)
        parts: dict[str, tuple[str, str, str]] = {}  # marker -> (lead, core, trail) of a content
        marked_messages = []
        for i, message in enumerate(messages):
            content = message["content"]
            core = content.strip() if content else ""
            if not core:  # whitespace cannot hold a control token: nothing to protect
                marked_messages.append(message)
                continue
            start = len(content) - len(content.lstrip())
            end = start + len(core)
            marker = f"LOCALLLM{nonce}M{i}E"
            parts[marker] = (content[:start], core, content[end:])
            marked_messages.append({**message, "content": content[:start] + marker + content[end:]})
        if not parts:
            return [(rendered, False)]
        try:
            marked = self._render(template, marked_messages, add_generation_prompt, tools, template_vars)
        except TemplateLimitError:
            raise
        except TemplateError:
            return None

        spans: list[_Span] = []
        pos = 0
        for match in re.finditer(f"LOCALLLM{nonce}M[0-9]+E", marked):
            lead, core, trail = parts[match.group()]
            before, content = marked[pos : match.start()], core
            if lead and before.endswith(lead):  # the template kept the content's whitespace
                before, content = before[: -len(lead)], lead + content
            pos = match.end()
            if trail and marked.startswith(trail, pos):
                content, pos = content + trail, pos + len(trail)
            spans += [(before, False), (content, True)]
        spans.append((marked[pos:], False))
        if "".join(text for text, _ in spans) != rendered:
            return None
        return spans

    def _spans_by_search(self, messages: list[dict[str, Any]], rendered: str) -> list[_Span]:
        """Fallback split for a template that rewrites or branches on content.

        Only contents holding control-token text need protecting; each must appear verbatim
        (or trimmed), in order, and unambiguously, or the chat is refused. Other contents are
        tokenized with the template text around them.
        """
        risky = [
            (i, m["content"]) for i, m in enumerate(messages)
            if m["content"] and self._has_control_text(m["content"])
        ]
        spans: list[_Span] = []
        cursor = 0
        for k, (i, content) in enumerate(risky):
            needle = content if rendered.find(content, cursor) >= 0 else content.strip()
            start = rendered.find(needle, cursor)
            if start < 0:
                raise TemplateError(
                    f"the chat template of {self._what} rewrites message {i}'s content, which "
                    "contains control-token text; to keep it from being read as control tokens "
                    "localllm refuses the chat: remove that text from the message"
                )
            # More occurrences than the remaining contents explain: the template's own text
            # holds the same string, and there is no telling which one is the message.
            if rendered.count(needle, cursor) > sum(needle in c for _, c in risky[k:]):
                raise TemplateError(
                    f"message {i}'s content contains control-token text that the chat template "
                    f"of {self._what} also writes itself, and the template changes the message "
                    "so localllm cannot tell them apart: remove that text from the message"
                )
            spans += [(rendered[cursor:start], False), (needle, True)]
            cursor = start + len(needle)
        spans.append((rendered[cursor:], False))
        return spans

    def _has_control_text(self, text: str) -> bool:
        data = _utf8(text, "the chat")
        return (self._vocab.tokenize(data, False, True) != self._vocab.tokenize(data, False, False)
                or any(m.encode() in data for m in self._markup()))

    def _markup(self) -> tuple[str, ...]:
        """User-defined tokens that are the chat's markup, not text: written by the chat
        template and not whitespace (Qwen's ``<tool_call>``; not Gemma's ``<table>`` or
        newline runs, which are text). llama.cpp matches them even in plain text, so _plain
        breaks them up."""
        if self._markup_texts is None:
            texts = getattr(self._vocab, "user_defined_texts", lambda: ())()
            source = self._template_source or ""
            self._markup_texts = tuple(t for t in texts if t.strip() and t in source)
        return self._markup_texts

    def _plain(self, data: bytes, add_special: bool = False) -> list[int]:
        """Tokens of data as plain text: control tokens are never parsed, and each markup
        token's text is split after its first character (``<`` + ``tool_call>``), so the text
        round-trips but never becomes the token."""
        cuts = sorted({i + len(m[0].encode()) for m in self._markup() for i in _find_all(data, m.encode())})
        if not cuts:
            return list(self._vocab.tokenize(data, add_special, False))
        v = self._vocab
        ids: list[int] = [v.bos_id] if add_special and v.add_bos and v.bos_id is not None else []
        for start, end in zip([0, *cuts], [*cuts, len(data)]):
            if start < end:
                ids += self._vocab.tokenize(data[start:end], False, False)
        return ids


def _find_all(data: bytes, needle: bytes) -> list[int]:
    found, i = [], data.find(needle)
    while i >= 0:
        found.append(i)
        i = data.find(needle, i + 1)
    return found


def _utf8(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise UsageError(f"{what} is a {type(text).__name__}, not text")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(
            f"{what} is not valid Unicode ({e.reason} at character {e.start}); "
            "send text without lone surrogates"
        ) from None


def _normalize_messages(messages: object) -> list[dict[str, Any]]:
    """Check the chat's shape; copy each message with its content as one string (or None)."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(
            "messages must be a non-empty list of {'role': ..., 'content': ...} objects"
        )
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UsageError(
                f"message {i} is a {type(message).__name__}; each message must be an object "
                "with 'role' and 'content'"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise UsageError(
                f"message {i} has no 'role'; give it one, such as 'system', 'user' or 'assistant'"
            )
        content = message.get("content")
        if content is None:
            if role != "assistant" or not message.get("tool_calls"):
                raise UsageError(
                    f"message {i} ({role}) has no 'content'; only an assistant message with "
                    "tool_calls may leave it out: give it text"
                )
        elif isinstance(content, list):
            content = _join_text_parts(content, i)
        elif not isinstance(content, str):
            raise UsageError(
                f"message {i} content is a {type(content).__name__}; give a string or a list "
                "of {'type': 'text', 'text': ...} parts"
            )
        normalized.append({**message, "content": content})
    return normalized


def _join_text_parts(parts: list[Any], i: int) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UsageError(
                f"message {i} content part {j} is {kind!r}; only "
                "{'type': 'text', 'text': ...} parts are supported"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise UsageError(f"message {i} content part {j} has no 'text' string; give one")
        texts.append(text)
    return "".join(texts)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text that is safe to show, for one sequence.

    It never emits half a UTF-8 character, and it holds back the tail of the text that could
    be the start of a stop string. With ``stop=("</s>",)``, pieces "Hi", "</", "s>" give
    "Hi", "", "" and then ``stop_matched == "</s>"``; pieces "Hi", "</", "b>" give "Hi", "",
    "</b>". Each add() costs O(len(longest stop string)**2 * len(stop)), never O(len(text)).
    """

    def __init__(self, piece: Callable[[int], bytes], stop: Sequence[str] = ()) -> None:
        if isinstance(stop, str):
            stop = (stop,)  # one stop string, not its characters
        for s in stop:
            if not isinstance(s, str) or not s:
                raise UsageError(
                    f"stop string {s!r} is invalid; stop strings must be non-empty text"
                )
        self._piece = piece
        self._stops = tuple(dict.fromkeys(stop))
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded, not released: may be the start of a stop string
        self._released: list[str] = []
        self.stop_matched: str | None = None

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self._released)

    def add(self, token_id: int) -> str:
        """Feed one token; return the text newly safe to show (often "")."""
        if self.stop_matched is not None:
            return ""
        return self._push(self._decoder.decode(self._piece(token_id), final=False), final=False)

    def flush(self) -> str:
        """End of generation without a stop: release everything held back."""
        if self.stop_matched is not None:
            return ""
        return self._push(self._decoder.decode(b"", final=True), final=True)

    def _push(self, new_text: str, final: bool) -> str:
        # _held never contains a whole stop string, so any match overlaps new_text.
        window = self._held + new_text
        match = self._first_stop(window)
        if match is not None:
            start, self.stop_matched = match
            self._held = ""
            return self._release(window[:start])
        num_held = 0 if final else self._num_stop_prefix_chars(window)
        self._held = window[len(window) - num_held :]
        return self._release(window[: len(window) - num_held])

    def _first_stop(self, window: str) -> tuple[int, str] | None:
        """The stop string that completes first in the window (then the one starting first):
        the one a token-by-token stream would have hit first."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = window.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _num_stop_prefix_chars(self, window: str) -> int:
        """Length of the longest tail of the window that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(window)), longest, -1):
                if window.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, text: str) -> str:
        if text:
            self._released.append(text)
        return text
