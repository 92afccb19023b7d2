"""The GGUF reader on the two real test models: exact values, cross-checked against
llama.cpp's own counts, and how long reading takes (printed, never asserted)."""

from __future__ import annotations

import time

import pytest

from localllm.config import CacheConfig, EngineConfig, SchedulerConfig
from localllm.gguf import GGUFArray, read_info

pytestmark = pytest.mark.model


def test_qwen(qwen_path):
    info = read_info(qwen_path)
    assert info.size_bytes == qwen_path.stat().st_size == 491_400_064
    assert (info.version, info.architecture, info.name) == (3, "qwen2", "Qwen2.5 Coder 0.5B Instruct AWQ")
    assert info.file_type == "Q4_K_M"  # general.file_type 15
    assert info.context_length == 32768
    assert (info.block_count, info.embedding_length, info.head_count, info.head_count_kv) == (24, 896, 14, 2)
    assert (info.key_length, info.value_length, info.head_dim) == (64, 64, 64)  # 896 / 14
    assert info.sliding_window is None
    assert info.parameters == 630_167_424  # output.weight is stored, not tied
    assert (info.num_tensors, info.tensor_bytes) == (291, 485_452_288)
    assert info.kv_bytes_per_token() == 2 * 24 * 2 * 64 * 2 == 12288
    assert info.chat_template.startswith("{%- if tools %}")
    assert "<|im_start|>" in info.chat_template
    assert (info.license, info.split_count) == (None, 1)
    assert info.metadata["tokenizer.ggml.tokens"] == GGUFArray("string", 151936)
    assert info.metadata["tokenizer.ggml.merges"] == GGUFArray("string", 151387)


def test_gemma(gemma_path):
    info = read_info(gemma_path)
    assert info.size_bytes == gemma_path.stat().st_size == 253_113_024
    assert (info.version, info.architecture, info.name) == (3, "gemma3", "Gemma 3 270m")
    assert info.file_type == "Q4_K_M"
    assert info.context_length == 32768
    assert (info.block_count, info.embedding_length, info.head_count, info.head_count_kv) == (18, 640, 4, 1)
    # Gemma's heads are wider than embedding / heads (160): the file says so.
    assert (info.key_length, info.value_length) == (256, 256)
    assert info.sliding_window == 512
    assert info.parameters == 268_098_176
    assert (info.num_tensors, info.tensor_bytes) == (236, 246_587_904)
    assert info.kv_bytes_per_token() == 2 * 18 * 1 * 256 * 2 == 18432
    assert info.chat_template is None
    assert (info.license, info.split_count) == ("gemma", 1)
    assert info.metadata["tokenizer.ggml.tokens"] == GGUFArray("string", 262144)


@pytest.mark.parametrize("model", ["qwen_path", "gemma_path"])
def test_counts_agree_with_llama_cpp(model, request):
    from localllm.runners.llamacpp import LlamaCppRunner

    path = request.getfixturevalue(model)
    info = read_info(path)
    config = EngineConfig(model_path=path, cache=CacheConfig(n_ctx=256),
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), n_threads=1)
    runner = LlamaCppRunner(config)
    try:
        assert runner.num_parameters == info.parameters
        assert runner.weights_bytes == info.tensor_bytes
        assert runner.vocab.n_vocab == info.metadata["tokenizer.ggml.tokens"].length
        assert (runner.vocab.chat_template is None) == (info.chat_template is None)
        if info.chat_template is not None:
            assert runner.vocab.chat_template == info.chat_template
        assert runner.n_swa == (info.sliding_window or 0)
    finally:
        runner.close()


def test_read_time(qwen_path, gemma_path):
    for path in (qwen_path, gemma_path):
        read_info(path)  # page the header in once; the figure below is the parse itself
        times = []
        for _ in range(5):
            start = time.perf_counter()
            read_info(path)
            times.append(time.perf_counter() - start)
        times.sort()
        print(f"\nread_info({path.name}): median {times[2] * 1000:.1f} ms, "
              f"min {times[0] * 1000:.1f} ms ({path.stat().st_size / 1e6:.0f} MB file)")
