"""LLMEngine (add_request / step / abort / generate) and AsyncEngine (the same in a
background thread, an asyncio stream per request)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import numpy as np

from localllm.config import DEFAULT_BATCH_TOKENS, EngineConfig, physical_cores
from localllm.engine.block_manager import BlockManager
from localllm.engine.constraint import Constraint, Grammars, is_allowed
from localllm.engine.metrics import EngineStats, RequestMetrics
from localllm.engine.request import FinishReason, SamplingParams, Sequence
from localllm.engine.sampler import Sampler, top_logprobs
from localllm.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from localllm.engine.spec_decode import Drafter
from localllm.engine.threads import ThreadChooser, step_kind
from localllm.errors import LocalLLMError, UsageError
from localllm.gguf_check import check_model
from localllm.memory import describe_pool
from localllm.runners.base import ModelRunner
from localllm.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("localllm.engine")


@dataclass
class RequestOutput:
    """What one step produced for one request: the new tokens and text, and at the end the
    finish reason and the request's figures."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob), best first
    finished: bool = False
    finish_reason: str | None = None
    stop_sequence: str | None = None  # at the end: the stop string that ended it, if one did
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None  # with the first token: prompt tokens the prefix cache gave


@dataclass(frozen=True)
class AutoProbe:
    """What ``--runner auto`` looks at on this machine (see choose_runner)."""

    cuda: str | None  # the name of the NVIDIA GPU torch can use, or None
    graphs: bool  # the torch runner captures decode steps there (Triton is installed)
    llama_gpu: bool  # this install's llama.cpp offloads to a GPU
    cpu_tier: str | None = None  # the tier the native kernels run on this CPU; None without them


