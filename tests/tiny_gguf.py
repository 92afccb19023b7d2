"""Tiny GGUF models with random weights that llama.cpp loads and runs, for tests.

``write_tiny_gguf(path, arch)`` writes a model of 0.4-1.3 MB for ``qwen2``, ``llama`` or
``gemma3``: the tensors and metadata keys of the real models of that architecture, with F32
(or F16) tensors, never quantized, so that a re-implementation can be checked against
llama.cpp's logits. The same (arch, seed, dtype) always gives the same bytes.

What each architecture has (as llama.cpp computes it):

- qwen2: q/k/v biases, untied output (``output.weight``), NEOX rope, SwiGLU.
- llama: no biases, output tied to ``token_embd.weight``, NORM rope (adjacent pairs), SwiGLU.
- gemma3: embeddings scaled by sqrt(n_embd), QK-norm, post-attention and post-FFN norms,
  GELU(tanh)-gated FFN, NEOX rope, output tied; layers 0-4 attend over a window of 32
  tokens with rope base 10000 (llama.cpp's default: the file has no ``rope.freq_base_swa``,
  as real Gemma 3 files have none), layer 5 attends globally with rope base 1e6.

Vocabularies: qwen2 and llama have a GPT-2 byte-level BPE (the 256 byte tokens, id = byte
value, then tokens made by a few merges, then control tokens); gemma3 has a SentencePiece
vocabulary with byte fallback (``<0x00>``..``<0xFF>``). Both round-trip any ASCII text.

Where llama.cpp's CPU numbers leave float32: the runner keeps K and V in F16, and GELU reads
an F16 table (gelu(x) ~ f16(gelu(f16(x)))); F16 weights also round the activations they meet.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\\n' + message['content'] + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# Words that get tokens of their own, built left to right one character at a time; the space
# is written "Ġ" in the BPE vocabularies and "▁" in the SentencePiece one.
_WORDS = (" the", " and", " of", " to", " in", " is", " it", " that", " for", " with", " hello",
          " world", "Hello", "def", " return", "  ", "    ")
_QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_LLAMA_SPECIALS = ("<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
_GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")


@dataclass(frozen=True)
class TinyConfig:
    """The hyper-parameters of one tiny model, as written to its GGUF."""

    arch: str
    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int  # n_head * head_dim need not be n_embd (gemma3: 4 * 32 = 128 != 64)
    n_ff: int
    context_length: int
    rope_base: float  # gemma3: the global layers' base
    rms_eps: float
    qkv_bias: bool
    tied_output: bool  # no output.weight: logits use token_embd.weight
    sliding_window: int | None = None  # gemma3: tokens a local layer sees, itself included
    # Not written to the file, which (like real Gemma 3 files) leaves llama.cpp its defaults:
    sliding_window_pattern: int | None = None  # every n-th layer is global, the others local
    rope_base_swa: float | None = None  # the local layers' rope base

    @property
    def swa_layers(self) -> tuple[bool, ...]:
        """Which layers are sliding-window, by llama.cpp's rule (llama_hparams::set_swa_pattern):
        layer il is local when il % pattern < pattern - 1; with 6 layers and pattern 6 that is
        layers 0-4, and layer 5 is global."""
        n = self.sliding_window_pattern
        return tuple(n is not None and il % n < n - 1 for il in range(self.n_layer))


CONFIGS = {
    "qwen2": TinyConfig(
        arch="qwen2", vocab_size=305, n_embd=64, n_layer=2, n_head=4, n_head_kv=2,
        head_dim=16, n_ff=128, context_length=1024, rope_base=1_000_000.0, rms_eps=1e-6,
        qkv_bias=True, tied_output=False),
    "llama": TinyConfig(
        arch="llama", vocab_size=306, n_embd=64, n_layer=2, n_head=4, n_head_kv=2,
        head_dim=16, n_ff=128, context_length=1024, rope_base=10_000.0, rms_eps=1e-5,
        qkv_bias=False, tied_output=True),
    "gemma3": TinyConfig(
        arch="gemma3", vocab_size=336, n_embd=64, n_layer=6, n_head=4,
        n_head_kv=2, head_dim=32, n_ff=128, context_length=1024, rope_base=1_000_000.0,
        rms_eps=1e-6, qkv_bias=False, tied_output=True, sliding_window=32,
        sliding_window_pattern=6, rope_base_swa=10_000.0),
}


def tiny_config(arch: str) -> TinyConfig:
    if arch not in CONFIGS:
        raise ValueError(f"no tiny model for architecture {arch!r}; use one of {sorted(CONFIGS)}")
    return CONFIGS[arch]


def tensor_shapes(cfg: TinyConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and numpy shape, in file order. GGUF lists the dimensions reversed:
    ``blk.0.attn_q.weight`` of numpy shape (n_head * head_dim, n_embd) is (n_embd, n_head *
    head_dim) in the file; y = x @ W.T."""
    q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    shapes = {"token_embd.weight": (cfg.vocab_size, cfg.n_embd), "output_norm.weight": (cfg.n_embd,)}
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.vocab_size, cfg.n_embd)
    for il in range(cfg.n_layer):
        b = f"blk.{il}."
        shapes[b + "attn_norm.weight"] = (cfg.n_embd,)
        shapes[b + "attn_q.weight"] = (q_dim, cfg.n_embd)
        shapes[b + "attn_k.weight"] = (kv_dim, cfg.n_embd)
        shapes[b + "attn_v.weight"] = (kv_dim, cfg.n_embd)
        if cfg.qkv_bias:
            shapes[b + "attn_q.bias"] = (q_dim,)
            shapes[b + "attn_k.bias"] = (kv_dim,)
            shapes[b + "attn_v.bias"] = (kv_dim,)
        if cfg.arch == "gemma3":
            shapes[b + "attn_q_norm.weight"] = (cfg.head_dim,)
            shapes[b + "attn_k_norm.weight"] = (cfg.head_dim,)
        shapes[b + "attn_output.weight"] = (cfg.n_embd, q_dim)
        if cfg.arch == "gemma3":
            shapes[b + "post_attention_norm.weight"] = (cfg.n_embd,)
        shapes[b + "ffn_norm.weight"] = (cfg.n_embd,)
        shapes[b + "ffn_gate.weight"] = (cfg.n_ff, cfg.n_embd)
        shapes[b + "ffn_up.weight"] = (cfg.n_ff, cfg.n_embd)
        shapes[b + "ffn_down.weight"] = (cfg.n_embd, cfg.n_ff)
        if cfg.arch == "gemma3":
            shapes[b + "post_ffw_norm.weight"] = (cfg.n_embd,)
    return shapes


