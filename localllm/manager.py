"""ModelManager: which models are loaded, loading them on demand, and unloading them when the
memory is needed or their keep_alive ran out (Ollama's scheduler, server/sched.go, planned by
memory rather than by a count of models).

Every servable model is a ``ModelEntry``; a door asks for one by any of its names::

    async with manager.lease("qwen2.5-coder:0.5b", keep_alive="10m") as model:
        async for out in model.engine.generate(prompt, params): ...

- The lease loads the model if it is not loaded; concurrent leases wait on the same load, never
  a second one. It counts as *in flight* from its start to its exit, and a model with a lease
  in flight is never unloaded under it.
- When a lease exits, the model's idle deadline becomes now + keep_alive (that lease's own,
  else the manager's default): the lease that exits last decides. keep_alive 0 unloads the
  model as its last lease exits; ``FOREVER`` (``math.inf``: any negative keep_alive) never by
  the clock. A reaper task unloads models whose deadline passed (``reap``).
- Before a load, ``need_bytes(entry)`` (weights + KV pool, memory.py's plan) is held against
  ``free_bytes()``. While it does not fit, idle models are unloaded, least recently used first
  (models kept ``FOREVER`` after every timed one). Where only models with leases in flight hold
  the rest, the load waits for one to go idle, ``room_timeout_s`` at most, then ``ModelBusy``.
  Where it could not fit with every unpinned model unloaded: ``ModelTooLarge``, at once.
  ``free_bytes()`` of None (unknown memory): nothing is unloaded for memory.
- Loads, with the room they make, run one at a time, so each plan sees the memory the load
  before it took (``free_bytes`` may be ``budget - manager.loaded_bytes``). A load that raises
  fails the leases waiting on it, with its error; the next lease tries again.
- Pinned models load at ``start()`` and leave only through ``unload(name)`` or ``close()``.
- ``unload(name)`` refuses a model with leases in flight (``ModelBusy``) rather than wait for
  them: a stream may run for minutes, and ``localllm stop`` should answer now.

CPU threads with two models loaded: each engine steps on its own thread with its own
ThreadChooser, which sees the other engine's steps as load and moves to fewer threads (on 2
cores, about one each). Steps taking turns under one lock, each on every core, were measured
slower (docs/benchmarks.md). ``on_change(loaded_entries)`` is called after every load and
unload: the hook for a loader that sets thread counts by what is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError, ModelBusy, ModelNotFound, ModelTooLarge, UsageError

log = logging.getLogger("localllm.manager")

KINDS = ("chat", "completion", "embedding")
FOREVER = math.inf  # a keep_alive that never runs out

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_UNIT = "(ns|us|µs|μs|ms|s|m|h)"  # "ms" before "m": "5ms" is 5 milliseconds
_SECONDS = re.compile(rf"[+-]?{_NUMBER}")
_DURATION = re.compile(rf"([+-]?)((?:{_NUMBER}{_UNIT})+)")  # Go's time.ParseDuration, as Ollama
_PART = re.compile(rf"({_NUMBER}){_UNIT}")


def parse_keep_alive(value: object) -> float:
    """Seconds a model stays loaded after its last request, from Ollama's ``keep_alive``: a
    duration ("5m", "1h30m", "300ms"), a number of seconds (300, 2.5, "300"), 0 (unload right
    after the request), or any negative one ("-1", -1, "-1s"): ``FOREVER``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _bad_keep_alive(value)
    try:
        if not isinstance(value, str):
            seconds = float(value)
        elif _SECONDS.fullmatch(text := value.strip()):
            seconds = float(text)
        elif match := _DURATION.fullmatch(text):
            seconds = sum(float(n) * _UNIT_SECONDS[unit] for n, unit in _PART.findall(match.group(2)))
            seconds = -seconds if match.group(1) == "-" else seconds
        else:
            raise _bad_keep_alive(value)
    except OverflowError:  # an int past float's range
        raise _bad_keep_alive(value) from None
    if not math.isfinite(seconds):
        raise _bad_keep_alive(value)
    if seconds < 0:
        return FOREVER
    return seconds if seconds > 0 else 0.0


def _bad_keep_alive(value: object) -> UsageError:
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return UsageError(f"keep_alive {shown} is not a duration; use one such as \"5m\", \"1h30m\", \"300ms\" "
                      "or a number of seconds (300), 0 to unload the model after the request, or -1 to keep it loaded")


def _gib(n: float) -> str:
    return f"{max(0, n) / 2**30:.2f} GiB"