# The tiers of the native kernels on which the torch runner leads llama.cpp on the CPU where a
# user waits on it, decode (docs/benchmarks.md, "--runner auto on the CPU"): AVX-512 VNNI
# (1.26-1.42x one stream, 1.8-1.9x eight, 1.2x prefill) and AVX2 on a real AVX2-only CPU
# (1.34-1.40x one stream, 1.21-1.47x eight; prefill 0.97-1.04x). AVX-VNNI runs AVX2's loops
# with vpdpbusd and vpdpwssd; forced on an Intel Xeon that has it, against llama.cpp built for
# AVX2 with AVX-VNNI, it leads as AVX2 does ("Every x86 tier on one Intel Xeon"). The scalar
# tier (no AVX2, or no x86) is far behind: llama.cpp there.
CPU_LEADING_TIERS = frozenset({"avx2", "avxvnni", "avx512vnni"})
# GGUF block formats the native kernels read in place on a tier with vector loops (AVX2 and up),
# for a matrix and for the token embedding table; F32 tensors are read in place everywhere.
CPU_IN_PLACE = frozenset({"Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
CPU_IN_PLACE_EMBEDDING = frozenset({"Q4_0", "Q5_0", "Q8_0"})


def cpu_tier() -> str | None:
    """The native kernels' tier on this CPU, from its flags (no library loaded): None where the
    kernels or torch are not installed; LOCALLLM_NATIVE_ISA lowers it as it lowers the kernels."""
    import importlib.util
    import os

    from localllm.runners import device

    if any(importlib.util.find_spec(m) is None for m in ("torch", "gguf", "localllm._native")):
        return None
    info = device.cpu_info()
    tier = device.native_tier_of(info.machine, info.features)
    order = ("scalar", "avx2", "avxvnni", "avx512vnni")
    forced = os.environ.get("LOCALLLM_NATIVE_ISA", "").strip().lower()
    if forced in order and order.index(forced) < order.index(tier):
        tier = forced
    return tier


def formats_not_in_place(path: str | Path) -> list[str]:
    """The formats of this file's matrices that the torch runner's kernels do not read in their
    own blocks on the CPU (with vector loops; float matrices included: their speed against
    llama.cpp is not measured), sorted; [] where it reads them all."""
    from localllm.gguf import tensor_table

    _, _, tensors = tensor_table(path)
    out = set()
    for t in tensors:
        if len(t.shape) < 2:
            continue  # vectors (norms, biases) are read as floats, in place
        allowed = CPU_IN_PLACE_EMBEDDING if t.name == "token_embd.weight" else CPU_IN_PLACE
        if t.type_name not in allowed:
            out.add(t.type_name)
    return sorted(out)


def probe_auto() -> AutoProbe:
    """The machine as ``--runner auto`` sees it. torch is imported only where an NVIDIA driver
    is, so a machine without one pays nothing."""
    from localllm.runners import device

    cuda, graphs = None, False
    if device.has_nvidia_driver():
        gpus = device.torch_devices().get("cuda") or []
        if gpus:
            from localllm.runners.torch import triton_attention

            cuda, graphs = gpus[0]["name"], triton_attention.available()
    llama_gpu = False
    if cuda is not None:
        from localllm.runners.llamacpp import backend_report

        llama_gpu = backend_report()["gpu_offload"]
    return AutoProbe(cuda, graphs, llama_gpu, cpu_tier())


def choose_runner(arch: str | None, probe: AutoProbe, not_in_place: list[str] | tuple = (),
                  split_count: int = 1) -> tuple[str, str]:
    """``--runner auto``: (runner, why) for a model of architecture ``arch`` whose file holds
    ``not_in_place`` (formats_not_in_place), in ``split_count`` files (the torch runner reads
    one).

    On an NVIDIA GPU that torch can use, when this llama.cpp has no GPU offload (what `pipx
    install localllm` builds), the torch runner on CUDA, for the architectures it has a model
    for: its decode steps are CUDA graphs (docs/benchmarks.md, "The torch runner on CUDA"),
    where llama.cpp would run on the CPU. A llama.cpp with GPU offload keeps the model: no
    same-machine comparison of the two on a GPU is measured yet. On the CPU, the torch runner
    where its native kernels run a tier of CPU_LEADING_TIERS and read every weight of the file
    in place (its speed, exact seeds, drafting and prefix hits that give the cold answer);
    llama.cpp otherwise, and on Metal, where the torch runner has no kernels of its own."""
    from localllm.runners.torch import models

    supported = arch is not None and models.supported(arch)
    if split_count > 1 and (probe.cuda is not None or probe.cpu_tier in CPU_LEADING_TIERS):
        return "llamacpp", f"llama.cpp: the torch runner does not read a model split into {split_count} files"
    if probe.cuda is None:
        return _choose_on_cpu(arch, supported, probe.cpu_tier, not_in_place)
    if probe.llama_gpu:
        return "llamacpp", f"llama.cpp on {probe.cuda}: this llama.cpp offloads to the GPU"
    if not supported:
        return "llamacpp", (f"llama.cpp on the CPU: the torch runner has no model for the {arch!r} architecture and "
                            "this llama.cpp has no GPU offload; `localllm doctor` prints how to rebuild it with CUDA")
    how = "decode steps as CUDA graphs" if probe.graphs else "without CUDA graphs: Triton is not installed"
    return "torch", f"the torch runner on {probe.cuda} ({how}): this llama.cpp has no GPU offload"


def _choose_on_cpu(arch: str | None, supported: bool, tier: str | None,
                   not_in_place: list[str] | tuple) -> tuple[str, str]:
    if tier is None:
        return "llamacpp", ("llama.cpp on the CPU: this install lacks the torch runner's native kernels or "
                            "PyTorch (`localllm doctor` says which; the kernels build with localllm where a C "
                            "compiler is)")
    if tier not in CPU_LEADING_TIERS:
        return "llamacpp", (f"llama.cpp on the CPU: the torch runner leads it only with its vector kernels "
                            f"(AVX2 and up), and this CPU's are {tier}")
    if not supported:
        return "llamacpp", f"llama.cpp on the CPU: the torch runner has no model for the {arch!r} architecture"
    if not_in_place:
        return "llamacpp", (f"llama.cpp on the CPU: the torch runner's kernels do not read this file's "
                            f"{', '.join(not_in_place)} matrices in their own blocks")
    return "torch", (f"the torch runner on the CPU: its {tier} kernels read every tensor of this file in place "
                     "(exact seeds and drafting, prefix hits that give the cold answer)")


def load_runner(config: EngineConfig) -> ModelRunner:
    """The runner ``config.runner`` names; "auto" as choose_runner decides (one line says which
    and why: info where a GPU made it a choice, debug on the CPU; the runner keeps the reason as
    ``chosen_because``). "torch" on an architecture it has no model for falls back to llama.cpp
    with one info line."""
    name, why = config.runner, None
    if name == "auto":
        probe = probe_auto()
        arch, not_in_place, split_count = None, (), 1
        if probe.cuda is not None or probe.cpu_tier in CPU_LEADING_TIERS:
            # the check either runner makes first, made here: its header read serves the rest
            info = check_model(Path(config.model_path))
            arch, split_count = info.architecture, info.split_count
            if probe.cuda is None and split_count == 1:
                not_in_place = formats_not_in_place(config.model_path)
        name, why = choose_runner(arch, probe, not_in_place, split_count)
        # Said where a GPU made it a choice; on the CPU `serve` and `doctor` print the reason
        # (a command's stderr stays its own: `run` prints one timing line there).
        (log.info if probe.cuda is not None else log.debug)("%s: %s", Path(config.model_path).name, why)
    runner = _load_named(config, name)
    if why is not None and runner.name == name:
        runner.chosen_because = why
    return runner


def _load_named(config: EngineConfig, name: str) -> ModelRunner:
    if name == "torch":
        from localllm.runners.llamacpp import VocabFile

        path = Path(config.model_path)
        # the check the runner makes first, made here: its header read serves the rest of the load
        arch = check_model(path).architecture
        # The torch runner tokenizes with llama.cpp's vocabulary of the file: it loads in
        # llama.cpp's own code, which holds no GIL, while torch is imported (0.3 s of a 2.3 s load).
        with ThreadPoolExecutor(1, thread_name_prefix="localllm-vocab") as pool:
            vocab = pool.submit(VocabFile, path)
            try:
                from localllm.runners.torch import models
                from localllm.runners.torch.runner import TorchRunner
            except ImportError as e:
                _close_vocab(vocab)
                raise UsageError(f"the torch runner needs PyTorch and the gguf package, which localllm depends on "
                                 f"({e}): reinstall localllm with its dependencies, or use --runner llamacpp") from None
            if models.supported(arch):
                vocab_file = vocab.result()
                try:
                    return TorchRunner(config, vocab_file=vocab_file)
                except BaseException:
                    vocab_file.close()
                    raise
            _close_vocab(vocab)
        log.info("the torch runner has no model for the %s architecture; using llama.cpp", arch)
    from localllm.runners.llamacpp import LlamaCppRunner

    return LlamaCppRunner(config)


def _close_vocab(vocab: Future) -> None:
    """A vocabulary loaded for a runner that will not be built: freed, or its error dropped."""
    with contextlib.suppress(Exception):
        vocab.result().close()


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None):
        self.config = config
        self.runner = runner if runner is not None else load_runner(config)
        self.tokenizer = Tokenizer(self.runner.vocab, name=Path(config.model_path).name)
        self.grammars = Grammars(self.runner.vocab)  # its vocabulary is read for the first grammar
        self._mask_thread: ThreadPoolExecutor | None = None  # started for the first grammar
        block_size = config.cache.block_size
        self.prefix_store = None
        if (config.prefix_cache_dir is not None and config.prefix_cache_size > 0
                and hasattr(self.runner, "export_kv")):
            from localllm.engine.prefix_store import PrefixStore

            self.prefix_store = PrefixStore(
                config.prefix_cache_dir, self.runner.fingerprint, block_size,
                budget_bytes=config.prefix_cache_size, min_tokens=config.prefix_cache_min_tokens,
                model_name=Path(config.model_path).name)
        self.max_model_len = self.runner.n_ctx // block_size * block_size
        # The pool as people read it, from what the runner really allocated (None for a runner
        # that does not measure it, such as the tests' fakes).
        kv_bytes = getattr(self.runner, "kv_bytes", None)
        self.kv_pool_summary = (describe_pool(self.max_model_len, kv_bytes, config.cache.kv_dtype)
                                if kv_bytes else None)
        # The CPU threads of each step (engine/threads.py): what the machine gives now, or the
        # count --threads fixes. None where the CPU does not compute the steps (a GPU) or the
        # runner has no count to set. It outlives reset(): it learns the machine, not requests.
        self.threads: ThreadChooser | None = None
        if getattr(self.runner, "uses_cpu_threads", False):
            self.threads = ThreadChooser(config.n_threads or physical_cores(), fixed=config.n_threads or None)
        self._init_state()

    def _init_state(self) -> None:
        """Everything of the engine's own that requests change: the KV blocks, the queues, the
        drafter's learning, the counters (the runner and the on-disk prefix cache stay)."""
        block_size = self.config.cache.block_size
        self.block_manager = BlockManager(
            self.runner.n_ctx // block_size, block_size, self.runner.fingerprint, listener=self.runner,
            prefix_source=_StoredPrefixes(self.prefix_store, self.runner) if self.prefix_store else None,
        )
        # Sliding-window models drop cells as the window moves; a rollback could not restore
        # them, so they are never drafted for.
        self.drafter = None if getattr(self.runner, "n_swa", 0) else Drafter()
        if self.config.scheduler.max_num_batched_tokens is None:  # the runner's default, within the context
            budget = getattr(self.runner, "default_batch_tokens", DEFAULT_BATCH_TOKENS)
            budget = max(min(budget, self.max_model_len), self.config.scheduler.max_num_seqs)
            self.config = replace(self.config, scheduler=replace(self.config.scheduler, max_num_batched_tokens=budget))
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager, self.max_model_len,
                                   proposer=self._propose if self.drafter is not None else None)
        self.sampler = Sampler()
        self._seqs: dict[str, Sequence] = {}
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._constraints: dict[str, Constraint] = {}  # request id -> its grammar's state
        self.num_draft_proposed = 0
        self.num_draft_accepted = 0
        self.last_step: SchedulerOutput | None = None  # what the latest step computed
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        self.num_tokens_generated = 0
        self.num_disk_cached_tokens = 0  # prompt tokens loaded from the on-disk prefix cache

    def reset(self) -> None:
        """Back to as the model was loaded, without loading it again: every request aborted,
        the runner's KV storage emptied, the in-memory prefix cache, the drafter's learning and
        the counters gone. The on-disk prefix cache stays, with its queued writes. The next
        request is computed exactly as on a new engine (the same KV cells, the same blocks)."""
        for request_id in list(self._seqs):
            self.abort(request_id)
        self.runner.reset()
        self._init_state()

    # -- requests -----------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        """Queue a prompt (text, or token ids such as a rendered chat) for generation."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.runner.vocab.n_vocab]
            if bad:
                raise UsageError(f"token id {bad[0]!r} is outside the vocabulary of {self.runner.vocab.n_vocab}")
        if not token_ids:
            raise UsageError("the prompt is empty; give at least one token of text")
        params.check_vocab(self.runner.vocab.n_vocab)
        if request_id is not None and request_id in self._seqs:
            raise UsageError(f"request id {request_id!r} is already in use")
        seq = Sequence(prompt_token_ids=token_ids, params=params, request_id=request_id or "")
        constraint = self.grammars.constraint(params.grammar) if params.grammar is not None else None
        try:
            self.scheduler.add(seq)
        except Exception:
            if constraint is not None:
                constraint.free()
            raise
        if constraint is not None:
            self._constraints[seq.request_id] = constraint
        self._seqs[seq.request_id] = seq
        self._detoks[seq.request_id] = IncrementalDetokenizer(
            self.runner.vocab.token_to_piece, params.stop
        )
        return seq

    def check_grammar(self, grammar: str) -> None:
        """Raise UsageError when ``grammar`` cannot constrain an answer (a door's early check, so
        a bad grammar is the request's 400 before any answer starts). Thread-safe."""
        self.grammars.check(grammar)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks go back at once. None if it is not known."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, FinishReason.ABORT, RequestOutput(request_id))

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        out = self.last_step = self.scheduler.schedule()
        num_tokens = sum(s.num_new_tokens for s in out.scheduled)
        decode_only = all(s.num_new_tokens == 1 + s.num_draft_tokens and s.needs_logits for s in out.scheduled)
        kind = step_kind(decode_only, num_tokens)
        threads = None
        if self.threads is not None and num_tokens:
            threads = self.threads.pick(kind, num_tokens)
            if threads != self.runner.threads:
                self.runner.set_threads(threads)
        masks = self._start_masks(out)
        logits = self.runner.execute(out)
        outputs = self._update(out, logits, masks.result() if masks is not None else {})
        seconds = time.perf_counter() - start
        if threads is not None:
            self.threads.record(kind, threads, num_tokens, seconds)
        # What this step's size costs on this machine, at the count steps run on (not a probe's).
        if self.drafter is not None and (threads is None or threads == self.threads.current(kind)):
            self.drafter.cost.record(num_tokens, seconds, decode_only=decode_only)
        return outputs

    def _start_masks(self, out: SchedulerOutput) -> Future | None:
        """The grammar masks of this step's constrained rows, computed on a thread while the
        forward runs (llguidance drops the GIL): a Future of {seq id: masks (rows, words)}, or
        None when no row is constrained."""
        work = [(s.seq.seq_id, self._constraints[s.seq.request_id], s.seq.draft_token_ids if s.num_draft_tokens else ())
                for s in out.scheduled if s.needs_logits and s.seq.request_id in self._constraints]
        if not work:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="localllm-masks")

        def fill() -> dict[int, np.ndarray]:
            masks = {}
            for seq_id, constraint, draft in work:
                rows = constraint.new_masks(1 + len(draft))
                try:
                    constraint.fill_draft(draft, rows)
                except UsageError as e:  # its grammar broke: that sequence ends (_sample, _verify)
                    log.warning("sequence %d: its grammar cannot go on: %s", seq_id, e)
                    continue
                masks[seq_id] = rows
            return masks

        return self._mask_thread.submit(fill)

    def _update(self, out: SchedulerOutput, logits, masks: dict[int, np.ndarray]) -> list[RequestOutput]:
        now = time.perf_counter()
        self.num_steps += 1
        outputs, row = [], 0
        for sched in out.scheduled:
            seq, needs_logits = sched.seq, sched.needs_logits
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(sched.num_new_tokens,
                                                       seq.num_prompt_tokens - seq.num_computed_tokens)
            if sched.num_draft_tokens:
                num_rows = sched.num_logits  # (before num_computed_tokens moves)
                seq.num_computed_tokens += sched.num_new_tokens
                outputs.append(self._verify(sched, logits[row:row + num_rows], masks.get(seq.seq_id), now))
                row += num_rows
                continue
            seq.num_computed_tokens += sched.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if seq.num_output_tokens == 0 and seq.num_computed_tokens == seq.num_prompt_tokens:
                self.num_disk_cached_tokens += seq.num_disk_tokens  # the prompt is in, once
                if self.prefix_store is not None:
                    self._store_prompt(seq)
            if not needs_logits:
                continue
            seq_masks = masks.get(seq.seq_id)  # (1, words) when constrained
            sampled = self._sample(seq, logits[row], seq_masks[0] if seq_masks is not None else None)
            row += 1
            if sampled is None:  # the grammar allows no token at all
                outputs.append(self._finish(seq, FinishReason.ERROR, RequestOutput(seq.request_id)))
                continue
            result = self._append_token(seq, *sampled, now)
            if self.drafter is not None and not result.finished:
                self.drafter.on_tokens(seq.seq_id, result.token_ids)
            if seq.params.top_logprobs:
                result.top_logprobs = [top_logprobs(logits[row - 1], seq.params.top_logprobs)]
            outputs.append(result)
        return outputs

    def _store_prompt(self, seq: Sequence) -> None:
        """Hand a just-prefilled prompt's KV to the prefix store (its writer thread writes it)
        when enough of the prompt is not stored yet. Costs one copy of the KV here."""
        prompt, store = seq.prompt_token_ids, self.prefix_store
        hashes = self.block_manager.hashes_of(seq)
        if not store.wants(prompt, hashes):
            return
        payload = self.runner.export_kv(seq, len(prompt))
        if payload is not None:
            store.save(prompt, hashes, payload)

    def _propose(self, candidates: list[tuple[Sequence, int]], num_tokens: int, num_outputs: int,
                 budget: int) -> dict[int, list[int]]:
        """This step's drafts, for the decoding sequences that may draft (see Drafter.plan); a
        constrained sequence's draft is cut where its grammar stops allowing it."""
        eligible = []
        for seq, room in candidates:
            wants = seq.params.speculative
            if wants is False or (wants is None and not self.config.speculative) or not _can_draft(seq.params):
                continue
            eligible.append((seq.seq_id, seq.token_ids, room, wants is True))
        drafts = self.drafter.plan(eligible, num_tokens, num_outputs, budget) if eligible else {}
        if self._constraints and drafts:
            for seq, _ in candidates:
                constraint = self._constraints.get(seq.request_id)
                draft = drafts.get(seq.seq_id)
                if constraint is not None and draft:
                    num_valid = constraint.valid_prefix(draft)
                    if num_valid < len(draft):
                        drafts[seq.seq_id] = draft[:num_valid]
        return drafts

    def _verify(self, sched: ScheduledSeq, rows: np.ndarray, masks: np.ndarray | None, now: float) -> RequestOutput:
        """Check a sequence's drafts against the model (rows: one per position, the last known
        token's first): keep the accepted run plus one token of the model's own, roll the KV of
        the rest back. A stop, EOS or max_tokens inside the run ends it at that token. A
        constrained sequence's rows are masked first, each by its grammar's mask after the
        drafts before it (``masks``), so what it emits is what undrafted steps would."""
        seq = sched.seq
        draft, seq.draft_token_ids = seq.draft_token_ids, []
        constraint = self._constraints.get(seq.request_id)
        if constraint is not None:
            if masks is None:  # its grammar broke while its masks were computed
                return self._finish(seq, FinishReason.ERROR, RequestOutput(seq.request_id))
            rows = np.stack([constraint.masked(rows[i], masks[i]) for i in range(len(rows))])
        emitted, num_accepted = self.sampler.verify(seq, draft, rows)
        seq.num_draft_proposed += len(draft)
        seq.num_draft_accepted += num_accepted
        self.num_draft_proposed += len(draft)
        self.num_draft_accepted += num_accepted
        self.drafter.on_verified(seq.seq_id, len(draft), num_accepted)
        # Valid KV: the last known token and the accepted drafts; the rest is rolled back.
        seq.num_computed_tokens += 1 + num_accepted - sched.num_new_tokens
        self.block_manager.truncate(seq)
        merged = RequestOutput(seq.request_id)
        for token_id in emitted:
            if constraint is not None:
                constraint.accept(token_id)
            out = self._append_token(seq, token_id, None, now)
            merged.token_ids += out.token_ids
            merged.text += out.text
            if out.num_cached_tokens is not None:
                merged.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                merged.finished, merged.finish_reason, merged.metrics = True, out.finish_reason, out.metrics
                merged.stop_sequence = out.stop_sequence
                break
        if not merged.finished:
            self.block_manager.cache_full_blocks(seq)
        return merged

    def _sample(self, seq: Sequence, logits: np.ndarray, mask: np.ndarray | None) -> tuple[int, float | None] | None:
        """seq's next token and its logprob, within its grammar if it has one (``mask``, this
        step's, or computed now); None when the grammar allows nothing. A greedy request
        without logprobs takes the plain argmax when the grammar allows it: the masked argmax
        is the same token. A preempted sequence keeps its grammar's state: its output tokens
        are recomputed, never sampled (or accepted) again."""
        constraint = self._constraints.get(seq.request_id)
        if constraint is None:
            return self.sampler.sample(seq, logits)
        if mask is None:  # none this step (its grammar broke on the mask thread): once more, here
            mask = constraint.new_masks(1)[0]
            try:
                constraint.fill(mask)
            except UsageError as e:
                log.warning("request %s: its grammar cannot go on: %s", seq.request_id, e)
                return None
        if constraint.error is not None:
            log.warning("request %s: its grammar cannot go on: %s", seq.request_id, constraint.error)
            return None
        if seq.params.is_greedy and not seq.params.logprobs:
            token_id, logprob = self.sampler.sample(seq, logits)
            if is_allowed(mask, token_id):
                constraint.accept(token_id)
                return token_id, logprob
        masked = constraint.masked(logits, mask)  # (vocab,)
        if masked.max() == -np.inf:
            return None
        token_id, logprob = self.sampler.sample(seq, masked)
        constraint.accept(token_id)
        return token_id, logprob

    def _append_token(self, seq: Sequence, token_id: int, logprob: float | None, now: float) -> RequestOutput:
        params = seq.params
        seq.output_token_ids.append(token_id)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        if seq.first_token_time is None:
            seq.first_token_time = now
        self.num_tokens_generated += 1
        result = RequestOutput(seq.request_id, [token_id], logprobs=[logprob] if logprob is not None else None)
        if seq.num_output_tokens == 1:
            result.num_cached_tokens = seq.num_cached_tokens
        detok = self._detoks[seq.request_id]
        reason = None
        if (self.tokenizer.is_eog(token_id) and not params.ignore_eos) or token_id in params.stop_token_ids:
            reason = FinishReason.STOP
        else:
            result.text = detok.add(token_id)
            if detok.stop_matched is not None:
                reason = FinishReason.STOP
            elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
                reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(seq, reason, result)
        return result

    def _finish(self, seq: Sequence, reason: FinishReason, result: RequestOutput) -> RequestOutput:
        detok = self._detoks.pop(seq.request_id)
        if detok.stop_matched is None and reason is not FinishReason.ABORT:
            result.text += detok.flush()
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        if self.drafter is not None:
            self.drafter.forget(seq.seq_id)
        self.scheduler.finish(seq)
        self.sampler.free(seq.seq_id)
        constraint = self._constraints.pop(seq.request_id, None)
        if constraint is not None:
            constraint.free()
        del self._seqs[seq.request_id]
        result.finished = True
        result.finish_reason = reason.value
        result.stop_sequence = detok.stop_matched
        result.metrics = RequestMetrics.of(seq)
        return result

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with an error (the runner failed); the engine stays usable."""
        return [self._finish(seq, FinishReason.ERROR, RequestOutput(rid, text=""))
                for rid, seq in list(self._seqs.items())]

    # -- convenience --------------------------------------------------------------------

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run prompts to completion together; one merged RequestOutput per prompt, in order."""
        seqs = [self.add_request(p, params) for p in prompts]
        merged = {s.request_id: RequestOutput(s.request_id, logprobs=[] if (params and params.logprobs) else None)
                  for s in seqs}
        while self.has_unfinished:
            for o in self.step():
                m = merged.get(o.request_id)
                if m is None:
                    continue
                m.token_ids += o.token_ids
                m.text += o.text
                if m.logprobs is not None and o.logprobs:
                    m.logprobs += o.logprobs
                if o.top_logprobs:
                    m.top_logprobs = (m.top_logprobs or []) + o.top_logprobs
                if o.finished:
                    m.finished, m.finish_reason, m.metrics = True, o.finish_reason, o.metrics
                    m.stop_sequence = o.stop_sequence
        return [merged[s.request_id] for s in seqs]

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_blocks_used=bm.num_used_blocks,
            num_blocks_total=bm.num_blocks,
            num_blocks_cached=bm.num_cached_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_tokens_generated=self.num_tokens_generated,
            num_draft_proposed=self.num_draft_proposed,
            num_draft_accepted=self.num_draft_accepted,
            num_disk_cached_tokens=self.num_disk_cached_tokens,
            num_runner_seqs=getattr(self.runner, "num_active_slots", 0),
            threads_decode=self.threads.current("decode") if self.threads else 0,
            threads_prefill=self.threads.current("prefill") if self.threads else 0,
            threads_max=self.threads.max_threads if self.threads else 0,
            threads_adaptive=bool(self.threads and self.threads.adaptive),
        )

    def close(self) -> None:
        """Finish the prefix store's queued writes, then free the model."""
        if self.prefix_store is not None:
            self.prefix_store.close()
            self.prefix_store = None
        if self._mask_thread is not None:
            self._mask_thread.shutdown()
            self._mask_thread = None
        self.runner.close()


