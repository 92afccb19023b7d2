"""The sandbox a GGUF's chat template (untrusted Jinja) renders in.

Three fences, each raising TemplateLimitError (or jinja2's SecurityError, which the tokenizer
turns into one) naming what the template tried:

- **What it may touch**: jinja2's ImmutableSandboxedEnvironment (no ``_``/``__`` attributes, no
  mutating methods, ``range`` up to 100000), unsafe attributes fail at once instead of
  rendering "", and there is no loader: ``{% include %}``, ``{% import %}`` and
  ``{% extends %}`` are refused.
- **Time**: every render has a deadline (2 s by default). It is checked at every call
  (functions, methods, macros: recursion), attribute and item lookup, filter, ``+ * ** %``
  and ``~``, and at every iteration of a ``{% for %}``: the loop's iterable is wrapped
  before the template compiles, so nested empty loops are caught too.
- **Size**: no string or list the template builds may exceed ``max_chars`` (8 Mi by
  default), and neither may its output. Growth is checked *before* it is allocated where
  one step can allocate a lot (``'a' * 10**9``, ``x ~ x`` doubling, ``join``, padding and
  ``format`` widths, ``tojson`` indents, ``str.replace``), and every filter's and call's
  result is checked after.

Real templates never come near these (Qwen2.5's renders a chat in well under 1 ms, see
docs/reliability.md); the checks cost a counter and a clock read per step.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import string
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NoReturn

from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from localllm.errors import TemplateError

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_CHARS = 8 << 20
MAX_INT_BITS = 4096  # an integer the template computes (10**1233 is the largest)
MAX_TOJSON_INDENT = 64
_LOOP_FILTER = "_localllm_loop"
_CONCAT_FILTER = "_localllm_concat"
# printf widths/precisions ("%1000000000s", "%*d") and str.format specs ("{:>1000000000}").
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?")
_NUMBERS = re.compile(r"\d+")


class TemplateLimitError(TemplateError):
    """The chat template ran past its time limit, built something too large, or reached for
    something outside the sandbox: the model file's fault, not the request's."""


@dataclass
class _Budget:
    deadline: float
    max_chars: int
    timeout_s: float
    steps: int = 0


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("localllm_template_budget", default=None)


def _tick() -> None:
    """One step of the template: fails once its render's deadline has passed."""
    budget = _budget.get()
    if budget is None:
        return  # compile time (constant folding): the size checks still apply
    budget.steps += 1
    if time.monotonic() > budget.deadline:
        raise TemplateLimitError(f"it ran for more than {budget.timeout_s:g} s (an endless or huge "
                                 "loop, or runaway recursion) and was stopped")


def _max_chars() -> int:
    budget = _budget.get()
    return budget.max_chars if budget is not None else DEFAULT_MAX_CHARS


def _too_large(what: str, size: int) -> NoReturn:
    raise TemplateLimitError(f"it tried to build {what} of {size} items, more than the "
                             f"{_max_chars()} a chat template may, and was stopped")


def _check_size(value: Any, what: str = "a value") -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > _max_chars():
        _too_large(what, len(value))
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"it computed a number of {value.bit_length()} bits and was stopped")
    return value


def _check_width(width: Any, what: str) -> None:
    if isinstance(width, int) and width > _max_chars():
        _too_large(what, width)


def _check_printf(fmt: str) -> None:
    for spec in _PRINTF_SPEC.finditer(fmt):
        for n in spec.groups():
            if n == "*":
                raise TemplateLimitError("it used a '*' width in %-formatting, which a chat template may not")
            if n is not None and int(n) > _max_chars():
                _too_large("a %-formatted field", int(n))


def _check_format_spec(fmt: str) -> None:
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format raises the same error itself
    for _, _, spec, _ in fields:
        if spec and "{" in spec:
            raise TemplateLimitError("it used a nested {} width in str.format, which a chat template may not")
        for n in _NUMBERS.findall(spec or ""):
            if int(n) > _max_chars():
                _too_large("a formatted field", int(n))


def _check_sequence_times(left: Any, right: Any) -> None:
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
            _check_width(len(seq) * max(n, 0), "a repeated string or list")


def _check_binop(op: str, left: Any, right: Any) -> None:
    if op == "*":
        _check_sequence_times(left, right)
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError("it multiplied numbers too large for a chat template and was stopped")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and (
                right > MAX_INT_BITS or left.bit_length() * right > MAX_INT_BITS):
            raise TemplateLimitError(f"it computed {left} ** {right}, too large a number, and was stopped")
    elif op == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _check_width(len(left) + len(right), "a joined string or list")
    elif op == "%" and isinstance(left, str):
        _check_printf(left)


def _checked_str_method(name: str, text: str, args: tuple, kwargs: dict) -> None:
    """Pre-checks the str methods that can grow a string far past their arguments."""
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _check_width(args[0], f"a str.{name}() result")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            _check_width(len(text) + text.count("\t") * tabsize, "a str.expandtabs() result")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = text.count(args[0]) if args[0] else len(text) + 1
        _check_width(len(text) + count * len(args[1]), "a str.replace() result")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        _check_width(sum(len(x) for x in args[0] if isinstance(x, str)) + len(text) * len(args[0]),
                     "a str.join() result")
    elif name in ("format", "format_map"):
        _check_format_spec(text)


