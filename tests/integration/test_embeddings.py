"""The Embedder on a real embedding model (all-MiniLM-L6-v2, f16 GGUF), checked against
sentence-transformers on the safetensors folder it was converted from (its vectors stored once
in tests/data/minilm_reference.json); and on a tiny random decoder with last-token pooling (the
shape of Qwen3-Embedding)."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import numpy as np
import pytest

from localllm.engine.embedder import Embedder, is_embedding_model
from localllm.errors import EngineError, UsageError
from localllm.gguf import embedding_pooling, read_info
from tiny_gguf import write_tiny_gguf

SENTENCES = [
    "The cat sits outside.",
    "A man is playing guitar.",
    "I love pasta.",
    "The new movie is awesome!",
    "The cat plays in the garden.",
    "A woman watches TV.",
    "The new movie is so great.",
    "Do you like pizza?",
    "How do I reverse a linked list in Python?",
    "def add(a, b): return a + b",
    "Quarterly revenue grew 12.5% to $3.4 billion in 2025.",
    "Photosynthesis turns light, water and carbon dioxide into sugar.",
    "Café au lait, crème brûlée and naïve résumés.",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
    "e-mail me at someone@example.com before 5 p.m.",
    "Berlin is the capital of Germany.",
    "Paris is the capital of France.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Machine learning models need data; good data beats more data.",
    "A long sentence about embeddings that keeps going with more and more words, clauses, "
    "lists of things (apples, pears, plums), numbers like 42 and 1,024, and a question at the "
    "end: does pooling over every token still work when the input is this long?",
]


@pytest.fixture(scope="module")
def embedder(minilm_path):
    e = Embedder(minilm_path, n_threads=2)
    yield e
    e.close()


REFERENCE = Path(__file__).resolve().parent.parent / "data" / "minilm_reference.json"


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' own vectors (20, 384) and token ids of SENTENCES, computed once
    from the safetensors folder the GGUF was converted from (scripts/minilm_reference.py)."""
    data = json.loads(REFERENCE.read_text())
    assert data["sentences"] == SENTENCES, "the sentences changed: run scripts/minilm_reference.py"
    return np.array(data["vectors"], dtype=np.float32), data["token_ids"]


@pytest.mark.model
def test_is_embedding_model(minilm_path, qwen_path):
    assert is_embedding_model(minilm_path)
    assert not is_embedding_model(qwen_path)


@pytest.mark.model
def test_describes_itself(embedder):
    assert (embedder.name, embedder.dim, embedder.n_ctx, embedder.n_vocab) == (
        "all-minilm-l6-v2-f16", 384, 512, 30522)
    assert (embedder.pooling, embedder.normalize) == ("mean", True)


@pytest.mark.model
def test_not_an_embedding_model(qwen_path):
    with pytest.raises(UsageError, match="not an embedding model"):
        Embedder(qwen_path)


@pytest.mark.model
def test_tokens_match_sentence_transformers(embedder, reference):
    _, token_ids = reference
    assert [embedder.tokenize(s) for s in SENTENCES] == token_ids


