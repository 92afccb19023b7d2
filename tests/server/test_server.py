"""The HTTP door: a real `localllm serve` process driven by the official openai client (and raw
httpx where the wire itself is the point), on Qwen2.5-Coder-0.5B."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families


pytestmark = pytest.mark.model

FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]
FIB = "def fibonacci(n):"
# "def fibonacci(n):" in Qwen2.5's vocabulary; test_prompt_as_token_ids checks them through echo.
FIB_IDS = [750, 75698, 1445, 1648]
ERROR_KEYS = {"message", "type", "param", "code"}


# -- fixtures and helpers --------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def http(live_server) -> httpx.Client:
    headers = {"Authorization": f"Bearer {live_server.api_key}"}
    with httpx.Client(base_url=live_server.url, headers=headers, timeout=120) as c:
        yield c


def error_body(response: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a response, after checking its status and shape."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == ERROR_KEYS
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["type"], str)
    return body["error"]


def metrics(http: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics by its name with labels, e.g. 'localllm_kv_blocks_used'."""
    response = http.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_idle(http: httpx.Client, timeout_s: float = 5.0) -> str:
    """Poll /metrics until no KV block and no sequence is in use; returns the last exposition."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = http.get("/metrics").text
        if ("localllm_kv_blocks_used 0.0" in text.splitlines()
                and "localllm_requests_running 0.0" in text.splitlines()):
            return text
        if time.monotonic() > deadline:
            lines = [line for line in text.splitlines() if line.startswith("localllm_") and "bucket" not in line]
            pytest.fail(f"the server still holds work {timeout_s} s later:\n" + "\n".join(lines))
        time.sleep(0.1)


def sse_events(lines) -> list:
    """The JSON payloads of an SSE stream's data lines, up to [DONE]."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", line
            continue
        if line == "data: [DONE]":
            return events
        events.append(json.loads(line[len("data: "):]))
    raise AssertionError("the stream ended without data: [DONE]")


# -- models ----------------------------------------------------------------------------------


def test_models_list_has_exactly_the_served_files(client, live_server, minilm_path):
    models = client.models.list()
    assert [m.id for m in models.data] == [live_server.model_path.stem, minilm_path.stem]  # chat model first
    assert models.data[0].object == "model"
    assert client.models.retrieve(minilm_path.stem).context_length == 512


def test_start_up_lines_name_the_url_and_the_kv_cache(live_server):
    lines = live_server.log_path.read_text().splitlines()
    assert f"localllm serve: http://127.0.0.1:{live_server.port}/v1  model {live_server.model_path.stem}" in lines
    # 4,096 tokens (--ctx) x 12,288 bytes: llama.cpp's own report of what it allocated.
    assert "KV cache: 4,096 tokens (48 MiB, f16): 1 conversation of 4k" in lines
    assert "Context: 4096 tokens per request, prompt and answer together" in lines


def test_models_report_the_context_that_serve_printed(live_server, http, model_id):
    """context_length (and vLLM's max_model_len, llama-server's meta.n_ctx) is the number the
    start-up printed; a request of exactly that many tokens is served, one more is a 400."""
    printed = next(int(line.split()[1]) for line in live_server.log().splitlines() if line.startswith("Context: "))
    for card in (http.get("/v1/models").json()["data"][0], http.get(f"/v1/models/{model_id}").json()):
        assert card["context_length"] == card["max_model_len"] == card["meta"]["n_ctx"] == printed
        assert card["meta"]["n_ctx_train"] == 32768  # Qwen2.5-Coder-0.5B's qwen2.context_length
        assert card["meta"]["n_vocab"] == 151936
    body = {"model": model_id, "prompt": FIB_IDS, "stream": True}
    with http.stream("POST", "/v1/completions", json=body | {"max_tokens": printed - len(FIB_IDS)}) as response:
        assert response.status_code == 200  # admitted; leaving now aborts it
        next(response.iter_lines())
    err = error_body(http.post("/v1/completions", json=body | {"max_tokens": printed - len(FIB_IDS) + 1}), 400)
    assert err["code"] == "context_length_exceeded" and f"maximum context length is {printed} tokens" in err["message"]
    wait_idle(http)


