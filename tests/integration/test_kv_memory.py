"""The KV cache and memory on the real llama.cpp: the 8-bit cache measured from llama.cpp's own
allocation, requests whose max_tokens reserve nothing, a pool that runs out (preemption keeps
everyone to the end), and a model that cannot fit failing before anything is allocated."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


from localllm import memory
from localllm.config import CacheConfig, EngineConfig, SchedulerConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.request import SamplingParams
from localllm.gguf import read_info
from localllm.runners.llamacpp import LlamaCppRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiny_gguf import write_tiny_gguf  # noqa: E402

LOCALLLM = [sys.executable, "-c", "import sys; from localllm.cli import main; sys.exit(main())"]


def runner_for(path: Path, kv_dtype: str, n_ctx: int = 4096) -> LlamaCppRunner:
    return LlamaCppRunner(EngineConfig(model_path=path, cache=CacheConfig(n_ctx=n_ctx, kv_dtype=kv_dtype),
                                       n_threads=2))


def test_q8_0_cache_is_llama_cpps_own_and_holds_188x_the_tokens(qwen_path):
    pools, fingerprints = {}, {}
    for kv_dtype in ("f16", "q8_0"):
        runner = runner_for(qwen_path, kv_dtype)
        try:
            pools[kv_dtype] = (runner.n_ctx, runner.kv_bytes, runner.flash_attn, runner.kv_plan)
            fingerprints[kv_dtype] = runner.fingerprint
        finally:
            runner.close()
    (n16, bytes16, fa16, plan16), (n8, bytes8, fa8, plan8) = pools["f16"], pools["q8_0"]
    assert n16 == n8 == 4096
    # llama.cpp's report of its KV buffers: 24 layers x 2 KV heads x 128 values per token, at
    # 2 bytes (f16) or 34 bytes per 32 values (Q8_0), and flash attention on for both.
    assert (bytes16, bytes8) == (4096 * 12288, 4096 * 6528)
    assert (fa16, fa8) == (True, True)
    # The plan's arithmetic is what llama.cpp allocates.
    assert (plan16.kv_bytes, plan8.kv_bytes) == (bytes16, bytes8)
    assert round(bytes16 / bytes8, 3) == 1.882  # tokens per byte, q8_0 over f16
    # The on-disk prefix cache is keyed by the fingerprint: an f16 entry never loads into q8_0.
    assert b"|f16|" in fingerprints["f16"] and b"|q8_0|" in fingerprints["q8_0"]


def test_q8_0_cache_continues_text_as_f16_does(qwen_path):
    text = "".join(f"v{i} = {7 * i}\n" for i in range(40))
    outs = {}
    for kv_dtype in ("f16", "q8_0"):
        engine = LLMEngine(EngineConfig(model_path=qwen_path, cache=CacheConfig(n_ctx=1024, kv_dtype=kv_dtype),
                                        n_threads=2, speculative=False))
        try:
            outs[kv_dtype] = engine.generate([text], SamplingParams(temperature=0, max_tokens=24))[0].text
        finally:
            engine.close()
    assert outs["f16"].startswith("v40 = 280\nv41 = 287\n")
    assert outs["q8_0"] == outs["f16"]


def test_sixteen_requests_of_max_tokens_4096_start_at_once_in_a_small_pool(qwen_path):
    """A request's max_tokens reserves nothing: sixteen asking for 4096 tokens each all run in a
    pool of 2048 tokens (16 x 4096 would be 65,536)."""
    engine = LLMEngine(EngineConfig(model_path=qwen_path, cache=CacheConfig(n_ctx=2048), n_threads=2,
                                    scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)))
    try:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": f"Say hello to person {i}."}])
                   for i in range(16)]
        seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=4096)) for p in prompts]
        while engine.stats().num_waiting:  # the prompts take two steps of 512 tokens
            engine.step()
        assert engine.stats().num_running == 16
        assert engine.block_manager.num_free_blocks > 0
        while engine.has_unfinished:
            engine.step()
        assert all(s.finish_reason.value == "stop" for s in seqs)
        assert engine.stats().num_preemptions == 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()


def test_a_pool_that_runs_out_preempts_and_every_request_finishes(tmp_path):
    """Sixteen requests of max_tokens 4096 in a pool of 1024 tokens (a tiny model, so each can
    grow to the whole pool): the pool runs out again and again, preemption (counted) hands blocks
    back, and every request still ends where its length allows."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    engine = LLMEngine(EngineConfig(model_path=path, cache=CacheConfig(n_ctx=1024), n_threads=1,
                                    scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256)))
    try:
        prompts = [engine.tokenizer.encode(f"request {i}: the cat is in the hat") for i in range(16)]
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True))
        assert engine.stats().num_preemptions > 0
        assert [o.finish_reason for o in outs] == ["length"] * 16
        assert [len(p) + len(o.token_ids) for p, o in zip(prompts, outs)] == [1024] * 16
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()


def test_a_model_that_cannot_fit_fails_before_loading(qwen_path, tmp_path):
    """--memory below the weights: a clear error, exit 2, and llama.cpp never loaded the model
    (its log, turned on, says nothing of loading)."""
    info = read_info(qwen_path)
    env = {**os.environ, "LOCALLLM_HOME": str(tmp_path), "LOCALLLM_LLAMA_LOG": "1"}
    r = subprocess.run(LOCALLLM + ["run", str(qwen_path), "hi", "--memory", "600MiB", "--runner", "llamacpp"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    headroom = memory.HEADROOM_BASE + int(memory.HEADROOM_SHARE * 600 * 2**20)
    need = info.tensor_bytes + 2048 * 12288 + headroom
    assert r.stderr == (
        f"localllm: error: {qwen_path.name} does not fit: it needs {need / 2**30:.2f} GiB (weights 463 MiB + KV "
        f"cache for 2,048 tokens 24 MiB at f16 + headroom {headroom / 2**20:.0f} MiB), but --memory allows 600 MiB; "
        "use a smaller quant of the model (fewer bits per weight), or raise --memory\n")
    # With room for the weights but not the context asked for: what --ctx would fit.
    r = subprocess.run(LOCALLLM + ["run", str(qwen_path), "hi", "--memory", "1200MiB", "--ctx", "100000",
                                   "--kv-dtype", "q8_0", "--runner", "llamacpp"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2
    assert "but --memory allows 1.17 GiB; lower --ctx to 26,368 or less, use a smaller quant" in r.stderr


def test_without_ctx_the_pool_is_sized_to_the_machine(qwen_path):
    """Memory is plenty here, so the pool is the model's trained context; the summary is what
    serve prints at start and the chat app shows once the model is loaded."""
    engine = LLMEngine(EngineConfig(model_path=qwen_path, cache=CacheConfig(kv_dtype="q8_0"), n_threads=2))
    try:
        assert engine.max_model_len == 32768
        size = "204 MiB" if engine.runner.name == "llamacpp" else "198 MiB"  # 6,528 or 6,336 bytes a token
        assert engine.kv_pool_summary == (f"32,768 tokens ({size}, q8_0): 8 conversations of 4k, "
                                          "or 1 of 32k")
    finally:
        engine.close()
