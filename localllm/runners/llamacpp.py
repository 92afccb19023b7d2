"""The llama.cpp runner, through llama-cpp-python's low-level API. The only module that
imports llama_cpp.

One context, one unified KV cache, many sequence ids ("slots"). The BlockManager's blocks
map onto llama.cpp's cells by position: block i of a sequence is its cells at positions
[i * block_size, (i + 1) * block_size). A block's cells are shared, never copied, by giving
them more slots (``llama_memory_seq_cp``, zero copy in a unified cache).

Slots are of two kinds. An *active* slot belongs to a running sequence. When a sequence
ends, its slot becomes a *holder* of its hashed blocks (all other cells are removed), so
those blocks stay valid for later hits; a holder is one linear chain, like the sequence it
was. Holders are recycled least recently used first when slots run short; the blocks that
lose their last slot are reported back so the BlockManager stops offering them.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections import OrderedDict
from pathlib import Path

import llama_cpp as L
import numpy as np

from localllm import memory
from localllm.config import DEFAULT_BATCH_TOKENS, EngineConfig
from localllm.engine.request import Sequence
from localllm.engine.scheduler import SchedulerOutput
from localllm.errors import EngineError, ModelLoadError
from localllm.gguf_check import check_model


_KV_SIZE_LINE = re.compile(rb"llama_kv_cache: +size = +([0-9.]+) MiB")
_FLASH_ON_LINE = re.compile(rb"flash_attn += enabled|Flash Attention enabled")
_log_lines: list[bytes] | None = None  # while a context is created: llama.cpp's lines, to read back


@L.llama_log_callback
def _quiet_log(level, text, user_data):  # llama.cpp's own logging stays off the terminal
    if text and _log_lines is not None:
        _log_lines.append(text)
    if os.environ.get("LOCALLLM_LLAMA_LOG") and text:
        os.write(2, text)


_backend_ready = False


def _init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        L.llama_log_set(_quiet_log, ctypes.c_void_p(0))
        L.llama_backend_init()
        _backend_ready = True


def check_gguf(path: Path) -> None:
    """Fail with a clear error before llama.cpp sees a file that cannot be a model: llama.cpp
    aborts the whole process on some malformed files, so the header, metadata, tensor table
    and vocabulary are checked in Python first (localllm.gguf_check; about twice read_info)."""
    check_model(path)


def amx_compiled_in() -> bool:
    """Whether this llama.cpp build has ggml's AMX kernels (a native build on an Intel Xeon of
    the Sapphire Rapids kind or later). Those crash the process at the first matmul in the
    llama.cpp that llama-cpp-python 0.3.36 carries (a general protection fault at ldtilecfg:
    the tile configuration is built on the stack and optimized away; llama.cpp issue 20824,
    fix proposed in PR 26954), on every thread count."""
    return b"AMX_INT8 = 1" in L.llama_print_system_info()


# ggml_backend_dev_type, in ggml-backend.h's order.
_DEVICE_TYPES = ("CPU", "GPU", "IGPU", "ACCEL", "META")


def backend_report() -> dict:
    """What this llama.cpp build can run on: its version, whether it offloads to a GPU, the
    ggml backends compiled in and their devices with their memory (bytes).

    llama-cpp-python 0.3.36 has no Python binding for ggml's backend registry, so it is read
    through libggml's C functions; where they are missing, "devices" is None and "note" says why.
    """
    _init_backend()
    report = {
        "version": getattr(L, "__version__", "unknown"),
        "gpu_offload": bool(L.llama_supports_gpu_offload()),
        "max_devices": int(L.llama_max_devices()),
        "system_info": L.llama_print_system_info().decode("utf-8", "replace").strip(" |"),
        "backends": None,
        "devices": None,
        "note": None,
    }
    try:
        from llama_cpp._ggml import libggml as g

        g.ggml_backend_reg_count.restype = ctypes.c_size_t
        g.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
        g.ggml_backend_reg_get.restype = ctypes.c_void_p
        g.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
        g.ggml_backend_reg_name.restype = ctypes.c_char_p
        g.ggml_backend_dev_count.restype = ctypes.c_size_t
        g.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        g.ggml_backend_dev_get.restype = ctypes.c_void_p
        for fn in (g.ggml_backend_dev_name, g.ggml_backend_dev_description):
            fn.argtypes = [ctypes.c_void_p]
            fn.restype = ctypes.c_char_p
        g.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        g.ggml_backend_dev_type.restype = ctypes.c_int
        size_p = ctypes.POINTER(ctypes.c_size_t)
        g.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size_p, size_p]
        g.ggml_backend_dev_memory.restype = None
    except (ImportError, AttributeError, OSError) as e:
        report["note"] = f"this llama-cpp-python does not expose ggml's backend registry ({e})"
        return report

    def text(raw: bytes | None) -> str:
        return raw.decode("utf-8", "replace") if raw else ""

    report["backends"] = [text(g.ggml_backend_reg_name(g.ggml_backend_reg_get(i)))
                          for i in range(g.ggml_backend_reg_count())]
    devices = []
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = g.ggml_backend_dev_type(dev)
        devices.append({
            "name": text(g.ggml_backend_dev_name(dev)),
            "description": text(g.ggml_backend_dev_description(dev)),
            "type": _DEVICE_TYPES[kind] if 0 <= kind < len(_DEVICE_TYPES) else f"type {kind}",
            "memory_free": free.value,
            "memory_total": total.value,
        })
    report["devices"] = devices
    return report


def _load_model(path: Path, n_gpu_layers: int):
    """(model, GPU layers it got, whether weights may be repacked) for a checked GGUF file;
    n_gpu_layers -1: every layer the GPU takes, falling back to the CPU when they do not fit."""
    mparams = L.llama_model_default_params()
    if amx_compiled_in():
        # Weights stay in plain CPU buffers, never repacked for the AMX kernels, so those
        # never run (this also forgoes the AVX repacking of the same extra buffers).
        mparams.use_extra_bufts = False
    gpu = L.llama_supports_gpu_offload()
    mparams.n_gpu_layers = (999 if n_gpu_layers < 0 else n_gpu_layers) if gpu else 0
    model = L.llama_model_load_from_file(str(path).encode(), mparams)
    if not model and gpu and n_gpu_layers < 0:
        # Every layer did not fit in GPU memory: fall back to the CPU rather than fail.
        mparams.n_gpu_layers = 0
        model = L.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise ModelLoadError(
            f"llama.cpp could not load {path}: the file is truncated, damaged or of an "
            f"architecture this llama.cpp does not know; download it again"
        )
    return model, mparams.n_gpu_layers, bool(mparams.use_extra_bufts)


def _free(holder) -> None:
    """Free a holder's llama.cpp context, then its model (each once; closing twice is safe)."""
    if getattr(holder, "ctx", None):
        L.llama_free(holder.ctx)
        holder.ctx = None
    if getattr(holder, "model", None):
        L.llama_model_free(holder.model)
        holder.model = None


