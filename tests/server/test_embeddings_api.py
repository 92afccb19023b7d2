"""OpenAI's /v1/embeddings through a real `localllm serve --embedding-model` (all-MiniLM-L6-v2
beside Qwen2.5-Coder), driven by the official openai client. That the vectors are right
(cosine >= 0.999 to sentence-transformers' own) is tests/integration/test_embeddings.py's."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

pytestmark = pytest.mark.model

SENTENCES = [f"Sentence number {i} is about {topic}." for i, topic in enumerate(
    ["cats", "dogs", "the sea", "rust", "python", "tea", "rain", "trains"] * 4)]


@pytest.fixture(scope="module")
def model(minilm_path) -> str:
    return minilm_path.stem


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)], dtype=np.float32)


def test_float_and_base64_are_the_same_vectors(client, model):
    floats = client.embeddings.create(model=model, input="The cat sat on the mat.", encoding_format="float")
    packed = client.embeddings.create(model=model, input="The cat sat on the mat.")  # the SDK asks base64
    assert floats.model == model and len(floats.data) == 1
    v = vectors(floats)
    assert v.shape == (1, 384) and np.allclose(v, vectors(packed), atol=0)
    assert abs(float(np.linalg.norm(v)) - 1) < 1e-5
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 5


def test_a_batch_of_32_equals_one_at_a_time(client, model):
    batch = vectors(client.embeddings.create(model=model, input=SENTENCES, encoding_format="float"))
    alone = np.concatenate([vectors(client.embeddings.create(model=model, input=s, encoding_format="float"))
                            for s in SENTENCES])
    assert batch.shape == (32, 384)
    assert np.abs(batch - alone).max() < 1e-5
    same = batch @ batch.T
    assert same[0, 8] > same[0, 1]  # "cats" twice is nearer than cats and dogs


def test_token_ids_and_dimensions(client, keyed_http, live_server, model):
    text = client.embeddings.create(model=model, input="hello world", encoding_format="float")
    r = keyed_http.post("/v1/embeddings", json={"model": model, "input": [[101, 7592, 2088, 102]], "encoding_format": "base64"}).json()
    ids = np.frombuffer(base64.b64decode(r["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(ids - vectors(text)[0]).max() < 1e-5  # [CLS] hello world [SEP], as the tokenizer gives it
    short = vectors(client.embeddings.create(model=model, input="hello world", dimensions=128, encoding_format="float"))
    assert short.shape == (1, 128) and abs(float(np.linalg.norm(short)) - 1) < 1e-5




def test_bad_input_is_an_openai_4xx(client, keyed_http, live_server, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=live_server.model_path.stem, input="hi")
    assert e.value.code == "model_not_embedding" and f"embeds with '{model}'" in e.value.message
    assert "--" not in e.value.message  # what the client can do, not a flag of the server's command
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")
    bad = [{"input": []}, {"input": ""}, {"input": ["ok", ""]}, {"input": "word " * 2000, "truncate": False},
           {"input": "hi", "truncate": "yes"},
           {"input": [[5, 10**7]]}, {"input": "hi", "dimensions": 385}, {"input": "hi", "dimensions": 0},
           {"input": 5}, {"input": "hi", "encoding_format": "int8"}, {"input": [1.5]}, {"input": "hi", "extra": 1}]
    for body in bad:
        r = keyed_http.post("/v1/embeddings", json={"model": model} | body)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    over = keyed_http.post("/v1/embeddings", json={"model": model, "input": "word " * 2000,
                                                   "truncate": False}).json()["error"]["message"]
    assert "512" in over, over  # names the limit
    assert httpx.get(f"{live_server.url}/health").json()["status"] == "ok"



def test_an_input_over_the_context_is_cut_to_it_around_the_models_special_tokens(keyed_http, model):
    """As Ollama and sentence-transformers cut it. Continue's @codebase sends chunks of 500 of
    its own tokenizer's tokens, some over MiniLM's 512: one of them used to fail the batch."""
    def embed(inputs):
        r = keyed_http.post("/v1/embeddings", json={"model": model, "input": inputs})
        assert r.status_code == 200, r.text
        return r.json()

    long, longer = embed("word " * 600), embed("word " * 2000)
    assert long["usage"]["prompt_tokens"] == longer["usage"]["prompt_tokens"] == 512  # [CLS], 510 words, [SEP]
    assert long["data"][0]["embedding"] == longer["data"][0]["embedding"]  # both cut to the same tokens
    batch = embed(["short", "word " * 2000])  # one over-long chunk among others
    assert batch["data"][1]["embedding"] == longer["data"][0]["embedding"]
    assert batch["data"][0]["embedding"] == embed("short")["data"][0]["embedding"]
    cut_ids = embed([[101] + [2773] * 600 + [102]])  # token ids: the first 512 kept
    assert cut_ids["usage"]["prompt_tokens"] == 512