def test_model_retrieve(client, model_id):
    card = client.models.retrieve(model_id)
    assert card.id == model_id
    assert card.object == "model"
    assert card.owned_by == "localllm"


def test_model_retrieve_unknown_is_404(client, http, model_id):
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.status_code == 404
    assert e.value.code == "model_not_found"
    err = error_body(http.get("/v1/models/no-such-model"), 404)
    assert err["code"] == "model_not_found"
    assert err["param"] == "model"
    assert "no-such-model" in err["message"] and model_id in err["message"]


# -- chat ------------------------------------------------------------------------------------


def test_chat(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=FRANCE, temperature=0, max_tokens=16)
    assert r.object == "chat.completion"
    assert r.model == model_id
    assert r.id.startswith("chatcmpl-")
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert r.usage.prompt_tokens > 0
    assert r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert type(r.usage.prompt_tokens_details.cached_tokens) is int
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens <= r.usage.prompt_tokens


def test_chat_stream_matches_non_streaming(client, model_id):
    # Both compared requests find the prompt's blocks cached: greedy text computed over a cached
    # prefix may differ from a cold prefill's in its last float bits (and so, rarely, in a token).
    # Drafting is on, and how far it drafts follows measured step times; llama.cpp computes a
    # position slightly differently in a verify batch than alone, so the two answers may part,
    # but only at a near-tie (as in tests/integration/test_spec_decode_engine.py).
    client.chat.completions.create(model=model_id, messages=HAIKU, temperature=0, max_tokens=1)
    whole = client.chat.completions.create(model=model_id, messages=HAIKU, temperature=0, max_tokens=24,
                                           logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(model=model_id, messages=HAIKU, temperature=0, max_tokens=24,
                                                 logprobs=True, top_logprobs=2,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert "".join(t.token for t in streamed) == text  # every token's text arrived, once, in order
    same = text == whole.choices[0].message.content
    if not same:
        plain = whole.choices[0].logprobs.content
        d = next(i for i, (a, b) in enumerate(zip(streamed, plain)) if a.token != b.token)
        tops = {t.token: t.logprob for t in plain[d].top_logprobs}
        assert streamed[d].token in tops and plain[d].logprob - tops[streamed[d].token] < 0.2, (d, tops)
    assert text  # a stream of nothing would match an empty answer
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == len(streamed)
    if same:
        assert finishing[0].choices[0].finish_reason == whole.choices[0].finish_reason
        assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_concurrent_streams_interleave(live_server, model_id):
    """Four streams share the engine's steps: each pair's token arrival intervals overlap."""

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[list[float], str | None]:
        arrivals, finish = [], None
        stream = await client.chat.completions.create(
            model=model_id, temperature=0, max_tokens=24, stream=True,
            messages=[{"role": "user", "content": f"Count from {i * 10} to {i * 10 + 30}, separated by spaces."}])
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return arrivals, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=live_server.base_url, api_key=live_server.api_key, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(4)))

    results = asyncio.run(main())
    assert [finish for _, finish in results] == ["length"] * 4
    spans = [(arrivals[0], arrivals[-1]) for arrivals, _ in results]
    assert all(len(arrivals) >= 10 for arrivals, _ in results)
    for (a_first, a_last), (b_first, b_last) in itertools.combinations(spans, 2):
        assert b_first < a_last and a_first < b_last, f"streams ran one after another: {spans}"


# -- text completions ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fib(client, model_id):
    """The greedy completion of FIB, 32 tokens."""
    return client.completions.create(model=model_id, prompt=FIB, temperature=0, max_tokens=32)


def test_completion(fib, model_id):
    assert fib.object == "text_completion"
    assert fib.model == model_id
    choice = fib.choices[0]
    assert "return" in choice.text or "if" in choice.text
    assert choice.finish_reason == "length"
    assert fib.usage.completion_tokens == 32
    assert fib.usage.prompt_tokens == len(FIB_IDS)
    assert fib.usage.total_tokens == fib.usage.prompt_tokens + 32