@dataclass(frozen=True)
class ModelEntry:
    """A servable model. ``names`` is every name that reaches it: ``name`` (what ``localllm ls``
    shows), then the file's stem and the file's name (filled in)."""

    name: str
    path: Path
    kind: str = "chat"  # "chat" | "completion" | "embedding"
    pinned: bool = False
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"model {self.name!r} has kind {self.kind!r}; use one of {', '.join(KINDS)}")
        path = Path(self.path)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "names", tuple(dict.fromkeys((self.name, *self.names, path.stem, path.name))))


@dataclass(frozen=True)
class ModelStatus:
    """One model as ``localllm ps`` and /metrics show it."""

    name: str
    kind: str
    state: str  # "unloaded" | "loading" | "loaded" | "unloading"
    loaded: bool
    pinned: bool
    bytes: int  # need_bytes at its load; 0 when not loaded
    in_flight: int  # leases not yet exited, those waiting for its load included
    idle_s: float | None  # seconds since its last lease exited; None unless loaded and idle
    keep_alive_left_s: float | None  # until the reaper unloads it; None unless that is due (loaded, idle, timed)
    num_loads: int
    num_unloads: int
    last_load_s: float | None
    total_load_s: float


@dataclass(eq=False)
class _Slot:
    entry: ModelEntry
    state: str = "unloaded"
    model: Any = None
    task: asyncio.Task | None = None  # the load or the unload under way
    bytes: int = 0
    in_flight: int = 0
    last_used: float = 0.0
    deadline: float = FOREVER
    num_loads: int = 0
    num_unloads: int = 0
    last_load_s: float | None = None
    total_load_s: float = 0.0

    @property
    def is_idle(self) -> bool:  # loaded, unpinned, no lease: may be unloaded
        return self.state == "loaded" and self.in_flight == 0 and not self.entry.pinned


