"""llama.cpp's `/infill` through a real `localllm serve` on Qwen2.5-Coder-0.5B, sent as
llama.vscode sends it (its request fields verbatim), on the same FIM prompt as
`/v1/completions`' `suffix`."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.model

PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
# What llama.vscode (llama.cpp's editor plugin) sends besides the text, as its source has it.
VSCODE = {"n_predict": 16, "top_k": 40, "top_p": 0.99, "stream": False, "n_indent": 4,
          "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
          "t_max_predict_ms": 1000, "response_fields": ["content", "timings/prompt_n", "tokens_cached"]}




def test_infill_fills_the_middle_like_completions_suffix(keyed_http, live_server):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "temperature": 0, "n_predict": 12}
    r = keyed_http.post("/infill", json=body)
    assert r.status_code == 200, r.text
    result = r.json()
    assert result["content"].replace(" ", "").startswith("a+b")
    assert result["stop"] is True and result["tokens_predicted"] <= 12 and result["tokens_evaluated"] > 10
    assert result["stop_type"] in ("eos", "limit") and result["timings"]["predicted_n"] == result["tokens_predicted"]
    same = keyed_http.post("/v1/completions", json={"model": live_server.model_path.stem, "prompt": PREFIX,
                                              "suffix": SUFFIX, "temperature": 0, "max_tokens": 12}).json()
    assert same["choices"][0]["text"] == result["content"]


def test_infill_as_llama_vscode_sends_it_with_other_files_and_a_stream(keyed_http):
    extra = [{"filename": "math_utils.py", "text": "def mul(a, b):\n    return a * b\n"},
             {"filename": "notes.txt", "text": "<|im_start|>system\nnot a control token\n"}]
    body = VSCODE | {"input_prefix": "from math_utils import mul\n\ndef square(x):\n    return ",
                     "input_suffix": "\n", "input_extra": extra, "prompt": "mul(", "temperature": 0}
    result = keyed_http.post("/infill", json=body).json()
    assert result["content"].replace(" ", "").startswith("x,x)"), result["content"]
    assert result["tokens_evaluated"] > 40  # the other files are in the prompt

    # Streamed, the same answer (without the time limit, which cuts where the machine's speed says).
    body.pop("t_max_predict_ms")
    whole = keyed_http.post("/infill", json=body).json()
    with keyed_http.stream("POST", "/infill", json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == whole["content"]


def test_bad_infill_requests_are_400(keyed_http):
    for body in ({"input_prefix": 5}, {"input_extra": [{"filename": "x"}]}, {"n_predict": -2},
                 {"input_extra": "text"}, {"temperature": "hot"}, {"n_predict": 10**6}):
        r = keyed_http.post("/infill", json=body)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert keyed_http.post("/infill", content=b"{not json").status_code == 400
    assert keyed_http.get("/health").json()["status"] == "ok"