def write_tiny_gguf(path: Path, arch: str, seed: int = 0, dtype: str = "f32",
                    pooling: str | None = None) -> Path:
    """Write a tiny random model of architecture ``arch`` to ``path``; return ``path``.

    ``dtype`` "f16" stores the 2-D weights as F16 (norms and biases stay F32, as in
    converted models); llama.cpp then also rounds the activations that meet them to F16.
    ``pooling`` ("mean", "cls", "last") writes ``{arch}.pooling_type``, which makes the model
    an embedding model, as Qwen3-Embedding's file ("last") is.
    """
    cfg = tiny_config(arch)
    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype {dtype!r} is not supported; use 'f32' or 'f16'")
    writer = gguf.GGUFWriter(path, arch)
    _add_hparams(writer, cfg, dtype)
    if pooling is not None:
        writer.add_pooling_type(gguf.PoolingType[pooling.upper()])
    if arch == "gemma3":
        _add_spm_vocab(writer, cfg)
    else:
        _add_bpe_vocab(writer, cfg)
    for name, shape in tensor_shapes(cfg).items():
        writer.add_tensor(name, _random_tensor(name, shape, seed, dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_hparams(w: gguf.GGUFWriter, cfg: TinyConfig, dtype: str) -> None:
    w.add_name(f"tiny-{cfg.arch}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    if cfg.arch == "llama":
        w.add_rope_dimension_count(cfg.head_dim)
    if cfg.arch == "gemma3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character map: printable bytes stand for themselves, the others for
    chr(256), chr(257)... in byte order (the space is "Ġ", the newline "Ċ")."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) if b in printable else chr(256 + others.index(b)) for b in range(256)}


def _prefix_pieces(words: list[str], known: set[str]) -> list[tuple[str, str]]:
    """(left, right) pairs that build each word left to right, one character at a time;
    pieces already known are not made again."""
    pairs = []
    for word in words:
        for end in range(2, len(word) + 1):
            if word[:end] not in known:
                known.add(word[:end])
                pairs.append((word[: end - 1], word[end - 1]))
    return pairs


def _add_bpe_vocab(w: gguf.GGUFWriter, cfg: TinyConfig) -> None:
    specials = _QWEN2_SPECIALS if cfg.arch == "qwen2" else _LLAMA_SPECIALS
    byte_chars = _bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)]
    pairs = _prefix_pieces([w.replace(" ", "Ġ") for w in _WORDS], set(tokens))
    tokens += [left + right for left, right in pairs] + list(specials)
    types = ([gguf.TokenType.NORMAL] * (len(tokens) - len(specials))
             + [gguf.TokenType.CONTROL] * len(specials))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if cfg.arch == "qwen2" else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{left} {right}" for left, right in pairs])
    if cfg.arch == "qwen2":  # as Qwen2.5 Instruct: BOS <|endoftext|>, not added; EOS <|im_end|>
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
    else:
        w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
        w.add_add_bos_token(True)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHATML_TEMPLATE)


