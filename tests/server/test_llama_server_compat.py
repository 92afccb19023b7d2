"""A drop-in for llama-server's and vLLM's clients (issue 23), through a real `localllm serve`
(Qwen2.5-Coder-0.5B): `model` optional, `logit_bias`, `bytes` in chat logprobs, several prompts
in one completions request, llama-server's extension fields, `/tokenize` and `/detokenize`,
OpenAI's routes without `/v1` (with `x-api-key` as the key too), and errors that tell the
client what it can do, never a flag of a command it did not run. Requests go through the
official openai client where it can send them (extension fields through extra_body), else
through httpx."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from localllm.server.core import Server
from localllm.server.errors import APIError
from localllm.tokenizer import Tokenizer

pytestmark = pytest.mark.model

FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
CAPITAL = "The capital of France is"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def http(keyed_http) -> httpx.Client:
    return keyed_http


def error_body(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    if param is not None:
        assert body["error"]["param"] == param, body
    assert "--" not in body["error"]["message"], body  # what the client can do, never a server flag
    return body["error"]


def token_ids(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"content": text}).json()["tokens"]


# -- model ------------------------------------------------------------------------------------


def test_model_may_be_left_out_of_every_openai_request(http, served_model):
    chat = http.post("/v1/chat/completions", json={"messages": FRANCE, "max_tokens": 1, "temperature": 0})
    completion = http.post("/v1/completions", json={"prompt": CAPITAL, "max_tokens": 1, "temperature": 0})
    responses = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1, "store": False})
    for r in (chat, completion, responses):
        assert r.status_code == 200, r.text
        assert r.json()["model"] == served_model
    embedding = http.post("/v1/embeddings", json={"input": "hi"})
    assert embedding.status_code == 200 and len(embedding.json()["data"][0]["embedding"]) == 384
    # An empty name is the default model too, as llama-server takes it (llama.vim sends "").
    empty = http.post("/v1/chat/completions", json={"model": "", "messages": FRANCE, "max_tokens": 1})
    assert empty.status_code == 200 and empty.json()["model"] == served_model
    # A name that is not served stays a 404 that lists the served one.
    err = error_body(http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": FRANCE}), 404, "model")
    assert err["code"] == "model_not_found" and served_model in err["message"]
    # Anthropic's model stays required, as Anthropic has it.
    anthropic = http.post("/v1/messages", json={"max_tokens": 1, "messages": FRANCE})
    assert anthropic.status_code == 400 and "model" in anthropic.json()["error"]["message"]


# -- logit_bias --------------------------------------------------------------------------------


def test_logit_bias_minus_100_bans_the_likeliest_token_and_plus_100_forces_one(client, http, served_model):
    first = client.completions.create(model=served_model, prompt=CAPITAL, max_tokens=1, temperature=0,
                                      extra_body={"return_tokens": True})
    [paris] = first.choices[0].tokens  # the token the model most likely says first (" Paris")
    assert first.choices[0].text == " Paris"
    banned = [paris]
    for num_prompts in (10, 10, 5):  # 200 answers of one token, sampled at temperature 1
        r = client.completions.create(model=served_model, prompt=[CAPITAL] * num_prompts, n=8, max_tokens=1,
                                      temperature=1.0, logit_bias={str(paris): -100},
                                      extra_body={"return_tokens": True})
        assert len(r.choices) == num_prompts * 8
        banned += [t for c in r.choices for t in c.tokens if t == paris]
    assert banned == [paris], "a token biased by -100 was sampled"
    [banana] = token_ids(http, " banana")
    forced = client.completions.create(model=served_model, prompt=CAPITAL, n=8, max_tokens=1, temperature=1.0,
                                       logit_bias={str(banana): 100}, extra_body={"return_tokens": True})
    assert [c.tokens for c in forced.choices] == [[banana]] * 8
    assert {c.text for c in forced.choices} == {" banana"}


def test_logit_bias_on_chat_moves_the_greedy_answer(client, http, served_model):
    plain = client.chat.completions.create(model=served_model, messages=FRANCE, max_tokens=2, temperature=0,
                                           logprobs=True)
    first = plain.choices[0].logprobs.content[0]
    assert first.token == "Paris"
    [paris] = token_ids(http, "Paris")
    biased = client.chat.completions.create(model=served_model, messages=FRANCE, max_tokens=2, temperature=0,
                                            logit_bias={str(paris): -100})
    assert not biased.choices[0].message.content.startswith("Paris")


@pytest.mark.parametrize("bias, message", [
    ({"Paris": -100}, "key 'Paris' is not a token id"),
    ({"9999999": 5}, "token id 9999999, outside the vocabulary of 151936"),
    ({"785": 100.5}, r"value 100.5 for token 785 is invalid: use a number in [-100, 100]"),
    ({"785": -101}, "use a number in [-100, 100]"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_bad_logit_bias_is_a_400_naming_it(http, path, bias, message):
    body = {"messages": FRANCE} if "chat" in path else {"prompt": CAPITAL}
    err = error_body(http.post(path, json=body | {"logit_bias": bias, "max_tokens": 1}), 400, "logit_bias")
    assert message in err["message"]


# -- bytes ------------------------------------------------------------------------------------


def test_chat_logprobs_carry_each_tokens_own_bytes(client, http, served_model):
    """A whole token's bytes are its text's ("As" -> [65, 115]); a token that holds part of a
    UTF-8 character gives its raw bytes from the vocabulary. logit_bias +100 makes each the
    answer's first token."""
    pieces = http.post("/tokenize", json={"content": "As 🤗", "with_pieces": True}).json()["tokens"]
    assert pieces[0]["piece"] == "As"
    partial = next(p for p in pieces if isinstance(p["piece"], list))  # a piece of the emoji
    for token in (pieces[0], partial):
        r = client.chat.completions.create(model=served_model, messages=FRANCE, max_tokens=1, temperature=0,
                                           logprobs=True, top_logprobs=2, logit_bias={str(token["id"]): 100})
        [step] = r.choices[0].logprobs.content
        want = list(token["piece"].encode()) if isinstance(token["piece"], str) else token["piece"]
        assert step.bytes == want
        # top_logprobs are the model's own (before the bias): "Paris" first, with its bytes
        assert [(top.token, top.bytes) for top in step.top_logprobs][0] == ("Paris", list(b"Paris"))
        assert all(top.bytes == list(top.token.encode()) for top in step.top_logprobs)
    assert list(b"As") == [65, 115]  # the bytes OpenAI's own example gives