def test_completion_echo(client, model_id, fib):
    r = client.completions.create(model=model_id, prompt=FIB, temperature=0, max_tokens=32, echo=True)
    assert r.choices[0].text == FIB + fib.choices[0].text


def test_completion_logprobs(client, model_id, fib):
    r = client.completions.create(model=model_id, prompt=FIB, temperature=0, max_tokens=32, logprobs=1)
    choice = r.choices[0]
    assert choice.text == fib.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 32
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_prompt_as_token_ids(client, model_id, fib):
    r = client.completions.create(model=model_id, prompt=FIB_IDS, temperature=0, max_tokens=32, echo=True)
    assert r.choices[0].text == FIB + fib.choices[0].text
    assert r.usage.prompt_tokens == len(FIB_IDS)


def test_stop_string(client, model_id):
    prompt = FIB + "\n"
    whole = client.completions.create(model=model_id, prompt=prompt, temperature=0, max_tokens=32)
    first_line = whole.choices[0].text.split("\n")[0]
    assert first_line.strip()  # the stop must cut real text, not an empty answer
    r = client.completions.create(model=model_id, prompt=prompt, temperature=0, max_tokens=32, stop=["\n"])
    choice = r.choices[0]
    assert "\n" not in choice.text
    assert choice.text == first_line
    assert choice.finish_reason == "stop"
    assert r.usage.completion_tokens < 32


def test_seed_determinism(client, model_id):
    # 8 tokens: llama.cpp's logits move in their last bits with where a sequence's KV cells lie
    # and with the batch's shape (the second request reuses the first's cached prompt, drafts
    # change the steps), so a seeded sample is repeatable up to near-ties; a fresh-clone CI run
    # parted at token 10 of 24.
    def sample(seed: int) -> str:
        r = client.completions.create(model=model_id, prompt="A list of random animal names:", temperature=1.0,
                                      seed=seed, max_tokens=8)
        assert r.choices[0].finish_reason in ("length", "stop")
        return r.choices[0].text

    first, again, other = sample(7), sample(7), sample(8)
    assert first == again
    assert first != other  # the seed matters, so temperature 1.0 really samples