def _add_spm_vocab(w: gguf.GGUFWriter, cfg: TinyConfig) -> None:
    chars = ["▁", *"abcdefghijklmnopqrstuvwxyzH"]
    words = [w.replace(" ", "▁") for w in _WORDS]
    pieces = chars + [left + right for left, right in _prefix_pieces(words, set(chars))]
    tokens = [*_GEMMA_SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = ([gguf.TokenType.CONTROL] * len(_GEMMA_SPECIALS) + [gguf.TokenType.BYTE] * 256
             + [gguf.TokenType.NORMAL] * len(pieces))
    # As in Gemma's own file: control tokens -1000, bytes 0, pieces by rank (earlier wins).
    scores = [-1000.0] * len(_GEMMA_SPECIALS) + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(tokens.index("<bos>"))
    w.add_eos_token_id(tokens.index("<eos>"))
    w.add_unk_token_id(tokens.index("<unk>"))
    w.add_pad_token_id(tokens.index("<pad>"))
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(GEMMA_TEMPLATE)


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: str) -> np.ndarray:
    """One tensor's values, drawn from its own generator so that each depends only on
    (seed, name).

    Matrices are N(0, 1/fan_in), so every projection keeps unit scale and attention is
    neither flat nor one-hot; embeddings are N(0, 0.3^2), giving logits of std ~2 through the
    (tied or untied) output; other norms are 1 + N(0, 0.1^2); biases N(0, 0.2^2).
    """
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name == "output_norm.weight":
        # Mean 0, not 1: with tied embeddings a positive output norm gives the current token
        # t the logit ~ |e_t|^2 > the others, and greedy decoding repeats it forever.
        values = rng.standard_normal(shape)
    elif name.endswith("norm.weight"):
        values = 1.0 + 0.1 * rng.standard_normal(shape)
    elif name.endswith(".bias"):
        values = 0.2 * rng.standard_normal(shape)
    elif name in ("token_embd.weight", "output.weight"):
        values = 0.3 * rng.standard_normal(shape)
    else:
        values = rng.standard_normal(shape) / np.sqrt(shape[1])
    if dtype == "f16" and len(shape) == 2:
        return values.astype(np.float16)
    return values.astype(np.float32)