# -- several prompts -------------------------------------------------------------------------


def first_word(text: str) -> str:
    return text.split()[0]


def test_several_prompts_in_one_completions_request(client, http, served_model):
    """Prompt p's j-th choice is index p * n + j; each prompt's answers begin as it answers
    alone; usage sums; text prompts and token-id prompts give the same. (Only the first word is
    compared: llama.cpp computes a row in a batch of several sequences slightly differently from
    alone, and a near-tie later in a greedy answer can flip, as on llama.cpp's AVX2 kernels.)"""
    prompts = [CAPITAL, "def add(a, b):"]
    alone = [client.completions.create(model=served_model, prompt=p, max_tokens=4, temperature=0).choices[0].text
             for p in prompts]
    r = client.completions.create(model=served_model, prompt=prompts, n=2, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [first_word(c.text) for c in r.choices] == [first_word(alone[0])] * 2 + [first_word(alone[1])] * 2
    ids = [token_ids(http, p) for p in prompts]
    assert r.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert r.usage.completion_tokens == 16
    by_ids = client.completions.create(model=served_model, prompt=ids, max_tokens=4, temperature=0)
    assert [first_word(c.text) for c in by_ids.choices] == [first_word(a) for a in alone]
    # Streamed: the same answers by index, the two prompts' chunks interleaved (they share the
    # engine's steps), and the usage summed.
    texts, order = {}, []
    stream = client.completions.create(model=served_model, prompt=prompts, max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            order.append(c.index)
        if chunk.usage is not None:
            assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (r.usage.prompt_tokens, 8)
    assert {i: first_word(t) for i, t in texts.items()} == {0: first_word(alone[0]), 1: first_word(alone[1])}
    assert order.index(1) < len(order) - 1 - order[::-1].index(0), order  # prompt 1 began before prompt 0 ended


@pytest.mark.parametrize("prompt, message", [
    ([], "the prompt list is empty"),
    (["a", [1, 2]], "mixes"),
    ([5, "a"], "mixes"),
    (["a", ""], "prompt 1 is empty"),
    ([[1, 2], []], "prompt 1 is empty"),
    ([[1, 2], [151936]], "prompt 1: token id 151936 is outside the vocabulary"),
])
def test_a_bad_prompt_list_is_a_400_naming_prompt(http, prompt, message):
    err = error_body(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}), 400, "prompt")
    assert message in err["message"]


