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
    # response_fields: the fields asked for, flat, keyed by their paths (as llama-server answers).
    assert set(result) == {"content", "timings/prompt_n", "tokens_cached"}
    assert result["timings/prompt_n"] + result["tokens_cached"] > 40  # the other files are in the prompt

    # Streamed, the same answer (without the time limit, which cuts where the machine's speed says).
    body.pop("t_max_predict_ms")
    whole = keyed_http.post("/infill", json=body).json()
    with keyed_http.stream("POST", "/infill", json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["stop"] for e in events[:-1]] == [False] * (len(events) - 1)
    assert set(events[-1]) == {"content", "timings/prompt_n", "tokens_cached"}  # the end, its fields picked
    assert "".join(e["content"] for e in events) == whole["content"]


# What llama.vim (llama.cpp's Vim plugin, autoload/llama.vim at a1c8e6e) sends: with no model
# configured it still sends "model": "" (it tests len() of the variable's name), which
# llama-server reads as its one model.
VIM = {"id_slot": 0, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"],
       "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500, "n_predict": 16, "model": "",
       "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                           "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                           "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                           "tokens_cached"]}


def test_infill_as_llama_vim_sends_it(keyed_http):
    body = VIM | {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [], "prompt": "", "temperature": 0}
    r = keyed_http.post("/infill", json=body)
    assert r.status_code == 200, r.text
    result = r.json()
    assert result["content"].replace(" ", "").startswith("a+b")
    # n_indent 4: the answer ends at the first line indented less than the cursor's (a blank one
    # here), that line's text cut, as llama-server ends it; left alone, the model writes on.
    assert result["content"].endswith("\n") and result["content"].count("\n") == 1, result["content"]
    free = keyed_http.post("/infill", json=body | {"n_indent": 0}).json()
    assert free["content"].startswith(result["content"]) and len(free["content"]) > len(result["content"])
    # What its status line shows: every timing it asks for, each as llama-server computes it.
    assert set(result) == set(VIM["response_fields"])
    assert result["timings/predicted_n"] >= 1 and result["timings/prompt_n"] + result["tokens_cached"] > 10
    assert result["timings/prompt_ms"] > 0 and result["timings/predicted_ms"] >= 0
    assert result["timings/prompt_per_second"] == pytest.approx(
        result["timings/prompt_n"] / result["timings/prompt_ms"] * 1000)


def test_bad_infill_requests_are_400(keyed_http):
    for body in ({"input_prefix": 5}, {"input_extra": [{"filename": "x"}]}, {"n_predict": -2},
                 {"input_extra": "text"}, {"temperature": "hot"}, {"n_predict": 10**6}):
        r = keyed_http.post("/infill", json=body)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert keyed_http.post("/infill", content=b"{not json").status_code == 400
    assert keyed_http.get("/health").json()["status"] == "ok"
