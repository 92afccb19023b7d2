"""/infill's llama-server rules that need no model: where n_indent ends an answer, and the
fields response_fields picks."""

from __future__ import annotations

import pytest

from localllm.server.infill import indent_cut, picked


@pytest.mark.parametrize("text, n_indent, cut", [
    ("a + b", 4, None),  # the cursor's own line is never judged
    ("a + b\n", 4, None),  # no next line yet
    ("a + b\n    ", 4, None),  # its indentation so far: nothing after it yet
    ("a + b\n    c\n", 4, None),  # indented enough
    ("a + b\n\nprint(1)", 4, 6),  # a blank line has indentation 0: it ends there
    ("a + b\n  c", 4, 8),  # indented 2 < 4: the text of the line goes, its indentation stays
    ("x\n\t\tc\n\td", 2, 7),  # a tab counts one, as llama-server counts it
    ("x\n    c\nd", 4, 8),
    ("x\nc", 0, None),  # 0: no rule
])
def test_indent_cut_is_where_llama_server_stops(text, n_indent, cut):
    assert indent_cut(text, n_indent) == cut


def test_response_fields_are_picked_flat_by_path():
    result = {"content": "x", "timings": {"prompt_n": 3, "predicted_ms": 1.5}, "truncated": False}
    assert picked(result, ["content", "timings/prompt_n", "timings/missing", "nope/deeper", "truncated"]) == {
        "content": "x", "timings/prompt_n": 3, "truncated": False}
