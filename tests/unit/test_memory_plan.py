"""localllm.memory: the KV pool's size from a model's shape and the memory free, with no model."""

from pathlib import Path

import pytest

from localllm import memory
from localllm.errors import ModelLoadError
from localllm.gguf import GGUFInfo

MiB = 2**20


def qwen_like(context_length: int | None = 32768, weights: int = 463 * MiB) -> GGUFInfo:
    """Qwen2.5-0.5B's attention: 24 layers, 2 KV heads of 64."""
    return GGUFInfo(path=Path("/models/qwen.gguf"), size_bytes=weights, version=3, architecture="qwen2",
                    name=None, parameters=0, num_tensors=0, tensor_bytes=weights,
                    context_length=context_length, file_type="Q4_K_M", block_count=24, embedding_length=896,
                    head_count=14, head_count_kv=2, key_length=64, value_length=64, sliding_window=None,
                    chat_template=None, license=None, split_count=1)


def test_kv_bytes_per_token_by_dtype_and_runner():
    info = qwen_like()
    assert memory.kv_bytes_per_token(info, "f16", "llamacpp") == 24 * 2 * 128 * 2 == 12288
    assert memory.kv_bytes_per_token(info, "f32", "torch") == 24576
    # llama.cpp's Q8_0: 34 bytes per 32 values; the torch runner: int8 values and an f16
    # scale per token and KV head, for K and for V.
    assert memory.kv_bytes_per_token(info, "q8_0", "llamacpp") == 24 * 2 * 128 * 34 // 32 == 6528
    assert memory.kv_bytes_per_token(info, "q8_0", "torch") == 24 * 2 * 128 + 24 * 2 * 2 * 2 == 6336


def headroom(free: int) -> int:
    return memory.HEADROOM_BASE + int(memory.HEADROOM_SHARE * free)


def test_plenty_of_memory_gives_the_trained_context():
    plan = memory.plan(qwen_like(), "f16", "llamacpp", None, 16 * 2**30)
    assert (plan.tokens, plan.limited_by, plan.kv_bytes) == (32768, "the model's trained context", 32768 * 12288)
    assert plan.headroom == headroom(16 * 2**30)


def test_tight_memory_gives_what_fits_in_steps_of_256():
    free = 1200 * MiB
    room = free - 463 * MiB - headroom(free)
    plan = memory.plan(qwen_like(), "f16", "llamacpp", None, free, "--memory")
    assert plan.limited_by == "memory"
    assert plan.tokens == room // 12288 // 256 * 256 == 14080
    # q8_0 holds 12288 / 6528 = 1.88x the tokens in the same memory, before rounding.
    q8 = memory.plan(qwen_like(), "q8_0", "llamacpp", None, free, "--memory")
    assert q8.tokens == room // 6528 // 256 * 256 == 26368


def test_ctx_is_taken_as_given_when_it_fits():
    plan = memory.plan(qwen_like(), "f16", "llamacpp", 100_000, 16 * 2**30)
    assert (plan.tokens, plan.limited_by) == (100_000, "--ctx")
    # Unknown memory: nothing is checked, and without --ctx the trained context (at most 32k).
    assert memory.plan(qwen_like(), "f16", "llamacpp", 100_000, None).tokens == 100_000
    assert memory.plan(qwen_like(context_length=131072), "f16", "llamacpp", None, None).tokens == 32768


def test_ctx_that_does_not_fit_says_what_is_needed_and_what_to_change():
    with pytest.raises(ModelLoadError) as e:
        memory.plan(qwen_like(), "f16", "llamacpp", 100_000, 1200 * MiB, "--memory")
    assert str(e.value) == (
        "qwen.gguf does not fit: it needs 2.16 GiB (weights 463 MiB + KV cache for 100,000 tokens 1.14 GiB at f16 "
        "+ headroom 572 MiB), but --memory allows 1.17 GiB; lower --ctx to 14,080 or less, use --kv-dtype q8_0 "
        "(about half the KV bytes), use a smaller quant of the model, or raise --memory")


def test_weights_that_do_not_fit_ask_for_a_smaller_quant():
    with pytest.raises(ModelLoadError) as e:
        memory.plan(qwen_like(), "q8_0", "llamacpp", None, 600 * MiB, "RAM")
    assert str(e.value) == (
        "qwen.gguf does not fit: it needs 1018 MiB (weights 463 MiB + KV cache for 2,048 tokens 13 MiB at q8_0 "
        "+ headroom 542 MiB), but 600 MiB of RAM is free; use a smaller quant of the model (fewer bits per "
        "weight), or free memory")


def test_a_model_with_a_short_trained_context_needs_only_that():
    plan = memory.plan(qwen_like(context_length=1024), "f16", "llamacpp", None, 1100 * MiB)
    assert (plan.tokens, plan.limited_by) == (1024, "the model's trained context")


def test_describe_pool():
    assert memory.describe_pool(32768, 384 * MiB, "f16") == (
        "32,768 tokens (384 MiB, f16): 8 conversations of 4k, or 1 of 32k")
    assert memory.describe_pool(14080, 165 * MiB, "f16") == (
        "14,080 tokens (165 MiB, f16): 3 conversations of 4k, or 1 of 14,080")
    assert memory.describe_pool(4096, 48 * MiB, "q8_0") == "4,096 tokens (48 MiB, q8_0): 1 conversation of 4k"
