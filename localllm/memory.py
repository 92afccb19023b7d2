"""How many tokens of KV cache a model gets on this machine, decided before anything is allocated.

The KV pool is one pool of tokens shared by every sequence (the BlockManager's blocks): a
request's ``max_tokens`` reserves nothing, blocks are taken as tokens are computed. Its size:

- ``--ctx N`` given: N tokens, if the weights, N tokens of KV and the headroom fit in the
  memory the pool lives in; otherwise a ``ModelLoadError`` that says how much is needed and
  what to change, raised before the runner loads anything.
- not given: what fits, ``free - weights - headroom`` divided by the KV bytes per token,
  capped at the model's trained context (the longest conversation it can hold); below
  ``AUTO_MIN_TOKENS`` (or the trained context, if shorter) it is the same error.

*free* is the memory the KV cache will live in: the GPUs' free memory when llama.cpp offloads
to one (all layers; the torch runner on CUDA: that device), otherwise available RAM (the
cgroup's limit counted), or ``--memory`` when given. *headroom* is ``HEADROOM_BASE`` plus
``HEADROOM_SHARE`` of free: compute buffers, Python, and what the rest of the machine needs.
Weights are the GGUF's tensor bytes (the torch runner's converted weights are about as big).
KV bytes per token come from the file's attention shape and the KV dtype; for a
sliding-window model (Gemma 3) they count every layer at full length, which overstates the
real pool, never understates it. What the runner really allocated is measured afterwards
(``ModelRunner.kv_bytes``) and shown by ``describe_pool``.
"""

from __future__ import annotations

from dataclasses import dataclass

from localllm.config import EngineConfig
from localllm.errors import ModelLoadError, ModelTooLarge
from localllm.gguf import GGUFInfo

HEADROOM_BASE = 512 << 20
HEADROOM_SHARE = 0.05
AUTO_MIN_TOKENS = 2048
POOL_ALIGN = 256  # llama.cpp rounds its context up to this; the pool is a multiple of it
# Bytes per stored value as (bytes, values): llama.cpp's Q8_0 is blocks of 32 int8 values
# with one float16 scale.
VALUE_BYTES = {"f16": (2, 1), "f32": (4, 1), "q8_0": (34, 32)}


@dataclass(frozen=True)
class KVPlan:
    tokens: int  # the pool: KV cells (tokens) for all sequences together
    kv_bytes_per_token: int
    kv_dtype: str
    weights_bytes: int
    free: int | None  # bytes of the memory the pool lives in; None: unknown (nothing checked)
    headroom: int
    where: str  # "RAM", "VRAM (NVIDIA H200)", "--memory"
    limited_by: str  # "--ctx", "memory", "the model's trained context"

    @property
    def kv_bytes(self) -> int:
        return self.tokens * self.kv_bytes_per_token


def _round_down(n: int, step: int) -> int:
    return n // step * step