class ModelManager:
    """See the module docstring. ``load(entry)`` and the model's ``close()`` block and run in
    worker threads; ``need_bytes(entry)`` runs in one too; ``free_bytes()`` is called on the
    event loop and must be cheap."""

    def __init__(self, entries: Sequence[ModelEntry], load: Callable[[ModelEntry], Any],
                 need_bytes: Callable[[ModelEntry], int], free_bytes: Callable[[], int | None],
                 keep_alive_s: float | str = 300.0, clock: Callable[[], float] = time.monotonic,
                 room_timeout_s: float = 60.0, reap_interval_s: float = 1.0,
                 on_change: Callable[[list[ModelEntry]], None] | None = None,
                 on_load: Callable[[ModelEntry, float], None] | None = None):
        self._slots = [_Slot(entry) for entry in entries]
        self._by_name: dict[str, _Slot] = {}
        for slot in self._slots:  # a model's own name wins over another's file name
            if slot.entry.name in self._by_name:
                raise UsageError(f"two models are named {slot.entry.name!r}; remove one (`localllm rm`)")
            self._by_name[slot.entry.name] = slot
        for slot in self._slots:
            for name in slot.entry.names:
                self._by_name.setdefault(name, slot)
        self._load = load
        self._need_bytes = need_bytes
        self._free_bytes = free_bytes
        self.keep_alive_s = parse_keep_alive(keep_alive_s)
        self._clock = clock
        self.room_timeout_s = room_timeout_s
        self.reap_interval_s = reap_interval_s
        self._on_change = on_change
        self._on_load = on_load  # (entry, seconds) after each load: a door's metrics
        self._plan_lock = asyncio.Lock()  # one load (and the room it makes) at a time
        self._changed = asyncio.Event()  # set and replaced on every change (see _notify)
        self._reaper: asyncio.Task | None = None
        self._closed = False

    @property
    def entries(self) -> list[ModelEntry]:
        return [slot.entry for slot in self._slots]

    @property
    def loaded_bytes(self) -> int:
        """need_bytes of every model loaded, loading or unloading."""
        return sum(slot.bytes for slot in self._slots)

    def add(self, entry: ModelEntry) -> ModelEntry:
        """Serve one more model (the chat app adds each file it is asked for); the entry that
        already has ``entry.name``, if one does."""
        if entry.name in self._by_name:
            return self._by_name[entry.name].entry
        slot = _Slot(entry)
        self._slots.append(slot)
        for name in entry.names:
            self._by_name.setdefault(name, slot)
        return entry

    def resolve(self, name: str | None) -> ModelEntry:
        """The entry ``name`` reaches; None: the default (the first pinned, else the first)."""
        return self._slot(name).entry

    async def start(self) -> None:
        """Start the reaper and load the pinned models, in order (a failure raises: close then)."""
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever())
        for slot in self._slots:
            if slot.entry.pinned:
                await self._ready(slot)

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None = None, keep_alive: object = None) -> AsyncIterator[Any]:
        """The loaded model ``name`` reaches, held in flight until the block exits."""
        keep = self.keep_alive_s if keep_alive is None else parse_keep_alive(keep_alive)
        slot = self._slot(name)
        slot.in_flight += 1
        try:
            model = await self._ready(slot)
        except BaseException:
            slot.in_flight -= 1
            self._notify()
            raise
        try:
            yield model
        finally:
            await self._release(slot, keep)

    async def unload(self, name: str) -> bool:
        """Unload ``name`` now; False if it was not loaded (or was already on its way out).
        A model with leases in flight is refused with ``ModelBusy``."""
        slot = self._slot(name)
        while True:
            if slot.in_flight:
                raise ModelBusy(f"{slot.entry.name} has {slot.in_flight} request(s) in flight, so it was not "
                                "unloaded; stop it again once they finish, or send its last request with keep_alive 0")
            if slot.state == "loaded":
                await asyncio.shield(self._begin_unload(slot))
                return True
            if slot.state == "unloaded":
                return False
            with contextlib.suppress(Exception):  # a load that fails leaves nothing to unload
                await asyncio.shield(slot.task)
            if slot.state == "unloaded":
                return False

    async def reap(self) -> list[str]:
        """Unload the idle models whose keep_alive ran out; their names. The reaper calls it."""
        now = self._clock()
        due = [slot for slot in self._slots if slot.is_idle and slot.deadline <= now]
        tasks = [self._begin_unload(slot) for slot in due]
        await asyncio.gather(*(asyncio.shield(task) for task in tasks))
        return [slot.entry.name for slot in due]

    async def close(self) -> None:
        """Stop the reaper, let loads and unloads under way end, then unload every model (in
        flight or not: the server is stopping)."""
        self._closed = True
        self._notify()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        pending = [slot.task for slot in self._slots if slot.task is not None]
        await asyncio.gather(*(asyncio.shield(task) for task in pending), return_exceptions=True)
        tasks = [self._begin_unload(slot) for slot in self._slots if slot.state == "loaded"]
        await asyncio.gather(*(asyncio.shield(task) for task in tasks))

    def loaded_models(self) -> list[Any]:
        """What ``load`` returned for each model loaded now, in the entries' order."""
        return [slot.model for slot in self._slots if slot.state == "loaded"]

    def status(self) -> list[ModelStatus]:
        now = self._clock()
        out = []
        for slot in self._slots:
            idle = slot.state == "loaded" and slot.in_flight == 0
            timed = idle and not slot.entry.pinned and slot.deadline != FOREVER
            out.append(ModelStatus(
                name=slot.entry.name, kind=slot.entry.kind, state=slot.state, loaded=slot.state == "loaded",
                pinned=slot.entry.pinned, bytes=slot.bytes, in_flight=slot.in_flight,
                idle_s=now - slot.last_used if idle else None,
                keep_alive_left_s=max(0.0, slot.deadline - now) if timed else None,
                num_loads=slot.num_loads, num_unloads=slot.num_unloads, last_load_s=slot.last_load_s,
                total_load_s=slot.total_load_s))
        return out

    def _slot(self, name: str | None) -> _Slot:
        if not self._slots:
            raise ModelNotFound("no models are installed; `localllm pull qwen2.5-coder:0.5b` installs one")
        if name is None:
            return next((slot for slot in self._slots if slot.entry.pinned), self._slots[0])
        slot = self._by_name.get(name)
        if slot is None:
            names = ", ".join(s.entry.name for s in self._slots)
            raise ModelNotFound(f"model {name!r} is not installed here; the models are: {names} "
                                "(`localllm ls` lists them, `localllm pull NAME` installs one)")
        return slot

    async def _ready(self, slot: _Slot) -> Any:
        """The slot's model once loaded: joins the load under way, or waits for an unload under
        way and then loads anew."""
        while True:
            if self._closed:
                raise LocalLLMError(f"the server is shutting down; {slot.entry.name} is not served")
            if slot.state == "loaded":
                return slot.model
            if slot.task is None:
                slot.state = "loading"
                slot.task = self._spawn(self._load_slot(slot))
            await asyncio.shield(slot.task)  # a load raises its error here, in every lease waiting on it

    async def _release(self, slot: _Slot, keep: float) -> None:
        slot.in_flight -= 1
        slot.last_used = self._clock()
        slot.deadline = slot.last_used + keep
        unload = self._begin_unload(slot) if keep == 0 and slot.is_idle else None
        self._notify()
        if unload is not None:
            await asyncio.shield(unload)

    async def _load_slot(self, slot: _Slot) -> None:
        entry = slot.entry
        try:
            async with self._plan_lock:
                if self._closed:
                    raise LocalLLMError(f"the server is shutting down; {entry.name} was not loaded")
                need = int(await asyncio.to_thread(self._need_bytes, entry))
                await self._make_room(slot, need)
                slot.bytes = need
                start = self._clock()
                slot.model = await asyncio.to_thread(self._load, entry)
                now = self._clock()
                slot.state = "loaded"
            # A model the loader had loaded already (before the server's loop ran) says how long
            # that took as its ``load_s``.
            seconds = getattr(slot.model, "load_s", None) or now - start
            slot.num_loads += 1
            slot.last_load_s = seconds
            slot.total_load_s += seconds
            slot.last_used, slot.deadline = now, now + self.keep_alive_s
            log.info("loaded %s (%s) in %.2f s", entry.name, _gib(need), seconds)
            if self._on_load is not None:
                try:
                    self._on_load(entry, seconds)
                except Exception:
                    log.exception("the model manager's on_load hook failed")
            self._report_change()
        except BaseException:
            slot.state, slot.bytes = "unloaded", 0
            raise
        finally:
            slot.task = None
            self._notify()

    async def _make_room(self, slot: _Slot, need: int) -> None:
        """Unload idle models, least recently used first, until ``need`` bytes are free."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.room_timeout_s
        while True:
            changed = self._changed
            free = self._free_bytes()
            if free is None or need <= free:
                return
            if self._closed:
                raise LocalLLMError(f"the server is shutting down; {slot.entry.name} was not loaded")
            others = [s for s in self._slots
                      if s is not slot and not s.entry.pinned and s.state in ("loaded", "unloading")]
            if need > free + sum(s.bytes for s in others):
                raise ModelTooLarge(self._too_large(slot, need, free, others))
            idle = [s for s in others if s.is_idle]
            if idle:
                lru = min(idle, key=lambda s: (s.deadline == FOREVER, s.last_used))
                await asyncio.shield(self._begin_unload(lru))
                continue
            unloading = [s for s in others if s.state == "unloading"]
            if unloading:
                await asyncio.shield(unloading[0].task)
                continue
            try:  # only models serving requests hold the rest: wait for one to go idle
                await asyncio.wait_for(changed.wait(), max(0.0, give_up - loop.time()))
            except TimeoutError:
                busy = ", ".join(f"{s.entry.name}: {s.in_flight} in flight" for s in others)
                raise ModelBusy(f"{slot.entry.name} cannot load yet: it needs {_gib(need)} and {_gib(free)} is "
                                f"free, and the models holding the rest ({busy}) stayed busy for "
                                f"{self.room_timeout_s:g} s; retry when they finish, or allow more memory (--memory)"
                                ) from None

    def _too_large(self, slot: _Slot, need: int, free: int, others: list[_Slot]) -> str:
        entry = slot.entry
        unloadable = sum(s.bytes for s in others)
        pinned = sum(s.bytes for s in self._slots if s.entry.pinned and s is not slot)
        advice = ["a smaller quantization of it", "a shorter context (--ctx)"]
        if pinned:
            advice.append(f"fewer pinned models (--model; they hold {_gib(pinned)})")
        return (f"{entry.name} does not fit: it needs {_gib(need)} (weights and KV cache) but at most "
                f"{_gib(free + unloadable)} can be free ({_gib(free)} free now, {_gib(unloadable)} held by "
                f"models that may be unloaded); use {', '.join(advice)}, or more memory (--memory)")

    def _begin_unload(self, slot: _Slot) -> asyncio.Task:
        model, slot.model, slot.state = slot.model, None, "unloading"
        slot.task = self._spawn(self._unload_slot(slot, model))
        return slot.task

    async def _unload_slot(self, slot: _Slot, model: Any) -> None:
        try:
            await asyncio.to_thread(model.close)
        except Exception:  # its memory is as good as gone: nothing else can be done with it
            log.exception("closing %s failed", slot.entry.name)
        finally:
            slot.state, slot.bytes, slot.task = "unloaded", 0, None
            slot.num_unloads += 1
            log.info("unloaded %s", slot.entry.name)
            self._report_change()
            self._notify()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            try:
                await self.reap()
            except Exception:
                log.exception("the model reaper failed")

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        # A load whose every lease was cancelled still ends; its error is then nobody's.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    def _notify(self) -> None:
        """Wake whoever waits for a change; waiters take ``self._changed`` before they look, so
        no change between their look and their wait is missed."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _report_change(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change([slot.entry for slot in self._slots if slot.state == "loaded"])
            except Exception:
                log.exception("the model manager's on_change hook failed")