class _NumpyBatch:
    """A llama_batch of up to n tokens whose arrays are numpy buffers, so a step fills them
    without a Python loop over tokens; every token in one sequence (seq_ids)."""

    def __init__(self, n: int) -> None:
        self.tokens = np.zeros(n, dtype=np.int32)
        self.pos = np.zeros(n, dtype=np.int32)
        self.n_seq_id = np.ones(n, dtype=np.int32)
        self.seq_ids = np.zeros(n, dtype=np.int32)
        self.logits_flags = np.zeros(n, dtype=np.int8)
        seq_id_ptrs = (ctypes.POINTER(L.llama_seq_id) * n)()
        base = self.seq_ids.ctypes.data
        for i in range(n):
            seq_id_ptrs[i] = ctypes.cast(base + 4 * i, ctypes.POINTER(L.llama_seq_id))
        self._seq_id_ptrs = seq_id_ptrs  # the batch points into it: kept alive with it
        batch = L.llama_batch()
        batch.token = self.tokens.ctypes.data_as(ctypes.POINTER(L.llama_token))
        batch.embd = None
        batch.pos = self.pos.ctypes.data_as(ctypes.POINTER(L.llama_pos))
        batch.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        batch.seq_id = ctypes.cast(seq_id_ptrs, ctypes.POINTER(ctypes.POINTER(L.llama_seq_id)))
        batch.logits = self.logits_flags.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.batch = batch