class AsyncEngine:
    """LLMEngine in a background thread. Each request is an async stream of RequestOutputs;
    ``abort`` may be called from any thread, and leaving a stream early aborts its request."""

    def __init__(self, engine: LLMEngine, step_lock=None):
        self.engine = engine
        # Held around each step when given (benchmarks/model_swap.py measures two models' engines
        # taking turns under one lock: slower than each stepping freely, which `serve` does).
        self._step_lock = step_lock if step_lock is not None else contextlib.nullcontext()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._next_id = 0
        self._id_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="localllm-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        if self._stopped:
            raise LocalLLMError("the engine has shut down; start it again")
        if request_id is None:
            with self._id_lock:
                self._next_id += 1
                request_id = f"req-{self._next_id}"
        elif request_id in self._streams:
            raise UsageError(f"request id {request_id!r} is already in use; give each request its own id")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._send(("add", request_id, prompt, params))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def call(self, fn):
        """Run ``fn(engine)`` on the engine thread; returns a concurrent Future."""
        fut: Future = Future()
        self._send(("call", fn, fut))
        return fut

    async def check_grammar(self, grammar: str) -> None:
        """LLMEngine.check_grammar, on a worker thread: the engine steps on meanwhile."""
        await asyncio.to_thread(self.engine.check_grammar, grammar)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # the caller's loop has closed
                pass

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                _, request_id, prompt, params = command
                try:
                    self.engine.add_request(prompt, params, request_id)
                except Exception as e:  # the caller gets its own error; nothing else is disturbed
                    self._deliver(request_id, e)
            elif kind == "abort":
                out = self.engine.abort(command[1])
                if out is not None:
                    self._deliver(out.request_id, out)
            elif kind == "call":
                _, fn, fut = command
                if not fut.set_running_or_notify_cancel():
                    continue  # the caller gave up waiting (its asyncio wrapper was cancelled)
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:
                    fut.set_exception(e)

    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()  # before draining: a command sent after this sets it again
            self._drain_commands()
            if not self.engine.has_unfinished:
                self._wake.wait(0.5)
                continue
            try:
                with self._step_lock:
                    outputs = self.engine.step()
            except Exception as e:
                outputs = self.engine.fail_all(str(e))
                for o in outputs:
                    self._deliver(o.request_id, e)
                continue
            for o in outputs:
                self._deliver(o.request_id, o)
        # Shutting down: in-flight streams end with an error, not a hang.
        for o in self.engine.fail_all("the engine shut down"):
            self._deliver(o.request_id, LocalLLMError("the engine shut down before the request finished"))