def test_n_choices(client, model_id):
    r = client.completions.create(model=model_id, prompt="A list of random animal names:", temperature=1.0,
                                  seed=7, max_tokens=12, n=2, logprobs=0)
    assert [c.index for c in r.choices] == [0, 1]
    counts = [len(c.logprobs.tokens) for c in r.choices]
    for choice, count in zip(r.choices, counts):
        assert choice.finish_reason in ("length", "stop")
        assert 1 <= count <= 12
        assert (count == 12) == (choice.finish_reason == "length")
    assert r.usage.completion_tokens == sum(counts)
    assert r.usage.total_tokens == r.usage.prompt_tokens + sum(counts)

    chat = client.chat.completions.create(model=model_id, messages=FRANCE, temperature=1.0, seed=7,
                                          max_tokens=8, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(c.finish_reason in ("length", "stop") and c.message.content for c in chat.choices)


# -- errors ----------------------------------------------------------------------------------


def test_temperature_out_of_range_is_400(client, http, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=FRANCE, temperature=5)
    assert e.value.status_code == 400
    assert e.value.param == "temperature"
    assert "temperature" in e.value.body["message"]
    err = error_body(http.post("/v1/completions", json={"model": model_id, "prompt": "x", "temperature": 5}), 400)
    assert err["param"] == "temperature"
    assert err["type"] == "invalid_request_error"


LONG_TEXT = "hello world " * 3000  # about 6000 tokens, over the test server's context of 4096


def _assert_context_message(message: str, max_tokens: int) -> int:
    m = re.search(r"maximum context length is 4096 tokens\. However, you requested (\d+) tokens "
                  r"\((\d+) in the prompt, (\d+) for the completion\)", message)
    assert m, message
    requested, num_prompt, num_completion = map(int, m.groups())
    assert num_completion == max_tokens
    assert requested == num_prompt + num_completion
    assert num_prompt > 5000
    return num_prompt


def test_prompt_over_the_context_is_400(client, http, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": LONG_TEXT}],
                                       max_tokens=16)
    assert e.value.code == "context_length_exceeded"
    assert e.value.param == "messages"
    _assert_context_message(e.value.body["message"], 16)

    err = error_body(http.post("/v1/completions", json={"model": model_id, "prompt": LONG_TEXT, "max_tokens": 16}),
                     400)
    assert err["code"] == "context_length_exceeded"
    assert err["param"] == "prompt"
    assert _assert_context_message(err["message"], 16) == 6001  # "hello" and " world" 3000 times, and the last " "


def test_completion_room_over_the_context_is_400(http, model_id):
    err = error_body(http.post("/v1/completions", json={"model": model_id, "prompt": FIB, "max_tokens": 4093}), 400)
    assert err["code"] == "context_length_exceeded"
    assert "4097 tokens (4 in the prompt, 4093 for the completion)" in err["message"]


def test_unknown_model_is_404(client, http):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=FRANCE, max_tokens=4)
    assert e.value.status_code == 404
    assert e.value.code == "model_not_found"
    assert e.value.param == "model"
    err = error_body(http.post("/v1/completions", json={"model": "gpt-4o", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found"
    assert "gpt-4o" in err["message"]


def test_wrong_and_missing_key_are_401(live_server, model_id):
    with openai.OpenAI(base_url=live_server.base_url, api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.chat.completions.create(model=model_id, messages=FRANCE, max_tokens=4)
    assert e.value.status_code == 401
    assert e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live_server.base_url, api_key="sk-wrong", max_retries=0).models.list()

    body = {"model": model_id, "messages": FRANCE, "max_tokens": 4}
    for headers in ({}, {"Authorization": "sk-test"}, {"Authorization": "Basic c2stdGVzdA=="},
                    {"Authorization": "Bearer sk-tes"}):
        err = error_body(httpx.post(f"{live_server.base_url}/chat/completions", json=body, headers=headers), 401)
        assert err["code"] == "invalid_api_key"
    # Outside /v1 nothing needs the key.
    assert httpx.get(f"{live_server.url}/health").json() == {"status": "ok", "model": model_id,
                                                             "loaded": [model_id, "all-minilm-l6-v2-f16"]}


def test_unknown_route_is_404(http):
    for method, path in (("GET", "/v1/nothing"), ("POST", "/v1/chat/complete"), ("GET", "/nothing")):
        err = error_body(http.request(method, path, json={}), 404)
        assert err["code"] == "not_found"
        assert path in err["message"]


def test_invalid_json_is_400(http):
    err = error_body(http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                               headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]


def test_unknown_parameter_is_400(client, http, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=FRANCE, max_tokens=4, extra_body={"foo": 1})
    assert e.value.param == "foo"
    assert "foo" in e.value.body["message"]
    err = error_body(http.post("/v1/completions", json={"model": model_id, "prompt": "x", "frobnicate": True}), 400)
    assert err["param"] == "frobnicate"
    assert "frobnicate" in err["message"]


def test_invalid_values_are_400_not_500(http, model_id):
    cases = [
        ("/v1/chat/completions", {"model": model_id, "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": model_id, "messages": [{"role": "wizard", "content": "x"}]},
         "messages.0.role"),
        ("/v1/chat/completions", {"model": model_id, "messages": FRANCE, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"model": model_id, "messages": FRANCE, "n": 9}, "n"),
        ("/v1/completions", {"model": model_id}, "prompt"),
        ("/v1/completions", {"model": model_id, "prompt": ""}, "prompt"),
        ("/v1/completions", {"model": model_id, "prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"model": model_id, "prompt": "x", "top_p": 0}, "top_p"),
    ]
    for path, body, param in cases:
        err = error_body(http.post(path, json=body), 400)
        assert err["param"] == param, (body, err)


def test_body_over_8_mib_is_413(http, model_id):
    prefix = json.dumps({"model": model_id, "prompt": ""})[:-2].encode()
    body = prefix + b"a" * (8 * 1024 * 1024) + b'"}'
    err = error_body(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 413)
    assert err["code"] == "request_too_large"
    assert str(len(body)) in err["message"] and str(8 * 1024 * 1024) in err["message"]


def test_chunked_body_over_8_mib_is_413(http, model_id):
    """A body without Content-Length is held to the same limit."""
    prefix = json.dumps({"model": model_id, "prompt": ""})[:-2].encode()

    def chunks():
        yield prefix
        for _ in range(9):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    response = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    err = error_body(response, 413)
    assert err["code"] == "request_too_large"


def test_chunked_body_under_the_limit_is_served(http, model_id):
    def chunks():
        yield json.dumps({"model": model_id, "prompt": FIB, "temperature": 0, "max_tokens": 4}).encode()

    response = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


# -- clients that leave ----------------------------------------------------------------------


def test_disconnected_stream_frees_its_blocks(live_server, http, model_id):
    body = {"model": model_id, "stream": True, "max_tokens": 2000, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        first_three = [json.loads(next(lines)[len("data: "):]) for _ in range(3)]
        assert first_three[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(c["choices"][0]["finish_reason"] is None for c in first_three)
        samples = metrics(http)
        assert samples["localllm_requests_running"] == 1.0
        assert samples["localllm_kv_blocks_used"] >= 1.0
    wait_idle(http, timeout_s=5)
    assert http.get("/health").json()["status"] == "ok"


@pytest.mark.heavy
def test_many_cancelled_streams_leave_the_server_clean(live_server, http, client, model_id, full):
    """Streams left after 0 to 10 chunks (40 in the test command's run, 200 under --full), eight
    at a time; test_cancel_storm.py covers the other moments a client can leave."""
    rng = random.Random(20240607)
    plan = [rng.randint(0, 10) for _ in range(200 if full else 40)]
    log_before = live_server.log()

    async def one(c: httpx.AsyncClient, gate: asyncio.Semaphore, i: int, num_chunks: int) -> int:
        body = {"model": model_id, "stream": True, "max_tokens": 64, "temperature": 0.8, "seed": i,
                "messages": [{"role": "user", "content": f"Tell me a fact about the number {i}."}]}
        async with gate:
            async with c.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                read = 0
                async for line in response.aiter_lines():
                    if read >= num_chunks:
                        break
                    if line == "data: [DONE]":
                        return num_chunks  # a short answer ended first: nothing was left to cancel
                    if line.startswith("data: "):
                        read += 1
                return read

    async def main():
        gate = asyncio.Semaphore(8)
        headers = {"Authorization": f"Bearer {live_server.api_key}"}
        async with httpx.AsyncClient(base_url=live_server.url, headers=headers, timeout=60) as c:
            return await asyncio.gather(*(one(c, gate, i, k) for i, k in enumerate(plan)))

    read = asyncio.run(main())
    assert read == plan  # every stream gave as many chunks as we waited for, or ended first
    assert http.get("/health").json()["status"] == "ok"
    wait_idle(http, timeout_s=10)
    assert metrics(http)["localllm_requests_waiting"] == 0.0
    r = client.chat.completions.create(model=model_id, messages=FRANCE, temperature=0, max_tokens=16)
    assert "Paris" in r.choices[0].message.content
    new_log = live_server.log()[len(log_before):]
    assert "Traceback" not in new_log and "ERROR" not in new_log, new_log[-4000:]


def test_speculative_must_be_a_boolean(client, http, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=FRANCE, max_tokens=4,
                                       extra_body={"speculative": "yes"})
    assert e.value.status_code == 400
    assert e.value.param == "speculative"
    for path, body in (("/v1/chat/completions", {"model": model_id, "messages": FRANCE, "max_tokens": 4}),
                       ("/v1/completions", {"model": model_id, "prompt": "x", "max_tokens": 4})):
        for bad in ("yes", "true", 1, [True]):
            err = error_body(http.post(path, json=body | {"speculative": bad}), 400)
            assert err == {"message": "invalid value for 'speculative': Input should be a valid boolean",
                           "type": "invalid_request_error", "param": "speculative", "code": "invalid_value"}


COUNTING = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,"  # greedy continues it: drafts from the prompt agree


def test_speculative_false_turns_drafting_off_and_metrics_count_drafts(client, http, model_id):
    proposed, accepted = "localllm_draft_tokens_proposed_total", "localllm_draft_tokens_accepted_total"
    text = http.get("/metrics").text.splitlines()
    assert f"# TYPE {proposed} counter" in text and f"# TYPE {accepted} counter" in text

    def send_both(speculative: bool) -> None:  # a completion and a chat, drafting as asked
        r = client.completions.create(model=model_id, prompt=COUNTING, temperature=0, max_tokens=16,
                                      extra_body={"speculative": speculative})
        assert r.usage.completion_tokens > 0
        chat = client.chat.completions.create(model=model_id, messages=FRANCE, temperature=0, max_tokens=8,
                                              extra_body={"speculative": speculative})
        assert chat.choices[0].message.content

    before = metrics(http)
    send_both(False)
    after = metrics(http)
    assert (after[proposed], after[accepted]) == (before[proposed], before[accepted])
    send_both(True)
    drafted = metrics(http)
    assert drafted[proposed] > after[proposed]
    assert 0 < drafted[accepted] - after[accepted] <= drafted[proposed] - after[proposed]


# -- metrics and schema ----------------------------------------------------------------------


def test_metrics(http, client, model_id):
    before = metrics(http)
    r = client.completions.create(model=model_id, prompt=FIB, temperature=0, max_tokens=8)
    after = metrics(http)
    text = http.get("/metrics").text
    for name, kind in (("localllm_time_to_first_token_seconds", "histogram"),
                       ("localllm_kv_blocks_total", "gauge"),
                       ("localllm_preemptions_total", "gauge"),
                       ("localllm_prompt_tokens_total", "counter"),
                       ("localllm_generation_tokens_total", "counter")):
        assert f"# TYPE {name} {kind}" in text.splitlines(), name
    assert after["localllm_kv_blocks_total"] > 0
    assert after["localllm_preemptions_total"] >= 0
    assert (after["localllm_prompt_tokens_total"] - before["localllm_prompt_tokens_total"]
            == r.usage.prompt_tokens)
    assert (after["localllm_generation_tokens_total"] - before["localllm_generation_tokens_total"]
            == r.usage.completion_tokens == 8)
    ttft_count = "localllm_time_to_first_token_seconds_count"
    assert after[ttft_count] - before[ttft_count] == 1
    assert after['localllm_time_to_first_token_seconds_bucket{le="+Inf"}'] == after[ttft_count]
    # The server runs with --threads 2: both kinds of step on 2, fixed. A GPU build computes
    # the steps on the GPU, and the engine then chooses no CPU threads (all 0).
    import llama_cpp

    threads = 0 if llama_cpp.llama_supports_gpu_offload() else 2
    for name in ("localllm_cpu_threads", "localllm_cpu_threads_max", "localllm_cpu_threads_adaptive"):
        assert f"# TYPE {name} gauge" in text.splitlines(), name
    assert {k: v for k, v in after.items() if k.startswith("localllm_cpu_threads")} == {
        'localllm_cpu_threads{kind="decode"}': threads, 'localllm_cpu_threads{kind="prefill"}': threads,
        "localllm_cpu_threads_max": threads, "localllm_cpu_threads_adaptive": 0}


def test_openapi_lists_the_routes_with_request_schemas(http):
    spec = http.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, field in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        post = spec["paths"][path]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        schema = schemas[ref.rsplit("/", 1)[1]]
        assert field in schema["properties"]
        assert schema["required"] == [field]  # model may be left out: the served model (llama-server's way)
    # Errors are documented as they are sent: each protocol's object, never FastAPI's 422.
    assert {"/v1/messages", "/v1/messages/count_tokens"} <= set(spec["paths"])
    for path, path_item in spec["paths"].items():
        name = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
        for operation in path_item.values():
            assert "422" not in operation["responses"]
            assert operation["responses"]["400"]["content"]["application/json"]["schema"] == {
                "$ref": f"#/components/schemas/{name}"}
    assert schemas["ErrorBody"]["required"] == ["message", "type", "param", "code"]
    assert schemas["AnthropicErrorBody"]["required"] == ["type", "message"]
    assert "HTTPValidationError" not in schemas
