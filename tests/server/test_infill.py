"""llama.cpp's `/infill` through a real `localllm serve` on Qwen2.5-Coder-0.5B, sent as
llama.vscode sends it (its request fields verbatim), on the same FIM prompt as
`/v1/completions`' `suffix`."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.model

PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
# What llama.vscode (llama.cpp's editor plugin; src/llama-server.ts at v0.0.63) sends besides the
# text: its setting `ai_model` goes along as "model" whatever the endpoint, by default OpenRouter's
# "google/gemini-2.5-flash", which llama-server (one model) never reads; `n_cmpl` asks for that
# many alternatives; no temperature.
VSCODE = {"id_slot": 0, "n_predict": 128, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False,
          "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": 4,
          "t_max_prompt_ms": 500, "t_max_predict_ms": 500, "model": "google/gemini-2.5-flash"}
# ... and, as the person types, its other files alone to warm the cache: n_predict 0.
VSCODE_PREP = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "prompt": "", "n_predict": 0, "samplers": [],
               "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1,
               "model": "google/gemini-2.5-flash"}
# Its other files ("chunks"), each with the time it was taken.
EXTRA = [{"filename": "math_utils.py", "text": "def mul(a, b):\n    return a * b\n", "time": 1765150000000},
         {"filename": "notes.txt", "text": "<|im_start|>system\nnot a control token\n", "time": 1765150000001}]


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
    text = {"input_prefix": "from math_utils import mul\n\ndef square(x):\n    return ", "input_suffix": "\n",
            "input_extra": EXTRA, "prompt": "mul("}
    # Its warm-up: the other files go into the prefix cache, and nothing is written.
    warm = keyed_http.post("/infill", json=VSCODE_PREP | {"input_extra": EXTRA})
    assert warm.status_code == 200, warm.text
    assert warm.json()["content"] == "" and warm.json()["tokens_predicted"] == 0
    assert warm.json()["tokens_evaluated"] > 20  # the files are in the prompt

    # Its completion, under a model name this server does not serve: llama-server's default model
    # answers, with n_cmpl's three alternatives (the same three, greedy).
    r = keyed_http.post("/infill", json=VSCODE | text | {"temperature": 0})
    assert r.status_code == 200, r.text
    results = r.json()
    assert isinstance(results, list) and len(results) == 3
    assert len({res["content"] for res in results}) == 1
    assert results[0]["content"].replace(" ", "").startswith("x,x)"), results[0]["content"]
    assert results[0]["tokens_cached"] >= 16  # the warm-up's files, from the prefix cache
    # Sampled, as llama.vscode sends it (no temperature): three answers.
    sampled = keyed_http.post("/infill", json=VSCODE | text)
    assert sampled.status_code == 200 and len(sampled.json()) == 3

    # One completion is one object; streamed, the same answer (without the time limit, which
    # cuts where the machine's speed says).
    body = VSCODE | text | {"n_cmpl": 1, "temperature": 0, "response_fields": ["content", "tokens_cached"]}
    body.pop("t_max_predict_ms")
    whole = keyed_http.post("/infill", json=body).json()
    assert set(whole) == {"content", "tokens_cached"}  # response_fields: the fields asked for, flat
    with keyed_http.stream("POST", "/infill", json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["stop"] for e in events[:-1]] == [False] * (len(events) - 1)
    assert set(events[-1]) == {"content", "tokens_cached"}  # the end, its fields picked
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
    for n in (0, 10**3):  # in llama-server's words, which llama.vscode reads and adds its advice to
        r = keyed_http.post("/infill", json={"input_prefix": PREFIX, "n_cmpl": n})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            "Field 'n_cmpl': Value must be between 1 <= value <= "), r.text
    r = keyed_http.post("/infill", json={"input_prefix": PREFIX, "n_cmpl": 2, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_cmpl"
    # Only llama-server's own route takes a name it does not serve as its default model.
    r = keyed_http.post("/v1/completions", json={"model": "google/gemini-2.5-flash", "prompt": PREFIX})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert keyed_http.get("/health").json()["status"] == "ok"


# Continue's autocomplete on `provider: openai` (core/llm/llms/OpenAI.ts, _legacystreamComplete,
# at d0a3c0b): the model's FIM template filled in as text, sent to /v1/completions, streamed,
# with the template's stop words (core/autocomplete/templating/AutocompleteTemplate.ts).
CONTINUE_STOPS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                  "<|repo_name|>", "<|file_sep|>", "<|im_start|>", "<|im_end|>"]


def test_completions_read_continues_fim_template_as_the_suffix_route_reads_it(keyed_http, live_server):
    model = live_server.model_path.stem

    def streamed(prompt: str) -> tuple[str, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": CONTINUE_STOPS,
                "stream": True, "stream_options": {"include_usage": True}}
        with keyed_http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        return "".join(c["text"] for e in events for c in e["choices"]), events[-1]["usage"]["prompt_tokens"]

    text, n = streamed(f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")
    same = keyed_http.post("/v1/completions", json={"model": model, "prompt": PREFIX, "suffix": SUFFIX,
                                                    "temperature": 0, "max_tokens": 12}).json()
    assert text == same["choices"][0]["text"] and text.replace(" ", "").startswith("a+b")
    assert n == same["usage"]["prompt_tokens"]  # the same tokens: the markers read as the FIM tokens
    # Its repository layout: other files after <|repo_name|> and <|file_sep|>.
    text, _ = streamed("<|repo_name|>work\n<|file_sep|>math_utils.py\ndef mul(a, b):\n    return a * b\n\n"
                       "<|file_sep|>main.py\n<|fim_prefix|>from math_utils import mul\n\ndef square(x):\n"
                       "    return <|fim_suffix|>\n<|fim_middle|>")
    assert text.replace(" ", "").startswith("x*x") or text.replace(" ", "").startswith("mul(x,x)"), text
    # Any other layout stays plain text, markers and all (each marker several tokens).
    _, n_plain = streamed(f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}")
    assert n_plain > n + 6  # 18 tokens of text and two markers of 5-6 tokens each, against 21
    # Inside the template, another control token's text stays text.
    _, n_im = streamed(f"<|fim_prefix|><|im_start|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")
    assert n_im > n + 2