class _StoredPrefixes:
    """The BlockManager's PrefixSource: entries of the on-disk prefix store, loaded by the runner."""

    def __init__(self, store, runner):
        self.store = store
        self.runner = runner
        self._found: tuple[int, object] | None = None  # (seq id, Found) of the latest find

    def find(self, seq: Sequence, hashes: list[bytes], limit: int) -> int:
        found = self.store.find(seq.token_ids, hashes, limit)
        self._found = (seq.seq_id, found) if found is not None else None
        return found.num_tokens if found is not None else 0

    def load(self, seq: Sequence, num_tokens: int) -> bool:
        latest, self._found = self._found, None
        if latest is None or latest[0] != seq.seq_id:
            return False
        found = latest[1]
        payload = self.store.read(found, seq.token_ids)
        if payload is None:
            return False
        status = self.runner.import_kv(seq, payload, num_tokens)
        if status == "refused":
            self.store.reject(found, f"the {self.runner.name} runner did not accept its KV bytes")
        return status == "ok"


def _can_draft(params: SamplingParams) -> bool:
    """Drafts can be checked for requests whose every row's distribution is known from the
    logits alone: none of the penalties that depend on the tokens before it, no logprobs. A
    logit bias is the same at every position and Sampler.verify applies it to every row."""
    return (params.repetition_penalty == 1.0 and params.frequency_penalty == 0
            and params.presence_penalty == 0 and not params.logprobs)
