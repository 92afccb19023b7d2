"""Tool calls in a model's output, as its chat template defines them.

Qwen2.5 and Hermes-style templates ask the model to answer a tool call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call.
"""

from __future__ import annotations

import json
import re

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, str]]]:
    """(content, calls): the text without its well-formed tool-call blocks, and each call as
    {"name": str, "arguments": JSON text}, in order. A block that is not a JSON object with a
    string "name" stays in the content as written; nothing here raises on model output.

    >>> parse_tool_calls('Checking.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    ('Checking.', [{'name': 'f', 'arguments': '{"x": 1}'}])
    """
    calls: list[dict[str, str]] = []

    def take(match: re.Match[str]) -> str:
        call = _parse_call(match.group(1))
        if call is None:
            return match.group(0)
        calls.append(call)
        return ""

    content = _TOOL_CALL.sub(take, text)
    return (content.strip() if calls else text), calls


def _parse_call(body: str) -> dict[str, str] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:  # already JSON text: keep it exactly as the model wrote it
            json.loads(arguments)
        except ValueError:
            return None
        return {"name": call["name"], "arguments": arguments}
    return {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}


def parse_bare_call(text: str, tool_names: set[str]) -> dict[str, str] | None:
    """A call the model wrote as a bare JSON object, without the <tool_call> tags (small models
    do): accepted only when the whole output is one such object naming an offered tool."""
    call = _parse_call(text.strip())
    return call if call is not None and call["name"] in tool_names else None


def tool_call_grammar(tools: list[dict], to_grammar, name: str | None = None) -> str:
    """GBNF that forces one ``<tool_call>`` block calling one of ``tools`` (or the named one),
    with arguments that follow its JSON schema. ``to_grammar`` turns a JSON schema into GBNF
    whose start rule is ``root``."""
    calls = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"]}
             for t in tools if name is None or t["function"]["name"] == name]
    schema = calls[0] if len(calls) == 1 else {"oneOf": calls}
    rules = re.sub(r"^root ::=", "call ::=", to_grammar(schema), flags=re.MULTILINE)
    return rules + '\nroot ::= "<tool_call>\\n" call "\\n</tool_call>"\n'