# -- filters ---------------------------------------------------------------------------------


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Hugging Face's tojson: no HTML escaping, non-ASCII kept as is.
    if isinstance(indent, int) and indent > MAX_TOJSON_INDENT:
        raise TemplateLimitError(f"it asked tojson for an indent of {indent} (at most {MAX_TOJSON_INDENT})")
    if isinstance(indent, str) and len(indent) > MAX_TOJSON_INDENT:
        raise TemplateLimitError(f"it asked tojson for an indent of {len(indent)} characters")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _pre_filter(name: str, args: tuple, kwargs: dict) -> None:
    """Pre-checks the built-in filters that can grow a value far past their input (join's
    iterable is already a list: _guard_filter makes it one)."""
    value = args[0] if args else None
    rest = args[1:]
    if name in ("center", "indent", "wordwrap") and rest:
        width = rest[0]
        _check_width(width, f"a {name} width")
        if name == "indent" and isinstance(value, str) and isinstance(width, int):
            _check_width(len(value) + (value.count("\n") + 1) * width, "an indented string")
    elif name == "join" and isinstance(value, (list, tuple)):
        sep = rest[0] if rest else kwargs.get("d", "")
        _check_width(sum(len(x) for x in value if isinstance(x, str)) + len(str(sep)) * len(value),
                     "a joined string")
    elif name == "sum" and isinstance(value, (list, tuple)):
        start = rest[1] if len(rest) > 1 else kwargs.get("start", 0)
        if isinstance(start, (str, list, tuple)):
            _check_width(len(start) + sum(len(x) for x in value if isinstance(x, (str, list, tuple))),
                         "a sum of strings or lists")
    elif name == "format" and isinstance(value, str):
        _check_printf(value)
    elif name == "replace" and isinstance(value, str) and len(rest) >= 2:
        _checked_str_method("replace", value, tuple(map(str, rest[:2])), {})


def _guard_filter(name: str, func: Callable) -> Callable:
    @functools.wraps(func)  # keeps jinja's pass_context / pass_eval_context mark
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
        if name in ("join", "sum") and len(args) > skip and not isinstance(args[skip], (str, list, tuple, dict)):
            args = (*args[:skip], list(args[skip]), *args[skip + 1:])  # as join does, but first
        _pre_filter(name, args[skip:], kwargs)
        return _check_size(func(*args, **kwargs), f"a {name} result")

    return guarded


def _loop(iterable: Any) -> Iterator[Any]:
    """What every {% for %} iterates: the template's iterable, one deadline tick per item."""
    for item in iterable:
        _tick()
        yield item


def _concat(parts: list) -> str:
    """``a ~ b ~ c``: the joined length is checked before the string is made."""
    _tick()
    texts = [str(p) for p in parts]
    _check_width(sum(map(len, texts)), "a ~-joined string")
    return "".join(texts)


class _Guards(NodeTransformer):
    """Rewrites the parsed template so that every loop and every ``~`` passes a guard."""

    def __init__(self, environment: SandboxEnvironment) -> None:
        self.environment = environment

    def _filter(self, node: nodes.Node, name: str, lineno: int) -> nodes.Filter:
        f = nodes.Filter(node, name, [], [], None, None, lineno=lineno)
        f.set_environment(self.environment)
        return f

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = self._filter(node.iter, _LOOP_FILTER, node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        node = self.generic_visit(node)
        parts = nodes.List(node.nodes, lineno=node.lineno)
        parts.set_environment(self.environment)
        return self._filter(parts, _CONCAT_FILTER, node.lineno)


class SandboxEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the time and size fences; see the module docstring."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

    def __init__(self, **options: Any) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                         **options)
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.filters[_LOOP_FILTER] = _loop
        self.filters[_CONCAT_FILTER] = _concat
        self.globals["strftime_now"] = _strftime_now

    def _generate(self, source: nodes.Template, *args: Any, **kwargs: Any) -> str:
        return super()._generate(_Guards(self).visit(source), *args, **kwargs)

    def _load_template(self, name: Any, globals: Any) -> NoReturn:
        raise SecurityError(f"it tried to read the template {name!r} ({{% include %}}, {{% import %}} or "
                            "{% extends %}); a chat template may not read other templates or files")

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        # Fail at once rather than render "" and let the template probe on.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} is unsafe")

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        _tick()
        _check_binop(op, left, right)
        return _check_size(self.binop_table[op](left, right))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _tick()
        for value in (*args, *kwargs.values()):
            _check_size(value, "an argument")
        if isinstance(getattr(__obj, "__self__", None), str):
            name = getattr(__obj, "__name__", "")
            if name == "join" and args and not isinstance(args[0], (str, list, tuple, dict)):
                args = (list(args[0]), *args[1:])  # as str.join does, but before it joins
            _checked_str_method(name, __obj.__self__, args, kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs), "a call's result")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_format_spec(fmt)
            return wrapped(*args, **kwargs)

        return checked


def render(template: Any, context: dict[str, Any], *, timeout_s: float = DEFAULT_TIMEOUT_S,
           max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """Renders under a fresh budget; the output is counted as it streams."""
    budget = _Budget(time.monotonic() + timeout_s, max_chars, timeout_s)
    token = _budget.set(budget)
    try:
        pieces, size = [], 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > max_chars:
                raise TemplateLimitError(f"its output passed {max_chars} characters and was stopped")
            pieces.append(piece)
            _tick()
        return "".join(pieces)
    finally:
        _budget.reset(token)

