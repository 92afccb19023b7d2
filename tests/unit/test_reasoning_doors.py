"""A thinking model's reasoning through every door of the real app, kept apart from the answer:
OpenAI chat (`reasoning_content` and `reasoning`), Anthropic Messages (`thinking` blocks) and
Responses (`reasoning` items), whole and streamed, with the stream cut at every boundary around
`<think>` and `</think>`. Below the model line: Qwen3's real chat template over a byte-level
vocabulary, and an engine stand-in that streams a scripted answer in the pieces a test chooses
(the split's exactness over real text is test_reasoning's)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from test_tokenizer import FakeVocab

from localllm.config import ServerConfig
from localllm.engine.engine import RequestOutput
from localllm.server.app import create_app
from localllm.server.models import ServedModels
from localllm.tokenizer import Tokenizer

QWEN3 = (Path(__file__).parents[1] / "data" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
REASONING, ANSWER = "The user greets. Say hi.", "Hi there!"
SCRIPT = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"


class ScriptedEngine:
    """AsyncEngine's generate() over a script: the text in the pieces ``cuts`` makes."""

    def __init__(self, tokenizer: Tokenizer):
        self.engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=4096,
                                      config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=4)))
        self.cuts: list[int] = []
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        bounds = [0, *self.cuts, len(SCRIPT)]
        pieces = [SCRIPT[a:b] for a, b in zip(bounds, bounds[1:])]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield RequestOutput("r", token_ids=list(piece.encode()), text=piece, finished=last,
                                finish_reason="stop" if last else None)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    engine = ScriptedEngine(Tokenizer(FakeVocab(chat_template=QWEN3), name="qwen3-like"))
    config = ServerConfig()
    client = TestClient(create_app(ServedModels.of(engine, tmp_path_factory.mktemp("m") / "qwen3.gguf", config), config))
    return client, engine


HI = [{"role": "user", "content": "Hello"}]
# Every cut that splits a marker or its neighbours, one at a time, and all at once.
MARKER_CUTS = sorted({i for m in ("<think>", "</think>") for start in [SCRIPT.index(m)]
                      for i in range(max(1, start - 1), start + len(m) + 3)})
CUT_SETS = [[i] for i in MARKER_CUTS] + [MARKER_CUTS, list(range(1, len(SCRIPT)))]


def sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_openai_chat_keeps_reasoning_out_of_content(app):
    client, engine = app
    engine.cuts = []
    message = client.post("/v1/chat/completions", json={"model": "qwen3", "messages": HI}).json()["choices"][0]["message"]
    # The newline before </think> stays: a stream cannot drop trailing whitespace without
    # holding back unbounded text, and the whole answer says what the stream says.
    assert (message["content"], message["reasoning_content"], message["reasoning"]) == (ANSWER, REASONING + "\n",
                                                                                        REASONING + "\n")
    for cuts in CUT_SETS:
        engine.cuts = cuts
        chunks = sse_data(client.post("/v1/chat/completions",
                                      json={"model": "qwen3", "messages": HI, "stream": True}).text)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        content = "".join(d.get("content") or "" for d in deltas)
        assert content == ANSWER, cuts
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == REASONING + "\n", cuts
        assert "".join(d.get("reasoning") or "" for d in deltas) == REASONING + "\n", cuts


def test_anthropic_gives_a_thinking_block(app):
    client, engine = app
    engine.cuts = []
    body = {"model": "qwen3", "max_tokens": 64, "messages": HI}
    content = client.post("/v1/messages", json=body).json()["content"]
    assert content == [{"type": "thinking", "thinking": REASONING + "\n", "signature": ""},
                       {"type": "text", "text": ANSWER}]
    for cuts in CUT_SETS:
        engine.cuts = cuts
        events = sse_data(client.post("/v1/messages", json=body | {"stream": True}).text)
        starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
        assert starts == ["thinking", "text"], cuts
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        assert "".join(d.get("thinking", "") for d in deltas) == REASONING + "\n", cuts
        assert "".join(d.get("text", "") for d in deltas) == ANSWER, cuts


def test_responses_gives_a_reasoning_item(app):
    client, engine = app
    engine.cuts = []
    body = {"model": "qwen3", "input": "Hello", "store": False}
    output = client.post("/v1/responses", json=body).json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": REASONING + "\n"}]
    assert output[1]["content"][0]["text"] == ANSWER
    for cuts in CUT_SETS:
        engine.cuts = cuts
        events = sse_data(client.post("/v1/responses", json=body | {"stream": True}).text)
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        assert (text, reasoning) == (ANSWER, REASONING + "\n"), cuts
        final = events[-1]["response"]["output"]
        assert [item["type"] for item in final] == ["reasoning", "message"], cuts
        assert [e["sequence_number"] for e in events] == list(range(len(events)))


@pytest.mark.parametrize("switch", [
    ("/v1/chat/completions", {"messages": HI, "reasoning_effort": "none"}),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"enable_thinking": False}}),
    ("/v1/messages", {"messages": HI, "max_tokens": 8, "thinking": {"type": "disabled"}}),
    ("/v1/responses", {"input": "Hello", "reasoning": {"effort": "none"}, "store": False}),
])
def test_each_door_can_turn_thinking_off(app, switch):
    """Qwen3's template, told enable_thinking=false, closes an empty block in the prompt itself."""
    client, engine = app
    path, body = switch
    assert client.post(path, json={"model": "qwen3"} | body).status_code == 200
    prompt = bytes(t for t in engine.prompts[-1] if t < 256).decode()
    assert prompt.endswith("assistant\n<think>\n\n</think>\n\n")
    assert client.post(path, json={"model": "qwen3"} | {k: v for k, v in body.items() if k in (
        "messages", "max_tokens", "input", "store")}).status_code == 200
    assert bytes(t for t in engine.prompts[-1] if t < 256).decode().endswith("assistant\n")