class LlamaVocab:
    """The tokenizer.Vocab protocol over a llama.cpp model's vocabulary."""

    def __init__(self, model):
        self._vocab = L.llama_model_get_vocab(model)
        self.n_vocab = L.llama_vocab_n_tokens(self._vocab)
        bos, eos = L.llama_vocab_bos(self._vocab), L.llama_vocab_eos(self._vocab)
        self.bos_id = bos if bos >= 0 else None
        self.eos_id = eos if eos >= 0 else None
        self.add_bos = bool(L.llama_vocab_get_add_bos(self._vocab))
        self.bos_text = self._piece(bos, special=True).decode("utf-8", "replace") if bos >= 0 else ""
        self.eos_text = self._piece(eos, special=True).decode("utf-8", "replace") if eos >= 0 else ""
        fim = (L.llama_vocab_fim_pre(self._vocab), L.llama_vocab_fim_suf(self._vocab),
               L.llama_vocab_fim_mid(self._vocab))
        self.fim_pre_id, self.fim_suf_id, self.fim_mid_id = (t if t >= 0 else None for t in fim)
        # Repository-level FIM (Qwen2.5-Coder's <|repo_name|> and <|file_sep|>): other files as context.
        rep, sep = L.llama_vocab_fim_rep(self._vocab), L.llama_vocab_fim_sep(self._vocab)
        self.fim_rep_id, self.fim_sep_id = (t if t >= 0 else None for t in (rep, sep))
        template = L.llama_model_chat_template(model, None)
        self.chat_template = template.decode("utf-8", "replace") if template else None
        self._pieces: dict[int, bytes] = {}
        self._buf = ctypes.create_string_buffer(256)
        self._user_defined: tuple[str, ...] | None = None

    def tokenize(self, text: bytes, add_special: bool, parse_special: bool) -> list[int]:
        n_max = len(text) + 8
        tokens = (L.llama_token * n_max)()
        n = L.llama_tokenize(self._vocab, text, len(text), tokens, n_max, add_special, parse_special)
        if n < 0:  # more tokens than bytes cannot happen, but the API allows asking again
            n_max = -n
            tokens = (L.llama_token * n_max)()
            n = L.llama_tokenize(self._vocab, text, len(text), tokens, n_max, add_special, parse_special)
        return list(tokens[:n])

    def _piece(self, token_id: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = L.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, special)
        return buf.raw[:n]

    def user_defined_texts(self) -> tuple[str, ...]:
        """The texts of the user-defined tokens (Qwen's <tool_call>), which llama.cpp matches in
        any text, parse_special or not; read once, on first use (a scan of the vocabulary)."""
        if self._user_defined is None:
            attr = L.llama_vocab_get_attr
            self._user_defined = tuple(
                self._piece(i, special=True).decode("utf-8", "replace") for i in range(self.n_vocab)
                if attr(self._vocab, i) & L.LLAMA_TOKEN_ATTR_USER_DEFINED)
        return self._user_defined

    def control_ids(self) -> list[int]:
        """The control tokens (<|im_end|>, <|endoftext|>...): text never spells them out."""
        attr = L.llama_vocab_get_attr
        return [i for i in range(self.n_vocab) if attr(self._vocab, i) & L.LLAMA_TOKEN_ATTR_CONTROL]

    def token_to_piece(self, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is None:
            if not 0 <= token_id < self.n_vocab:
                raise ValueError(f"token id {token_id} is outside the vocabulary (0..{self.n_vocab - 1})")
            piece = self._pieces[token_id] = self._piece(token_id, special=False)
        return piece

    def special_piece(self, token_id: int) -> bytes:
        """The token's text, a control token's own text included (b"<|im_end|>")."""
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{self.n_vocab - 1})")
        return self._piece(token_id, special=True)

    def is_eog(self, token_id: int) -> bool:
        return bool(L.llama_vocab_is_eog(self._vocab, token_id))