# -- llama-server's extension fields -----------------------------------------------------------


def test_llama_server_extension_fields_have_their_meaning(client, http, served_model):
    # n_predict is max_tokens (and wins over it); the fields that mean nothing here are accepted.
    r = client.chat.completions.create(model=served_model, messages=[{"role": "user", "content": "Count to 20."}],
                                       temperature=0, max_tokens=50,
                                       extra_body={"n_predict": 3, "cache_prompt": True, "id_slot": -1,
                                                   "timings_per_token": False, "return_progress": False,
                                                   "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    # grammar (GBNF) with n_predict -1: until the grammar is done, not the context.
    yes_no = client.completions.create(model=served_model, prompt="Is Paris in France? Answer:", temperature=0,
                                       extra_body={"n_predict": -1, "grammar": 'root ::= " yes" | " no"'})
    assert yes_no.choices[0].text in (" yes", " no") and yes_no.choices[0].finish_reason == "stop"
    # json_schema, top-level; and llama-server's response_format json_object with a schema.
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"], "additionalProperties": False}
    for extra in ({"json_schema": schema}, {"response_format": {"type": "json_object", "schema": schema}}):
        r = client.chat.completions.create(model=served_model, messages=FRANCE, temperature=0, max_tokens=24,
                                           extra_body=extra)
        assert list(json.loads(r.choices[0].message.content)) == ["capital"], extra
    # return_tokens: the answer's ids, as llama-server returns them (`tokens`), streamed too.
    r = http.post("/v1/completions", json={"prompt": CAPITAL, "max_tokens": 3, "temperature": 0,
                                           "return_tokens": True}).json()
    [choice] = r["choices"]
    assert len(choice["tokens"]) == 3
    assert http.post("/detokenize", json={"tokens": choice["tokens"]}).json()["content"] == choice["text"]
    with http.stream("POST", "/v1/completions", json={"prompt": CAPITAL, "max_tokens": 3, "temperature": 0,
                                                      "return_tokens": True, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [t for e in events for t in e["choices"][0]["tokens"]] == choice["tokens"]
    # Without return_tokens, no tokens field.
    plain = http.post("/v1/completions", json={"prompt": CAPITAL, "max_tokens": 1}).json()
    assert "tokens" not in plain["choices"][0]


@pytest.mark.parametrize("body, param, message", [
    ({"grammar": "root ::= undefined_rule"}, "grammar", "Rule 'undefined_rule' not found"),
    ({"regex": "("}, "regex", "unclosed group"),
    ({"regex": "[a-z]+", "grammar": 'root ::= "a"'}, "regex", "give one of them"),
    ({"grammar": 'root ::= "a"', "json_schema": {}}, "json_schema", "give one of them"),
    ({"json_schema": {"type": "object"}, "response_format": {"type": "json_object"}}, "response_format",
     "give one of them"),
    ({"n_predict": 0}, "n_predict", "n_predict 0 asks for no answer"),
    ({"id_slots": 0}, "id_slots", "unknown parameter 'id_slots'"),
])
def test_bad_extension_fields_are_a_400_naming_them(http, body, param, message):
    err = error_body(http.post("/v1/chat/completions", json={"messages": FRANCE, "max_tokens": 1} | body), 400, param)
    assert message in err["message"]


# -- /tokenize and /detokenize -----------------------------------------------------------------


def test_tokenize_and_detokenize_as_llama_server(http):
    content = "What is the capital of France ?"
    tokens = http.post("/tokenize", json={"content": content}).json()["tokens"]
    assert len(tokens) > 5 and all(type(t) is int for t in tokens)
    assert http.post("/detokenize", json={"tokens": tokens}).json() == {"content": content}
    # Control-token text is read as the token (llama-server's parse_special default), unless asked not to.
    assert http.post("/tokenize", json={"content": "<|im_start|>"}).json()["tokens"] == [151644]
    assert len(http.post("/tokenize", json={"content": "<|im_start|>", "parse_special": False}).json()["tokens"]) > 1
    assert http.post("/detokenize", json={"tokens": [151644]}).json() == {"content": "<|im_start|>"}
    # with_pieces: text where the bytes are whole UTF-8, the byte values where a token holds part of a character.
    pieces = http.post("/tokenize", json={"content": "unicode 媽 and emoji 🤗", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == token_ids(http, "unicode 媽 and emoji 🤗")
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert raw.decode() == "unicode 媽 and emoji 🤗"
    assert any(isinstance(p["piece"], list) for p in pieces)
    err = error_body(http.post("/detokenize", json={"tokens": [1, 151936]}), 400, "tokens")
    assert "151936 is outside the vocabulary" in err["message"]


# -- routes without /v1, and the key --------------------------------------------------------------


def test_openai_routes_answer_without_v1_with_openai_errors(live_server, served_model):
    with openai.OpenAI(base_url=live_server.url, api_key=live_server.api_key, max_retries=0, timeout=120) as bare:
        assert [m.id for m in bare.models.list().data][0] == served_model
        chat = bare.chat.completions.create(model=served_model, messages=FRANCE, max_tokens=1, temperature=0)
        assert chat.choices[0].message.content == "Paris"
        assert bare.completions.create(model=served_model, prompt=CAPITAL, max_tokens=1, temperature=0).choices[0].text
        assert len(bare.embeddings.create(model="all-minilm-l6-v2-f16", input="hi").data[0].embedding) == 384
        with pytest.raises(openai.NotFoundError) as e:
            bare.chat.completions.create(model="no-such-model", messages=FRANCE, max_tokens=1)
        assert e.value.code == "model_not_found"
    # x-api-key is taken wherever Authorization: Bearer is, on the bare routes too.
    with httpx.Client(base_url=live_server.url, timeout=60) as raw:
        assert raw.get("/models", headers={"x-api-key": live_server.api_key}).status_code == 200
        r = raw.post("/completions", headers={"X-Api-Key": live_server.api_key},
                     json={"prompt": CAPITAL, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Paris"
        assert error_body(raw.get("/models", headers={"x-api-key": "wrong"}), 401)["code"] == "invalid_api_key"
        err = error_body(raw.post("/chat/completions", headers={"x-api-key": live_server.api_key}, json={}), 400)
        assert err["param"] == "messages"


def test_a_json_body_sent_as_a_form_is_read_as_json(live_server):
    """curl -d '{...}' names the body a form (llama-server and Ollama read it as JSON): so does
    localllm. A body that is no JSON keeps its type and gets OpenAI's 400."""
    body = json.dumps({"prompt": CAPITAL, "max_tokens": 1, "temperature": 0})
    with httpx.Client(base_url=live_server.url, timeout=60,
                      headers={"authorization": f"Bearer {live_server.api_key}"}) as raw:
        for kind in ("application/x-www-form-urlencoded", "text/plain", None):
            headers = {"content-type": kind} if kind else {}
            r = raw.post("/v1/completions", content=body.encode(), headers=headers)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Paris", (kind, r.text)
        r = raw.post("/v1/completions", content=b"prompt=hi", headers={"content-type": "application/x-www-form-urlencoded"})
        error_body(r, 400)


# -- errors name what the client can do -----------------------------------------------------------


def test_a_model_without_a_chat_template_tells_the_client_to_send_a_plain_prompt():
    """The tokenizer's error names no command; the server adds what its client can do."""
    server = SimpleNamespace(tokenizer=Tokenizer(SimpleNamespace(chat_template=None), name="base"))
    with pytest.raises(APIError) as e:
        asyncio.run(Server.chat_prompt(server, [{"role": "user", "content": "hi"}], None))
    assert e.value.status == 400 and e.value.param == "messages"
    assert "has no chat template" in e.value.message and "/v1/completions" in e.value.message
    assert "--" not in e.value.message
