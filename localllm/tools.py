"""The grammar of an answer that must call a tool (tool_choice "required" or a named tool).

It forces one ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` block, the
Qwen2.5 / Hermes form, which the parser of every template family reads (localllm/tool_calls.py).
"""

from __future__ import annotations

import re


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