class VocabFile:
    """A GGUF file's vocabulary without its weights (llama.cpp's vocab_only load): what the
    torch runner tokenizes with."""

    def __init__(self, path: Path):
        _init_backend()
        check_gguf(path)
        mparams = L.llama_model_default_params()
        mparams.vocab_only = True
        self.model = L.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise ModelLoadError(f"llama.cpp could not read the vocabulary of {path}; download it again")
        self.vocab = LlamaVocab(self.model)

    def close(self) -> None:
        if getattr(self, "model", None):
            L.llama_model_free(self.model)
            self.model = None


class LlamaCppRunner:
    name = "llamacpp"
    chosen_because: str | None = None  # set by engine.load_runner when --runner auto chose it

    def __init__(self, config: EngineConfig):
        _init_backend()
        path = Path(config.model_path)
        check_gguf(path)
        config, self.kv_plan = memory.sized(config, self.name)
        self.kv_dtype = config.cache.kv_dtype
        self.block_size = config.cache.block_size
        self.default_batch_tokens = DEFAULT_BATCH_TOKENS
        self.max_batch = config.scheduler.max_num_batched_tokens or DEFAULT_BATCH_TOKENS
        self.model, self.n_gpu_layers, self.extra_bufts = _load_model(path, config.n_gpu_layers)
        self.n_swa = L.llama_model_n_swa(self.model)
        # Whether the CPU computes the layers (some or all): then the engine chooses the threads.
        self.uses_cpu_threads = self.n_gpu_layers < L.llama_model_n_layer(self.model)
        # Slots: the running sequences, plus as many holders of cached prefixes again, twice.
        self.max_active = config.scheduler.max_num_seqs
        self.n_slots = min(256, 3 * self.max_active)
        cparams = L.llama_context_default_params()
        cparams.n_ctx = config.cache.n_ctx
        cparams.n_batch = cparams.n_ubatch = self.max_batch
        cparams.n_seq_max = self.n_slots
        cparams.n_threads = cparams.n_threads_batch = self.threads = config.threads
        cparams.kv_unified = True
        cparams.no_perf = True
        if config.cache.kv_dtype == "f32":
            cparams.type_k = cparams.type_v = L.GGML_TYPE_F32
            cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        elif config.cache.kv_dtype == "q8_0":
            # An 8-bit V cache is only read by flash attention: ask for it outright, so that a
            # build or device without it fails here rather than silently running f16.
            cparams.type_k = cparams.type_v = L.GGML_TYPE_Q8_0
            cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        global _log_lines
        _log_lines = lines = []
        try:
            self.ctx = L.llama_init_from_model(self.model, cparams)
        finally:
            _log_lines = None
        log = b"".join(lines)  # llama.cpp may send a line in pieces
        if not self.ctx:
            L.llama_model_free(self.model)
            if config.cache.kv_dtype == "q8_0":
                raise ModelLoadError(
                    f"llama.cpp could not create an 8-bit KV cache for {path}: it needs flash attention, "
                    f"which this llama.cpp build or device does not offer; use --kv-dtype f16")
            raise ModelLoadError(
                f"llama.cpp could not create a context of {config.cache.n_ctx} tokens for "
                f"{path}; lower --ctx"
            )
        # What llama.cpp really allocated, from its own report (the KV buffers, all layers; a
        # sliding-window model has two caches) and whether flash attention is on.
        self.kv_bytes = round(sum(float(m.group(1)) for m in _KV_SIZE_LINE.finditer(log)) * 2**20)
        self.flash_attn = _FLASH_ON_LINE.search(log) is not None
        if config.cache.kv_dtype == "q8_0" and not self.flash_attn:
            L.llama_free(self.ctx)
            L.llama_model_free(self.model)
            raise ModelLoadError(f"llama.cpp did not turn flash attention on for {path}, which an 8-bit "
                                 "KV cache needs; use --kv-dtype f16")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_ctx = L.llama_n_ctx(self.ctx)
        self.vocab = LlamaVocab(self.model)
        self.n_vocab = self.vocab.n_vocab
        st = path.stat()
        # What the KV bytes depend on: the file, this runner and its llama.cpp (the state
        # format), the KV type and whether V is stored transposed (flash attention off).
        self.fingerprint = (f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|llamacpp {L.__version__}|"
                            f"{config.cache.kv_dtype}|fa {int(cparams.flash_attn_type)}|ngl {self.n_gpu_layers}").encode()
        self._init_batch()
        self._init_slots()

    def _init_slots(self) -> None:
        self._free_slots = list(range(self.n_slots - 1, -1, -1))
        self._active: dict[int, int] = {}  # seq_id -> slot
        self._holders: OrderedDict[int, list[int]] = OrderedDict()  # slot -> its block ids; LRU first
        self._owners: dict[int, set[int]] = {}  # block id -> slots holding its cells
        self._block_index: dict[int, int] = {}  # block id -> its position in its chain

    def set_threads(self, n: int) -> None:
        """Run the next steps on n CPU threads (one step of 1 token and a batch alike)."""
        L.llama_set_n_threads(self.ctx, n, n)
        self.threads = n

    def reset(self) -> None:
        """Every cell emptied and its placement state with it (llama_memory_clear), so the next
        sequence's cells lie where a new context puts them: llama.cpp's logits depend on that."""
        L.llama_memory_clear(self.mem, True)
        self._init_slots()

    def _init_batch(self) -> None:
        self._batch_buffers = b = _NumpyBatch(self.max_batch)
        self._tokens, self._pos, self._seq_ids, self._logits_flags = b.tokens, b.pos, b.seq_ids, b.logits_flags
        self._batch = b.batch

    # -- a step -------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> np.ndarray:
        n, bs = 0, self.block_size
        n_out = 0
        for sched in out.scheduled:
            seq, k = sched.seq, sched.num_new_tokens
            slot = self._active[seq.seq_id]
            start = seq.num_computed_tokens
            if n + k > self.max_batch:  # llama.cpp aborts the process on an oversized batch
                raise EngineError(f"step of {n + k} tokens exceeds the batch of {self.max_batch}")
            if sched.num_draft_tokens:
                self._tokens[n] = seq.token_at(start)
                self._tokens[n + 1:n + k] = seq.draft_token_ids
            elif k == 1:
                self._tokens[n] = seq.token_at(start)
            elif start + k <= seq.num_prompt_tokens:
                self._tokens[n:n + k] = seq.prompt_token_ids[start:start + k]
            else:
                self._tokens[n:n + k] = seq.token_ids[start:start + k]
            self._pos[n:n + k] = np.arange(start, start + k, dtype=np.int32)
            self._seq_ids[n:n + k] = slot
            self._logits_flags[n:n + k] = 0
            if sched.needs_logits:
                self._logits_flags[n + k - sched.num_logits:n + k] = 1
                n_out += sched.num_logits
            for i in range(start // bs, (start + k - 1) // bs + 1):
                block_id = seq.block_table[i]
                self._owners.setdefault(block_id, set()).add(slot)
                self._block_index[block_id] = i
            n += k
        if n == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        self._batch.n_tokens = n
        rc = L.llama_decode(self.ctx, self._batch)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} on a step of {n} tokens")
        if n_out == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        ptr = L.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))

    # -- KV bookkeeping (KVListener) ----------------------------------------------------

    def attach(self, seq: Sequence, num_hit_blocks: int) -> int:
        slot = self._take_slot()
        self._active[seq.seq_id] = slot
        if num_hit_blocks == 0:
            return 0
        bs = self.block_size
        hits = seq.block_table[:num_hit_blocks]
        if self.n_swa > 0:
            # Sliding-window layers keep only a window of each slot's cells, and llama.cpp
            # reuses cells that slid out of it. Take the whole prefix from one slot whose
            # cells still reach back to the window the next token needs, or take nothing.
            best, num = None, 0
            for src in self._owners.get(hits[0], ()):
                k = 0
                while k < len(hits) and src in self._owners.get(hits[k], ()):
                    k += 1
                if k > num:
                    best, num = src, k
            if best is None:
                return 0
            pos_min = L.llama_memory_seq_pos_min(self.mem, best)
            if pos_min < 0 or pos_min > max(0, num * bs - self.n_swa):
                return 0
            runs = [(best, 0, num)]
        else:
            runs, num = [], 0
            for i, block_id in enumerate(hits):
                owners = self._owners.get(block_id)
                if not owners:
                    break
                if runs and runs[-1][0] in owners:
                    runs[-1] = (runs[-1][0], runs[-1][1], i + 1)
                else:
                    runs.append((min(owners), i, i + 1))
                num = i + 1
        for src, first, end in runs:
            L.llama_memory_seq_cp(self.mem, src, slot, first * bs, end * bs)
            if src in self._holders:
                self._holders.move_to_end(src)
        for i, block_id in enumerate(hits[:num]):
            self._owners[block_id].add(slot)
            self._block_index[block_id] = i
        return num

    def release(self, seq: Sequence, kept_block_ids: list[int]) -> list[int]:
        slot = self._active.pop(seq.seq_id, None)
        if slot is None:
            return []
        bs, kept = self.block_size, set(kept_block_ids)
        keep_runs: list[list[int]] = []  # [first, end) block ranges that stay
        for i, block_id in enumerate(seq.block_table):
            if block_id in kept:
                if keep_runs and keep_runs[-1][1] == i:
                    keep_runs[-1][1] = i + 1
                else:
                    keep_runs.append([i, i + 1])
            else:
                owners = self._owners.get(block_id)
                if owners is not None:
                    owners.discard(slot)
                    if not owners:
                        del self._owners[block_id]
        if not keep_runs:
            L.llama_memory_seq_rm(self.mem, slot, -1, -1)
            self._free_slots.append(slot)
            return []
        # Remove every cell outside the kept runs (gaps, the partial tail, anything after).
        edge = 0
        for first, end in keep_runs:
            if first > edge:
                L.llama_memory_seq_rm(self.mem, slot, edge * bs, first * bs)
            edge = end
        L.llama_memory_seq_rm(self.mem, slot, edge * bs, -1)
        self._holders[slot] = [b for b in seq.block_table if b in kept]
        dropped: list[int] = []
        while len(self._holders) > self.n_slots - self.max_active:
            dropped += self._drop_holder(next(iter(self._holders)))
        return dropped

    def truncate(self, seq: Sequence, num_tokens: int, dropped_block_ids: list[int]) -> None:
        slot = self._active[seq.seq_id]
        L.llama_memory_seq_rm(self.mem, slot, num_tokens, -1)
        for block_id in dropped_block_ids:
            owners = self._owners.get(block_id)
            if owners is not None:
                owners.discard(slot)
                if not owners:
                    del self._owners[block_id]
                    self._block_index.pop(block_id, None)

    def evict(self, block_id: int) -> None:
        i = self._block_index.pop(block_id, None)
        for slot in self._owners.pop(block_id, ()):
            L.llama_memory_seq_rm(self.mem, slot, i * self.block_size, (i + 1) * self.block_size)
            blocks = self._holders.get(slot)
            if blocks is not None:
                blocks.remove(block_id)
                if not blocks:
                    del self._holders[slot]
                    L.llama_memory_seq_rm(self.mem, slot, -1, -1)
                    self._free_slots.append(slot)

    def _take_slot(self) -> int:
        if not self._free_slots:
            raise EngineError("no free llama.cpp sequence slot; this is a bug in localllm")
        return self._free_slots.pop()

    def _drop_holder(self, slot: int) -> list[int]:
        """Recycle a holder slot; returns the blocks that no slot holds any more."""
        dropped = []
        for block_id in self._holders.pop(slot):
            owners = self._owners[block_id]
            owners.discard(slot)
            if not owners:
                del self._owners[block_id]
                self._block_index.pop(block_id, None)
                dropped.append(block_id)
        L.llama_memory_seq_rm(self.mem, slot, -1, -1)
        self._free_slots.append(slot)
        return dropped

    # -- the prefix store's bytes ---------------------------------------------------------

    def export_kv(self, seq: Sequence, num_tokens: int):
        """The KV of seq's first ``num_tokens`` positions as llama.cpp's sequence state (a
        ctypes buffer), when its slot holds exactly those; else None."""
        slot = self._active.get(seq.seq_id)
        if slot is None:
            return None
        lo = L.llama_memory_seq_pos_min(self.mem, slot)
        hi = L.llama_memory_seq_pos_max(self.mem, slot)
        if hi != num_tokens - 1 or lo < 0 or (self.n_swa == 0 and lo != 0):
            return None
        size = L.llama_state_seq_get_size(self.ctx, slot)
        buf = (ctypes.c_uint8 * size)()
        if L.llama_state_seq_get_data(self.ctx, buf, size, slot) != size:
            return None
        return buf

    def import_kv(self, seq: Sequence, payload, num_tokens: int) -> str:
        """Load bytes of ``export_kv`` into seq's (attached, empty) slot and keep its first
        ``num_tokens`` positions. "ok"; "refused" when llama.cpp does not take the bytes;
        "inexact" when a sliding-window model's cells would not reach back far enough to give
        the logits a full computation gives. The slot is left empty unless "ok"."""
        slot = self._active[seq.seq_id]
        view = memoryview(payload)
        buf = (ctypes.c_uint8 * view.nbytes).from_buffer(view)
        if L.llama_state_seq_set_data(self.ctx, buf, view.nbytes, slot) != view.nbytes:
            L.llama_memory_seq_rm(self.mem, slot, -1, -1)
            return "refused"
        L.llama_memory_seq_rm(self.mem, slot, num_tokens, -1)
        lo = L.llama_memory_seq_pos_min(self.mem, slot)
        hi = L.llama_memory_seq_pos_max(self.mem, slot)
        # The next position, num_tokens, attends to positions above num_tokens - n_swa.
        reach = max(0, num_tokens - self.n_swa + 1) if self.n_swa else 0
        if hi != num_tokens - 1 or lo < 0 or lo > reach:
            L.llama_memory_seq_rm(self.mem, slot, -1, -1)
            return "inexact" if self.n_swa and hi == num_tokens - 1 else "refused"
        for i in range(-(-num_tokens // self.block_size)):
            block_id = seq.block_table[i]
            self._owners.setdefault(block_id, set()).add(slot)
            self._block_index[block_id] = i
        return "ok"

    # -- inspection ---------------------------------------------------------------------

    def seq_pos_range(self, seq_id: int) -> tuple[int, int] | None:
        slot = self._active.get(seq_id)
        if slot is None:
            return None
        lo = L.llama_memory_seq_pos_min(self.mem, slot)
        hi = L.llama_memory_seq_pos_max(self.mem, slot)
        return None if lo < 0 else (lo, hi)

    def slot_pos_ranges(self) -> dict[int, tuple[int, int]]:
        """(min, max) position of every llama.cpp sequence id that holds cells."""
        ranges = {}
        for slot in range(self.n_slots):
            lo = L.llama_memory_seq_pos_min(self.mem, slot)
            if lo >= 0:
                ranges[slot] = (lo, L.llama_memory_seq_pos_max(self.mem, slot))
        return ranges

    @property
    def num_parameters(self) -> int:
        """llama.cpp's own count of the model's weights (llama_model_n_params)."""
        return int(L.llama_model_n_params(self.model))

    @property
    def weights_bytes(self) -> int:
        """The bytes of the model's tensors (llama_model_size)."""
        return int(L.llama_model_size(self.model))

    @property
    def num_active_slots(self) -> int:
        return len(self._active)

    @property
    def num_holder_slots(self) -> int:
        return len(self._holders)

    def close(self) -> None:
        _free(self)


# -- embedding models ----------------------------------------------------------------------

_POOLING_TYPES = {"mean": L.LLAMA_POOLING_TYPE_MEAN, "cls": L.LLAMA_POOLING_TYPE_CLS,
                  "last": L.LLAMA_POOLING_TYPE_LAST}


class LlamaEmbeddingModel:
    """An embedding model in a llama.cpp context of its own: many token sequences go through
    one ``llama_decode``, each under its own sequence id, and come back pooled (one vector a
    sequence, not normalized). An encoder (BERT) has no KV cache and cannot split a sequence,
    so every call must fit one ubatch: at most ``n_ctx`` tokens and ``max_seqs`` sequences
    in all. A decoder (Qwen3-Embedding, last-token pooling) gets a KV cache of ``n_ctx``
    cells, emptied before each call. Not thread-safe: the caller holds a lock."""

    def __init__(self, path: Path, pooling: str, n_ctx: int, max_seqs: int, threads: int,
                 n_gpu_layers: int = -1):
        if n_ctx % max_seqs:  # llama.cpp aborts the process while reserving the pooling graph
            raise EngineError(f"an embedding context of {n_ctx} tokens is not a multiple of {max_seqs} sequences")
        _init_backend()
        check_gguf(path)
        self.model, self.n_gpu_layers, _ = _load_model(path, n_gpu_layers)
        cparams = L.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = n_ctx
        cparams.n_seq_max = max_seqs
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.embeddings = True
        cparams.pooling_type = _POOLING_TYPES[pooling]
        cparams.kv_unified = True
        cparams.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            L.llama_model_free(self.model)
            self.model = None
            raise ModelLoadError(f"llama.cpp could not create an embedding context of {n_ctx} tokens "
                                 f"for {path}; the machine may lack the memory")
        self.mem = L.llama_get_memory(self.ctx)  # None for an encoder
        self.n_ctx, self.max_seqs = n_ctx, max_seqs
        self.dim = L.llama_model_n_embd_out(self.model)
        self.vocab = LlamaVocab(self.model)
        self._buffers = _NumpyBatch(max(n_ctx, 2))
        self._buffers.logits_flags[:] = 1  # every token is an output: pooling reads them all

    def embed(self, token_lists: list[list[int]]) -> np.ndarray:
        """The pooled vectors (len(token_lists), dim) of sequences that fit one call; token
        ids already checked against the vocabulary (llama.cpp only logs a bad one)."""
        b, n = self._buffers, 0
        if len(token_lists) > self.max_seqs or sum(map(len, token_lists)) > self.n_ctx:
            raise EngineError(f"an embedding batch of {len(token_lists)} sequences exceeds "
                              f"{self.max_seqs} sequences or {self.n_ctx} tokens")
        for seq_id, ids in enumerate(token_lists):
            k = len(ids)
            b.tokens[n:n + k] = ids
            b.pos[n:n + k] = np.arange(k, dtype=np.int32)
            b.seq_ids[n:n + k] = seq_id
            n += k
        if n == 1:
            # One token alone would take ggml's matrix-vector path, which rounds otherwise
            # than the matrix-matrix one every larger call takes: a second sequence of one token.
            b.tokens[1], b.pos[1], b.seq_ids[1] = b.tokens[0], 0, len(token_lists)
            n = 2
        if self.mem:
            L.llama_memory_clear(self.mem, True)
        b.batch.n_tokens = n
        rc = L.llama_decode(self.ctx, b.batch)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} on an embedding batch of {n} tokens")
        out = np.empty((len(token_lists), self.dim), dtype=np.float32)
        for seq_id in range(len(token_lists)):
            ptr = L.llama_get_embeddings_seq(self.ctx, seq_id)
            if not ptr:
                raise EngineError(f"llama.cpp returned no pooled embedding for sequence {seq_id}")
            out[seq_id] = np.ctypeslib.as_array(ptr, shape=(self.dim,))
        return out

    def close(self) -> None:
        _free(self)
