"""The tiny random models of tests/tiny_gguf.py: exact files, and llama.cpp loads and runs them
through the engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFReader

from localllm.config import CacheConfig, EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.request import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiny_gguf import tensor_shapes, tiny_config, write_tiny_gguf  # noqa: E402

ARCHS = ["qwen2", "llama", "gemma3"]
# arch -> (BOS id, EOS id, BOS added to a plain prompt, first control token of the chat template)
SPECIAL_IDS = {
    "qwen2": (302, 304, False, 303),  # <|endoftext|>, <|im_end|>, <|im_start|>
    "llama": (302, 305, True, 304),  # <|begin_of_text|>, <|im_end|>, <|im_start|>
    "gemma3": (2, 1, True, 4),  # <bos>, <eos>, <start_of_turn>
}
TEXT = "Hello world, the cat is in the hat!\ndef f(x):\n    return 42 # ~`{}|"


def field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


def make_engine(path: Path) -> LLMEngine:
    # One thread: these models are too small to gain from two, and two threads that spin-wait
    # for each other take 30x longer (over 30 s here) when another process holds a core.
    return LLMEngine(EngineConfig(model_path=path, cache=CacheConfig(n_ctx=512), n_threads=1, runner="llamacpp"))


@pytest.fixture(scope="module", params=ARCHS)
def arch_engine(request, tmp_path_factory):
    """(arch, an engine on its tiny f32 model of seed 0)."""
    engine = make_engine(write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "m.gguf", request.param))
    yield request.param, engine
    engine.close()


def test_greedy_generates_64_varied_tokens(arch_engine):
    arch, engine = arch_engine
    prompt = engine.tokenizer.encode(TEXT)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    assert len(out.token_ids) == 64 and out.finish_reason == "length"
    assert all(0 <= t < tiny_config(arch).vocab_size for t in out.token_ids)
    # Random weights scaled so that greedy decoding does not lock onto one token.
    assert len(set(out.token_ids)) >= 8  # a locked model gives 1-3 here


def test_tokenizer_round_trips_ascii(arch_engine):
    tok = arch_engine[1].tokenizer
    assert tok.decode(tok.encode(TEXT, add_special=False)) == TEXT
    ascii_text = "".join(map(chr, range(32, 127)))
    assert tok.decode(tok.encode(ascii_text, add_special=False)) == ascii_text
    # The merges (BPE) or pieces (SentencePiece) apply: two tokens, not eleven bytes.
    ids = tok.encode("Hello world", add_special=False)
    assert [tok.decode([i]) for i in ids] == ["Hello", " world"]


def test_special_tokens(arch_engine):
    arch, engine = arch_engine
    tok = engine.tokenizer
    bos, eos, add_bos, turn_start = SPECIAL_IDS[arch]
    assert (tok.bos_id, tok.eos_id, tok.n_vocab) == (bos, eos, tiny_config(arch).vocab_size)
    plain = tok.encode("Hello world", add_special=False)
    assert tok.encode("Hello world") == ([bos] + plain if add_bos else plain)
    assert tok.is_eog(eos) and not tok.is_eog(plain[0])
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat[int(add_bos)] == turn_start


def test_sliding_window(arch_engine):
    arch, engine = arch_engine
    cfg = tiny_config(arch)
    if arch == "gemma3":
        assert engine.runner.n_swa == cfg.sliding_window == 32
        assert cfg.swa_layers == (True, True, True, True, True, False)
    else:
        assert engine.runner.n_swa == 0
        assert not any(cfg.swa_layers)


@pytest.mark.parametrize("arch", ARCHS)
def test_f16_file_runs(arch, tmp_path):
    path = write_tiny_gguf(tmp_path / f"{arch}-f16.gguf", arch, dtype="f16")
    engine = make_engine(path)
    try:
        out = engine.generate([engine.tokenizer.encode(TEXT)],
                              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    finally:
        engine.close()
    assert len(out.token_ids) == 8


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_same_bytes(arch, tmp_path):
    first = write_tiny_gguf(tmp_path / "a.gguf", arch, seed=3).read_bytes()
    assert write_tiny_gguf(tmp_path / "b.gguf", arch, seed=3).read_bytes() == first
    other_seed = write_tiny_gguf(tmp_path / "c.gguf", arch, seed=4).read_bytes()
    assert len(other_seed) == len(first) and other_seed != first
    assert write_tiny_gguf(tmp_path / "d.gguf", arch, seed=3, dtype="f16").stat().st_size < len(first)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_reads_back_with_config_shapes(arch, dtype, tmp_path):
    cfg = tiny_config(arch)
    reader = GGUFReader(write_tiny_gguf(tmp_path / "m.gguf", arch, dtype=dtype))
    shapes = tensor_shapes(cfg)
    # GGUF lists dimensions innermost first: numpy (rows, cols) is (cols, rows) in the file.
    assert [t.name for t in reader.tensors] == list(shapes)
    for t in reader.tensors:
        assert tuple(int(n) for n in reversed(t.shape)) == shapes[t.name], t.name
        is_f16 = dtype == "f16" and len(shapes[t.name]) == 2
        assert t.tensor_type == (GGMLQuantizationType.F16 if is_f16 else GGMLQuantizationType.F32)
    assert field(reader, "general.architecture") == arch
    assert field(reader, "general.file_type") == (0 if dtype == "f32" else 1)
    assert field(reader, f"{arch}.embedding_length") == cfg.n_embd == 64
    assert field(reader, f"{arch}.block_count") == cfg.n_layer
    assert field(reader, f"{arch}.attention.head_count") == cfg.n_head == 4
    assert field(reader, f"{arch}.attention.head_count_kv") == cfg.n_head_kv == 2
    assert field(reader, f"{arch}.feed_forward_length") == cfg.n_ff == 128
    assert field(reader, f"{arch}.rope.freq_base") == cfg.rope_base
    assert len(field(reader, "tokenizer.ggml.tokens")) == cfg.vocab_size


def test_architecture_tensors():
    qwen2, llama, gemma3 = (tensor_shapes(tiny_config(a)) for a in ARCHS)
    assert qwen2["output.weight"] == qwen2["token_embd.weight"] == (305, 64)
    assert (qwen2["blk.1.attn_q.bias"], qwen2["blk.1.attn_k.bias"]) == ((64,), (32,))
    assert "output.weight" not in llama and "blk.0.attn_q.bias" not in llama
    assert len(llama) == 2 + 2 * 9 and len(qwen2) == 3 + 2 * 12
    assert "output.weight" not in gemma3 and len(gemma3) == 2 + 6 * 13
    assert gemma3["blk.5.attn_q.weight"] == (128, 64)  # 4 heads of 32, wider than n_embd
    assert gemma3["blk.5.attn_output.weight"] == (64, 128)
    assert gemma3["blk.5.attn_k_norm.weight"] == (32,)
    assert gemma3["blk.5.post_ffw_norm.weight"] == (64,)


def test_unknown_arch_and_dtype(tmp_path):
    with pytest.raises(ValueError, match="no tiny model for architecture 'phi3'"):
        write_tiny_gguf(tmp_path / "m.gguf", "phi3")
    with pytest.raises(ValueError, match="dtype 'q8_0' is not supported"):
        write_tiny_gguf(tmp_path / "m.gguf", "llama", dtype="q8_0")
