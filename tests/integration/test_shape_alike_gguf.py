"""scripts/shape_alike_gguf.py on the real Gemma model: the skeleton tokenizes like the real
file, and the file built from it has the real one's metadata and tensor table byte for byte,
the same config, and weights that llama.cpp runs to finite logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import shape_alike_gguf  # scripts/, on sys.path through conftest

from localllm.gguf import tensor_table
from localllm.runners.torch.weights import GGUFWeights

TEXTS = ["Hello, world!", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
         "<start_of_turn>user\nÜmlaut, 日本語 and 🙂<end_of_turn>", "  two spaces\t\ttabs\n\n"]


@pytest.fixture(scope="module")
def shape_alike(gemma_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("shape-alike")
    skeleton, built = folder / "gemma.skeleton.gguf", folder / "gemma.gguf"
    shape_alike_gguf.skeleton(gemma_path, skeleton)
    shape_alike_gguf.build(skeleton, built, seed=0)
    return skeleton, built


@pytest.mark.model
def test_the_skeleton_holds_the_metadata_and_the_tensor_list(gemma_path, shape_alike):
    skeleton, _ = shape_alike
    real, skel = shape_alike_gguf.read_metadata(gemma_path), shape_alike_gguf.read_metadata(skeleton)
    assert skel.tensors == []
    assert skel.kvs[:-1] == real.kvs  # in order, the vocabulary and its scores included
    assert skel.kvs[-1][0] == shape_alike_gguf.TENSORS_KEY
    listing = json.loads(skel.value(shape_alike_gguf.TENSORS_KEY))
    assert len(listing) == 236
    assert listing[:2] == [["output_norm.weight", "F32", [640]], ["token_embd.weight", "Q8_0", [640, 262144]]]
    assert listing == [[t.name, t.type_name, list(t.shape)] for t in tensor_table(gemma_path)[2]]
    assert skeleton.stat().st_size < 8_000_000


@pytest.mark.model
def test_the_skeleton_tokenizes_like_the_real_file(gemma_path, shape_alike):
    from llama_cpp import Llama

    real = Llama(str(gemma_path), vocab_only=True, verbose=False)
    skel = Llama(str(shape_alike[0]), vocab_only=True, verbose=False)
    for text in TEXTS:
        for special in (False, True):
            want = real.tokenize(text.encode(), add_bos=True, special=special)
            assert skel.tokenize(text.encode(), add_bos=True, special=special) == want
    assert real.tokenize(TEXTS[2].encode(), special=True)[:2] == [2, 105]  # <bos> <start_of_turn>


@pytest.mark.model
def test_the_built_file_is_the_real_one_but_for_tensor_contents(gemma_path, shape_alike):
    _, built = shape_alike
    real_meta, real_start, real_tensors = tensor_table(gemma_path)
    built_meta, built_start, built_tensors = tensor_table(built)
    assert built.stat().st_size == gemma_path.stat().st_size == 253_113_024
    assert built_start == real_start
    with open(gemma_path, "rb") as a, open(built, "rb") as b:
        assert a.read(real_start) == b.read(real_start)  # header, key/values and tensor table
    assert [(t.name, t.type_name, t.shape) for t in built_tensors] == \
        [(t.name, t.type_name, t.shape) for t in real_tensors]
    assert GGUFWeights(built).config() == GGUFWeights(gemma_path).config()


@pytest.mark.model
def test_the_built_weights_are_of_a_sane_size(shape_alike):
    weights = GGUFWeights(shape_alike[1])
    for name in ("blk.0.attn_v.weight", "blk.0.attn_k.weight", "blk.0.attn_output.weight",
                 "blk.0.ffn_down.weight"):  # Q8_0, Q5_0, Q4_K, Q6_K
        w = weights.get(name)
        assert 0.03 < float(w.std()) < 0.06, name
        assert float(w.abs().max()) < 0.5, name
    assert weights.get("blk.0.attn_q_norm.weight").eq(1.0).all()


@pytest.mark.model
def test_llama_cpp_runs_the_built_file(shape_alike, monkeypatch):
    import llama_cpp.llama_cpp as lib  # the module llama_cpp.Llama takes its defaults from
    from llama_cpp import Llama

    from localllm.runners.llamacpp import amx_compiled_in

    if amx_compiled_in():  # ggml's AMX kernels crash this llama.cpp: the runner's way around them
        default = lib.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        monkeypatch.setattr(lib, "llama_model_default_params", params)
    llm = Llama(str(shape_alike[1]), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    out = llm.create_completion("The quick brown fox", max_tokens=16, temperature=0.0)
    assert out["usage"]["completion_tokens"] == 16
    logits = np.array(llm.scores[:llm.n_tokens])  # (prompt + 15 generated, vocab): the 16th is not fed back
    assert logits.shape == (5 + 15, 262144)
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 0.1).all()


def test_an_unknown_tensor_type_fails_clearly():
    rng = np.random.default_rng(0)
    with pytest.raises(shape_alike_gguf.ShapeAlikeError, match="Q2_K, which this script cannot fill"):
        shape_alike_gguf.random_tensor("blk.0.ffn_up.weight", "Q2_K", [256, 4], rng)
    blocks = shape_alike_gguf.random_tensor("blk.0.ffn_up.weight", "Q6_K", [256, 4], rng)
    assert blocks.dtype == np.uint8 and blocks.shape == (4 * 210,)
    d = blocks.reshape(4, 210)[:, 208:].copy().view(np.float16)  # each block's scale
    assert ((d >= 1.5e-5) & (d < 4.5e-5)).all()