def kv_bytes_per_token(info: GGUFInfo, kv_dtype: str, runner: str) -> int:
    """K and V of one token in every layer. The torch runner's q8_0 stores int8 values and one
    float16 scale per token and KV head (2 bytes each for K and V); llama.cpp's stores 34
    bytes per 32 values. None-safe: a file that does not describe its attention counts 0."""
    values = info.kv_bytes_per_token(1) or 0
    if kv_dtype == "q8_0" and runner == "torch":
        heads = sum(info.layer_kv_heads) if info.layer_kv_heads else (info.block_count or 0) * (info.head_count_kv or 0)
        return values + 2 * 2 * heads
    num, den = VALUE_BYTES[kv_dtype]
    return -(-values * num // den)


def plan(info: GGUFInfo, kv_dtype: str, runner: str, ctx: int | None, free: int | None,
         where: str = "RAM", block_size: int = 16) -> KVPlan:
    """The pool for a model described by ``info`` (pure: the machine comes in as ``free``)."""
    per_token = max(1, kv_bytes_per_token(info, kv_dtype, runner))
    weights = info.tensor_bytes
    headroom = HEADROOM_BASE + int(HEADROOM_SHARE * free) if free is not None else 0
    trained = info.context_length or 4096
    common = dict(kv_bytes_per_token=per_token, kv_dtype=kv_dtype, weights_bytes=weights, free=free,
                  headroom=headroom, where=where)
    room = None if free is None else free - weights - headroom
    if ctx is not None:
        if room is not None and ctx * per_token > room:
            raise ModelLoadError(_too_big(info, ctx, per_token, weights, headroom, free, where, room, kv_dtype))
        return KVPlan(tokens=ctx, limited_by="--ctx", **common)
    if room is None:  # the memory is unknown: the model's trained context, capped to stay modest
        return KVPlan(tokens=_round_down(min(trained, 32768), block_size) or block_size,
                      limited_by="the model's trained context", **common)
    fit = _round_down(max(0, room) // per_token, POOL_ALIGN)
    if fit >= trained:
        return KVPlan(tokens=_round_down(trained, block_size), limited_by="the model's trained context", **common)
    if fit < min(AUTO_MIN_TOKENS, trained):
        raise ModelLoadError(_too_big(info, min(AUTO_MIN_TOKENS, trained), per_token, weights, headroom,
                                      free, where, room, kv_dtype))
    return KVPlan(tokens=fit, limited_by="memory", **common)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.0f} MiB"


def _too_big(info: GGUFInfo, tokens: int, per_token: int, weights: int, headroom: int, free: int,
             where: str, room: int, kv_dtype: str) -> str:
    need = weights + tokens * per_token + headroom
    have = f"--memory allows {_gib(free)}" if where == "--memory" else f"{_gib(free)} of {where} is free"
    head = (f"{info.path.name} does not fit: it needs {_gib(need)} (weights {_gib(weights)} + KV cache "
            f"for {tokens:,} tokens {_gib(tokens * per_token)} at {kv_dtype} + headroom {_gib(headroom)}), "
            f"but {have}; ")
    more = "raise --memory" if where == "--memory" else "free memory"
    if room <= tokens * per_token // 8:  # the weights themselves are the problem
        return head + f"use a smaller quant of the model (fewer bits per weight), or {more}"
    advice = []
    fits = _round_down(max(0, room) // per_token, POOL_ALIGN)
    if fits >= 256:
        advice.append(f"lower --ctx to {fits:,} or less")
    if kv_dtype != "q8_0":
        advice.append("use --kv-dtype q8_0 (about half the KV bytes)")
    advice.append(f"use a smaller quant of the model, or {more}")
    return head + ", ".join(advice)


def machine_free(config: EngineConfig, runner: str) -> tuple[int | None, str]:
    """(bytes free, what memory) where ``runner``'s KV cache will live; ``config.memory_limit``
    replaces the probe when given."""
    if config.memory_limit is not None:
        return config.memory_limit, "--memory"
    from localllm.runners import device

    if runner == "torch":
        gpus = device.torch_devices().get("cuda") or []
        if gpus:
            return gpus[0]["memory_free"], f"VRAM ({gpus[0]['name']})"
    elif config.n_gpu_layers != 0:
        from localllm.runners.llamacpp import backend_report  # llama_cpp is loaded next anyway

        report = backend_report()
        gpus = [d for d in report.get("devices") or () if d["type"] in ("GPU", "IGPU")]
        if report.get("gpu_offload") and gpus:
            names = " + ".join(d["name"] for d in gpus)
            return sum(d["memory_free"] for d in gpus), f"{'VRAM' if gpus[0]['type'] == 'GPU' else 'GPU memory'} ({names})"
    memory = device.memory_info()
    return (memory.available if memory is not None else None), "RAM"


def plan_for(config: EngineConfig, runner: str, info: GGUFInfo | None = None) -> KVPlan:
    """The pool ``config`` asks for on this machine, for ``runner`` ("llamacpp" or "torch")."""
    from localllm.gguf import read_info

    info = info if info is not None else read_info(config.model_path)
    free, where = machine_free(config, runner)
    return plan(info, config.cache.kv_dtype, runner, config.cache.n_ctx, free, where, config.cache.block_size)


def _short(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else f"{tokens:,}"


def describe_pool(tokens: int, kv_bytes: int, kv_dtype: str, conversation: int = 4096) -> str:
    """One line for people: "32,768 tokens (384 MiB, q8_0): 8 conversations of 4k,
    or 1 of 32k"."""
    head = f"{tokens:,} tokens ({_gib(kv_bytes)}, {kv_dtype})"
    if tokens < 2 * conversation:
        return f"{head}: 1 conversation of {_short(tokens)}"
    return f"{head}: {tokens // conversation} conversations of {_short(conversation)}, or 1 of {_short(tokens)}"


def sized(config: EngineConfig, runner: str) -> tuple[EngineConfig, KVPlan]:
    """``config`` with its pool sized (``cache.n_ctx`` set) and the plan behind it; raises
    ModelLoadError before anything is allocated when the model cannot fit."""
    from dataclasses import replace

    kv_plan = plan_for(config, runner)
    return replace(config, cache=replace(config.cache, n_ctx=kv_plan.tokens)), kv_plan


class SharedMemory:
    """The memory the models of one process share (the ModelManager's ``need_bytes`` and
    ``free_bytes``, for `serve` and the chat app): what was free when it was made (available
    RAM, the GPU's free VRAM, or ``--memory``) less the headroom, less what the loaded models
    hold. Each model is planned by ``plan`` as if it had all of it: ``--ctx`` tokens of KV, or
    what fits up to its trained context; ``config_for`` is the EngineConfig that loads it so."""

    EMBEDDER_BYTES = 64 << 20  # an embedding model's compute buffers beyond its file

    def __init__(self, base: EngineConfig):
        self.base = base
        self.runner = base.runner
        if self.runner == "auto":  # planned as the runner auto takes for the models it supports
            from localllm.engine.engine import CPU_LEADING_TIERS, probe_auto

            probe = probe_auto()
            on_gpu = probe.cuda is not None and not probe.llama_gpu
            on_cpu = probe.cuda is None and probe.cpu_tier in CPU_LEADING_TIERS
            self.runner = "torch" if on_gpu or on_cpu else "llamacpp"
        free, self.where = machine_free(base, self.runner)
        self.total = free
        self.budget = None if free is None else free - HEADROOM_BASE - int(HEADROOM_SHARE * free)
        self.ctx: dict[str, int] = {}  # model name -> KV tokens planned
        self.manager = None  # the ModelManager whose loaded models hold memory

    def need_bytes(self, entry) -> int:
        """Weights and KV pool of ``entry`` (a manager.ModelEntry); ModelTooLarge when it
        cannot fit even alone (the plan's message has the sizes)."""
        from localllm.gguf import read_info

        if entry.kind == "embedding":
            return entry.path.stat().st_size + self.EMBEDDER_BYTES
        cache = self.base.cache
        try:
            kv = plan(read_info(entry.path), cache.kv_dtype, self.runner, cache.n_ctx, self.total, self.where,
                      cache.block_size)
        except ModelLoadError as e:
            raise ModelTooLarge(str(e)) from None
        self.ctx[entry.name] = kv.tokens
        return kv.weights_bytes + kv.kv_bytes

    def free_bytes(self) -> int | None:
        if self.budget is None:
            return None
        return self.budget - (self.manager.loaded_bytes if self.manager is not None else 0)

    def config_for(self, entry) -> EngineConfig:
        from dataclasses import replace

        if entry.name not in self.ctx:
            self.need_bytes(entry)
        return replace(self.base, model_path=entry.path, cache=replace(self.base.cache, n_ctx=self.ctx[entry.name]))
