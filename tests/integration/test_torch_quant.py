"""The torch runner's weight schemes on the real Qwen file: Q4_K tensors become int4 groups
with the very weights llama.cpp's dequantization gives, and the int4 / int8 layers multiply
like the float weights they stand for."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from localllm.runners.torch.quant import Int4Linear, Int8Linear, int4_groups, q4k_groups  # noqa: E402
from localllm.runners.torch.weights import GGUFWeights  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def weights(qwen_path):
    return GGUFWeights(qwen_path)


def first_of(weights: GGUFWeights, kind: str) -> str:
    return next(n for n in weights._tensors if n.endswith(".weight") and weights.tensor_type(n) == kind)


def test_q4k_groups_are_the_dequantized_weights_exactly(weights):
    name = first_of(weights, "Q4_K")
    data, rows, cols = weights.raw(name)
    q, scale, minimum = q4k_groups(data, rows, cols)
    assert q.shape == (rows, cols) and q.max() <= 15 and scale.shape == (rows, cols // 32)
    rebuilt = (torch.from_numpy(q.astype("float32")).reshape(rows, cols // 32, 32)
               * torch.from_numpy(scale)[..., None] - torch.from_numpy(minimum)[..., None]).reshape(rows, cols)
    assert torch.equal(rebuilt, weights.get(name))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_0", "Q8_0", "Q6_K", "requantized int4"])
def test_quantized_layers_multiply_like_their_float_weights(weights, kind):
    name = first_of(weights, "Q5_0" if kind == "requantized int4" else kind)
    w = weights.get(name)
    if kind == "Q4_K":
        layer = Int4Linear.from_groups(*q4k_groups(*weights.raw(name)))
    elif kind == "requantized int4":
        layer = Int4Linear.from_groups(*int4_groups(w))
    else:
        layer = Int8Linear.from_float(w)
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0))
    want = x @ w.t()
    got = layer(x).float()
    rel = ((got - want).norm() / want.norm()).item()
    # bfloat16 activations and outputs (~0.3 %), int8 rows (0.9-1.5 %); int4 groups of what was
    # stored at 5 bits lose one bit per weight (~8 %), which is why Q5_0 goes to int8.
    assert rel < (0.09 if kind == "requantized int4" else 0.02), f"{kind}: relative error {rel:.4f}"


def test_converted_weights_are_kept_and_read_back(gemma_path, tmp_path, caplog):
    import logging

    from localllm.config import CacheConfig, EngineConfig
    from localllm.runners.torch.runner import TorchRunner

    config = EngineConfig(model_path=gemma_path, cache=CacheConfig(n_ctx=256), n_threads=2, runner="torch",
                          weights_cache_dir=tmp_path / "weights")

    def first_logits() -> tuple[bool, "torch.Tensor"]:
        from localllm.engine.request import SamplingParams, Sequence
        from localllm.engine.scheduler import ScheduledSeq, SchedulerOutput

        runner = TorchRunner(config, scheme="int4-int8-bf16")  # a scheme that converts every matrix
        try:
            seq = Sequence(prompt_token_ids=[2, 651, 6037, 532, 9079], params=SamplingParams())
            seq.block_table = [0]
            runner.attach(seq, 0)
            return runner.weights_from_cache, runner.execute(SchedulerOutput([ScheduledSeq(seq, 5)])).copy()
        finally:
            runner.close()

    converted, logits = first_logits()
    (cached_file,) = (tmp_path / "weights").iterdir()
    cached, again = first_logits()
    assert (converted, cached) == (False, True)
    assert (logits == again).all()  # the same tensors, so bit for bit the same logits
    cached_file.write_bytes(cached_file.read_bytes()[:1000])  # damaged: dropped, converted again
    with caplog.at_level(logging.WARNING, logger="localllm"):
        converted, third = first_logits()
    assert not converted and (third == logits).all()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"dropped the converted weights {cached_file.name}"]
    assert cached_file.stat().st_size > 1000  # written again


def test_gguf_blocks_scheme_reads_the_files_blocks_in_place(qwen_path, tmp_path):
    """The "gguf-blocks" scheme: Q5_0 / Q8_0 layers multiply the file's own blocks with the
    native kernel (8 rows interleaved: the same bytes rearranged as they are loaded). Where the vector loops run (AVX2 and up)
    that is every matrix, and the Q5_0 embedding table too: nothing is converted, no cache
    file is written, and the second load gives the same logits bit for bit. On the scalar
    tier the K-quants are converted once and read back from the cache."""
    from localllm.config import CacheConfig, EngineConfig
    from localllm.engine.request import SamplingParams, Sequence
    from localllm.engine.scheduler import ScheduledSeq, SchedulerOutput
    from localllm.runners.torch import native
    from localllm.runners.torch.quant import BlockEmbedding, BlockLinear
    from localllm.runners.torch.runner import TorchRunner

    if not native.available():
        pytest.skip("localllm._native was not built here")
    config = EngineConfig(model_path=qwen_path, cache=CacheConfig(n_ctx=256), n_threads=2, runner="torch",
                          weights_cache_dir=tmp_path / "weights")
    results = []
    for _ in range(2):
        runner = TorchRunner(config, scheme="gguf-blocks")
        try:
            layers = runner.model.layers[0]
            kinds = {"q": type(layers["qkv"].layer_of(0)).__name__, "gate": type(layers["gate_up"].layer_of(0)).__name__,
                     "down": type(layers["down"]).__name__, "q kind": layers["qkv"].layer_of(0).kind}
            assert isinstance(runner.model.lm_head, BlockLinear) and runner.model.lm_head.kind == "Q8_0R"
            seq = Sequence(prompt_token_ids=runner.vocab.tokenize(b"def add(a, b):", True, False),
                           params=SamplingParams())
            seq.block_table = [0]
            runner.attach(seq, 0)
            logits = runner.execute(SchedulerOutput([ScheduledSeq(seq, seq.num_prompt_tokens)])).copy()
            embed = runner.model.embed
            results.append(((runner.weights_in_place, runner.weights_from_cache), kinds, logits))
        finally:
            runner.close()
    (first_cached, kinds, logits), (second_cached, kinds2, logits2) = results
    if native.vector_loops():
        assert (first_cached, second_cached) == ((True, False), (True, False))
        assert not (tmp_path / "weights").exists()
        assert isinstance(embed, BlockEmbedding) and embed.kind == "Q5_0"
    else:
        assert (first_cached, second_cached) == ((False, False), (False, True))
    assert (logits == logits2).all()
    assert kinds == kinds2 == {"q": "BlockLinear", "gate": "BlockLinear", "down": kinds["down"],
                               "q kind": kinds["q kind"]}
    # Q5_0 / Q8_0 with 8 rows interleaved on every tier; AVX2 and up: Q4_K / Q6_K read in place too
    assert kinds["q kind"] == "Q5_0R"
    if native.vector_loops():
        assert kinds["down"] == "BlockLinear"
    else:  # the scalar tier: Q4_K / Q6_K as the default scheme's layers
        assert kinds["down"] in ("Int4Linear", "Int8Linear")
    assert (logits == logits2).all()


@pytest.mark.parametrize("model", ["qwen", "gemma"])
def test_an_embedding_table_read_in_place_gives_the_dequantized_rows_bit_for_bit(model, qwen_path, gemma_path):
    """The blocks scheme's embedding table (Qwen's Q5_0, Gemma's Q8_0) looks up the same float32
    rows as the table dequantized whole, for any shape of token ids, repeated ones included."""
    from localllm.runners.torch import native
    from localllm.runners.torch.layers import LayerSource
    from localllm.runners.torch.quant import BlockEmbedding
    from localllm.runners.torch.weights import GGUFWeights

    if not native.available():
        pytest.skip("localllm._native was not built here")
    weights = GGUFWeights(qwen_path if model == "qwen" else gemma_path)
    table = LayerSource(weights, torch.float32, "cpu", blocks=True).embedding("token_embd.weight", torch.float32)
    assert isinstance(table, BlockEmbedding) and table.kind == {"qwen": "Q5_0", "gemma": "Q8_0"}[model]
    whole = weights.get("token_embd.weight")
    assert table.shape == tuple(whole.shape)
    tokens = torch.tensor([[0, 7, 7, whole.shape[0] - 1], [151, 2, 3, 100]])
    got = table[tokens]
    assert got.shape == (2, 4, whole.shape[1]) and got.dtype == torch.float32
    assert torch.equal(got, whole[tokens])