@pytest.mark.model
def test_vectors_match_sentence_transformers(embedder, reference):
    want, _ = reference
    got = np.array(embedder.embed([embedder.tokenize(s) for s in SENTENCES]))  # (20, 384)
    assert got.shape == (20, 384)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    cosine = (got * want).sum(axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.999, cosine
    # Texts that mean the same are nearer than texts that do not.
    assert got[3] @ got[6] > got[3] @ got[2]


@pytest.mark.model
def test_a_batch_equals_one_at_a_time(embedder):
    inputs = [embedder.tokenize(s) for s in SENTENCES]
    inputs += [[101], [101, 102], embedder.tokenize("hello"), list(range(1000, 1200))]
    inputs += [embedder.tokenize(f"sentence {i} " * (i + 1)) for i in range(8)]
    random.Random(0).shuffle(inputs)
    assert len(inputs) == 32 and max(map(len, inputs)) >= 64
    batch = np.array(embedder.embed(inputs))  # (32, 384)
    alone = np.array([embedder.embed([ids])[0] for ids in inputs])
    np.testing.assert_allclose(batch, alone, rtol=0, atol=1e-5)


@pytest.mark.model
def test_threads_share_one_embedder(embedder):
    inputs = [embedder.tokenize(s) for s in SENTENCES[:8]]
    want = embedder.embed(inputs)
    results = [None] * 4

    def work(i):
        results[i] = embedder.embed(inputs)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.model
def test_a_long_text_is_cut_to_fit_between_the_models_special_tokens(embedder):
    text = "def f(x):\n    return x  # a comment that runs on\n" * 60
    whole = embedder.tokenize(text)
    assert len(whole) > 512 and embedder.tokenize(text, 10**6) == whole
    cut = embedder.tokenize(text, 512)
    assert len(cut) == 512 and cut[0] == whole[0] == 101 and cut[-1] == whole[-1] == 102  # [CLS] ... [SEP]
    assert cut[1:-1] == whole[1:511]
    assert embedder.tokenize("short", 512) == embedder.tokenize("short")


@pytest.mark.model
def test_bad_inputs(embedder):
    assert len(embedder.embed([[101] * 512])[0]) == 384  # exactly the limit
    with pytest.raises(UsageError, match="at most 512 tokens"):
        embedder.embed([[101, 102], [101] * 513])
    with pytest.raises(UsageError, match="input 1 is empty"):
        embedder.embed([[101, 102], []])
    with pytest.raises(UsageError, match="at least one input"):
        embedder.embed([])
    with pytest.raises(UsageError, match="not a token id"):
        embedder.embed([[101, 30522]])
    with pytest.raises(UsageError, match="not a token id"):
        embedder.embed([[101, -1]])
    with pytest.raises(UsageError, match="must be text"):
        embedder.tokenize(b"bytes")


@pytest.mark.model
def test_closed(minilm_path):
    e = Embedder(minilm_path, n_threads=1)
    e.close()
    e.close()
    with pytest.raises(EngineError, match="closed"):
        e.embed([[101, 102]])


# -- a decoder that pools its last token (Qwen3-Embedding's shape), on a tiny random model --


@pytest.fixture(scope="module")
def tiny_last(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("tiny-emb") / "tiny-last.gguf", "qwen2", pooling="last")
    e = Embedder(path, n_threads=2)
    yield e
    e.close()


def test_pooling_from_metadata(tmp_path):
    chat = write_tiny_gguf(tmp_path / "chat.gguf", "qwen2")
    assert embedding_pooling(read_info(chat)) is None and not is_embedding_model(chat)
    for pooling in ("mean", "cls", "last"):
        path = write_tiny_gguf(tmp_path / f"{pooling}.gguf", "qwen2", pooling=pooling)
        assert embedding_pooling(read_info(path)) == pooling
    assert embedding_pooling(read_info(write_tiny_gguf(tmp_path / "rank.gguf", "qwen2", pooling="rank"))) is None


def test_decoder_last_token_pooling(tiny_last):
    assert (tiny_last.pooling, tiny_last.n_ctx, tiny_last.dim) == ("last", 1024, 64)
    rng = random.Random(1)
    inputs = [[rng.randrange(tiny_last.n_vocab) for _ in range(rng.randint(1, 90))] for _ in range(32)]
    batch = np.array(tiny_last.embed(inputs))  # (32, 64)
    alone = np.array([tiny_last.embed([ids])[0] for ids in inputs])
    np.testing.assert_allclose(batch, alone, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-6)
    # The last token's state sees the whole input: the same last token after another prefix differs.
    a, b = tiny_last.embed([[10, 11, 12], [20, 21, 12]])
    assert not np.allclose(a, b, atol=1e-3)
