"""localllm.manager: loading on demand, memory-aware unloading, keep_alive, with a fake loader
and fake memory (no model)."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path

import pytest

from localllm.errors import LocalLLMError, ModelBusy, ModelLoadError, ModelNotFound, ModelTooLarge, UsageError
from localllm.manager import FOREVER, ModelEntry, ModelManager, ModelStatus, parse_keep_alive

GiB = 2**30


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeModel:
    def __init__(self, machine: Machine, name: str, number: int):
        self.machine, self.name, self.number = machine, name, number
        self.num_closes = 0

    def close(self) -> None:
        self.machine.close_gate.wait(5)
        self.num_closes += 1
        with self.machine.lock:
            self.machine.closes.append(self.name)


class Machine:
    """The fake loader and memory: model NAME takes sizes[NAME] bytes of ``budget`` (None:
    memory unknown). ``failures[NAME]`` are raised by its next loads, one each."""

    def __init__(self, sizes: dict[str, int], budget: int | None, load_s: float = 0.0,
                 clock: Clock | None = None, load_clock_s: float = 0.0):
        self.sizes, self.budget, self.load_s = sizes, budget, load_s
        self.clock, self.load_clock_s = clock, load_clock_s
        self.loads: list[str] = []
        self.closes: list[str] = []
        self.models: list[FakeModel] = []
        self.failures: dict[str, list[Exception]] = {}
        self.lock = threading.Lock()
        self.close_gate = threading.Event()
        self.close_gate.set()
        self.manager: ModelManager | None = None

    def load(self, entry: ModelEntry) -> FakeModel:
        with self.lock:
            self.loads.append(entry.name)
            number = len(self.loads)
        time.sleep(self.load_s)
        if self.clock is not None:
            self.clock.now += self.load_clock_s
        if self.failures.get(entry.name):
            raise self.failures[entry.name].pop(0)
        model = FakeModel(self, entry.name, number)
        self.models.append(model)
        return model

    def free(self) -> int | None:
        return None if self.budget is None else self.budget - self.manager.loaded_bytes

    def make(self, entries: list[ModelEntry], **kw) -> ModelManager:
        self.manager = ModelManager(entries, self.load, lambda e: self.sizes[e.name], self.free, **kw)
        return self.manager


def entries(*names: str, pinned: tuple[str, ...] = ()) -> list[ModelEntry]:
    return [ModelEntry(name, Path(f"/models/{name}-Q4_K_M.gguf"), pinned=name in pinned) for name in names]


def state(manager: ModelManager) -> dict[str, tuple[str, int]]:
    return {s.name: (s.state, s.in_flight) for s in manager.status()}


async def use(manager: ModelManager, name: str | None, keep_alive=None, hold: float = 0.0) -> FakeModel:
    async with manager.lease(name, keep_alive) as model:
        await asyncio.sleep(hold)
        return model


# --- parse_keep_alive ---------------------------------------------------------------------------

@pytest.mark.parametrize("value, seconds", [
    ("5m", 300.0), ("1h30m", 5400.0), ("10s", 10.0), ("300ms", 0.3), ("2h", 7200.0), ("1.5h", 5400.0),
    (".5s", 0.5), ("1h1m1s", 3661.0), ("0", 0.0), ("0s", 0.0), ("300", 300.0), (" 5m ", 300.0),
    (300, 300.0), (2.5, 2.5), (0, 0.0), (0.0, 0.0), ("-0", 0.0),
    (-1, FOREVER), (-0.5, FOREVER), ("-1", FOREVER), ("-1s", FOREVER), ("-5m", FOREVER),
])
def test_parse_keep_alive(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", [" ", "", "5x", "m5", "5 m", "--1", "5m-3s", "1e309", "1e3", "inf", "nan",
                                   True, False, [], None, {}, math.inf, math.nan, -math.inf, 10**400, "1" * 400])
def test_parse_keep_alive_refuses(value):
    with pytest.raises(UsageError) as e:
        parse_keep_alive(value)
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    assert str(e.value) == (f"keep_alive {shown} is not a duration; use one such as \"5m\", \"1h30m\", \"300ms\" "
                            "or a number of seconds (300), 0 to unload the model after the request, "
                            "or -1 to keep it loaded")


# --- names --------------------------------------------------------------------------------------

def test_entry_names_and_resolution():
    qwen = ModelEntry("qwen2.5-coder:0.5b", Path("/m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    gemma = ModelEntry("gemma", Path("/m/gemma.gguf"), kind="completion", pinned=True)
    assert qwen.names == ("qwen2.5-coder:0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m",
                          "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    assert gemma.names == ("gemma", "gemma.gguf")
    manager = Machine({}, None).make([qwen, gemma])
    assert manager.resolve("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") is qwen
    assert manager.resolve("qwen2.5-coder-0.5b-instruct-q4_k_m") is qwen
    assert manager.resolve(None) is gemma  # the first pinned
    assert Machine({}, None).make(entries("b", "a")).resolve(None).name == "b"  # else the first
    with pytest.raises(ModelNotFound) as e:
        manager.resolve("llama3")
    assert str(e.value) == ("model 'llama3' is not installed here; the models are: qwen2.5-coder:0.5b, gemma "
                            "(`localllm ls` lists them, `localllm pull NAME` installs one)")
    with pytest.raises(ModelNotFound) as e:
        Machine({}, None).make([]).resolve(None)
    assert str(e.value) == "no models are installed; `localllm pull qwen2.5-coder:0.5b` installs one"


def test_a_model_name_wins_over_another_file_stem_and_duplicates_are_refused():
    a = ModelEntry("a", Path("/m/b.gguf"))
    b = ModelEntry("b", Path("/m/x.gguf"))
    assert Machine({}, None).make([a, b]).resolve("b") is b
    with pytest.raises(UsageError, match="two models are named 'a'; remove one"):
        Machine({}, None).make([a, ModelEntry("a", Path("/m/c.gguf"))])
    with pytest.raises(UsageError, match="model 'a' has kind 'vision'; use one of chat, completion, embedding"):
        ModelEntry("a", Path("/m/a.gguf"), kind="vision")


async def test_unknown_name_and_bad_keep_alive_load_nothing():
    machine = Machine({"a": GiB}, 4 * GiB)
    manager = machine.make(entries("a"))
    with pytest.raises(ModelNotFound, match="model 'b' is not installed here; the models are: a "):
        await use(manager, "b")
    with pytest.raises(UsageError, match="keep_alive '5x' is not a duration"):
        await use(manager, "a", keep_alive="5x")
    assert machine.loads == [] and state(manager) == {"a": ("unloaded", 0)}


# --- loading ------------------------------------------------------------------------------------

async def test_eight_concurrent_leases_share_one_load():
    machine = Machine({"a": GiB}, 4 * GiB, load_s=0.05)
    manager = machine.make(entries("a"))
    models = await asyncio.wait_for(asyncio.gather(*(use(manager, "a", hold=0.01) for _ in range(8))), 5)
    assert machine.loads == ["a"]
    assert all(m is machine.models[0] for m in models)
    assert state(manager) == {"a": ("loaded", 0)}
    assert manager.status()[0].num_loads == 1 and manager.loaded_bytes == GiB


async def test_a_failed_load_fails_every_lease_waiting_on_it_and_the_next_lease_loads_again():
    machine = Machine({"a": GiB}, 4 * GiB, load_s=0.05)
    error = ModelLoadError("a-Q4_K_M.gguf is truncated")
    machine.failures["a"] = [error]
    manager = machine.make(entries("a"))
    results = await asyncio.wait_for(asyncio.gather(*(use(manager, "a") for _ in range(3)),
                                                    return_exceptions=True), 5)
    assert all(r is error for r in results)
    assert machine.loads == ["a"]
    (status,) = manager.status()
    assert (status.state, status.in_flight, status.bytes, status.num_loads) == ("unloaded", 0, 0, 0)
    assert manager.loaded_bytes == 0
    model = await use(manager, "a")
    assert machine.loads == ["a", "a"] and model is machine.models[0]
    assert state(manager) == {"a": ("loaded", 0)}


async def test_status_counts_loads_unloads_and_seconds():
    clock = Clock()
    machine = Machine({"a": GiB, "b": 2 * GiB}, 4 * GiB, clock=clock, load_clock_s=2.5)
    manager = machine.make(entries("a", "b", pinned=("b",)), clock=clock)
    async with manager.lease("a") as _:
        busy = manager.status()[0]
    clock.now += 10.0
    a, b = manager.status()
    assert busy == ModelStatus(name="a", kind="chat", state="loaded", loaded=True, pinned=False, bytes=GiB,
                               in_flight=1, idle_s=None, keep_alive_left_s=None, num_loads=1, num_unloads=0,
                               last_load_s=2.5, total_load_s=2.5)
    assert a == ModelStatus(name="a", kind="chat", state="loaded", loaded=True, pinned=False, bytes=GiB,
                            in_flight=0, idle_s=10.0, keep_alive_left_s=290.0, num_loads=1, num_unloads=0,
                            last_load_s=2.5, total_load_s=2.5)
    assert b == ModelStatus(name="b", kind="chat", state="unloaded", loaded=False, pinned=True, bytes=0,
                            in_flight=0, idle_s=None, keep_alive_left_s=None, num_loads=0, num_unloads=0,
                            last_load_s=None, total_load_s=0.0)
    assert await manager.unload("a") is True
    await use(manager, "a")
    a = manager.status()[0]
    assert (a.num_loads, a.num_unloads, a.last_load_s, a.total_load_s) == (2, 1, 2.5, 5.0)


# --- memory -------------------------------------------------------------------------------------

async def test_a_model_that_does_not_fit_unloads_the_least_recently_used():
    clock = Clock()
    machine = Machine({"a": GiB, "b": GiB, "c": GiB}, 5 * GiB // 2)  # two fit, not three
    manager = machine.make(entries("a", "b", "c"), clock=clock)
    for now, name in [(1, "a"), (2, "b"), (3, "a"), (4, "c"), (5, "b")]:
        clock.now = now
        await use(manager, name)
    # c found a (used at 3) and b (at 2) idle: b went; b found a (3) and c (4): a went.
    assert machine.loads == ["a", "b", "c", "b"]
    assert machine.closes == ["b", "a"]
    assert state(manager) == {"a": ("unloaded", 0), "b": ("loaded", 0), "c": ("loaded", 0)}


async def test_models_kept_forever_are_unloaded_for_memory_after_every_timed_one():
    clock = Clock()
    machine = Machine({"a": GiB, "b": GiB, "c": GiB}, 5 * GiB // 2)
    manager = machine.make(entries("a", "b", "c"), clock=clock)
    clock.now = 1
    await use(manager, "a", keep_alive=-1)
    clock.now = 2
    await use(manager, "b")
    await use(manager, "c")
    assert machine.closes == ["b"]
    clock.now = 3
    await use(manager, "b", keep_alive="-1")  # a (forever, used at 1) stays, c (timed, at 2) goes
    assert machine.closes == ["b", "c"]
    clock.now = 4
    await use(manager, "c")  # a and b both forever: the least recently used of them
    assert machine.closes == ["b", "c", "a"]


async def test_a_busy_model_is_never_unloaded_the_next_load_waits_for_it():
    machine = Machine({"a": GiB, "b": GiB}, 3 * GiB // 2)
    manager = machine.make(entries("a", "b"))
    async with manager.lease("a") as a:
        waiting = asyncio.create_task(use(manager, "b"))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        assert machine.closes == [] and machine.loads == ["a"]
        assert state(manager) == {"a": ("loaded", 1), "b": ("loading", 1)}
        assert a.num_closes == 0
    b = await asyncio.wait_for(waiting, 5)
    assert (b.name, machine.loads, machine.closes) == ("b", ["a", "b"], ["a"])
    assert state(manager) == {"a": ("unloaded", 0), "b": ("loaded", 0)}


async def test_a_load_waiting_on_busy_models_times_out_with_the_sizes():
    machine = Machine({"a": GiB, "b": GiB}, 3 * GiB // 2)
    manager = machine.make(entries("a", "b"), room_timeout_s=0.1)
    async with manager.lease("a"), manager.lease("a"):
        started = time.monotonic()
        with pytest.raises(ModelBusy) as e:
            await asyncio.wait_for(use(manager, "b"), 5)
        assert 0.1 <= time.monotonic() - started < 1.0
        assert str(e.value) == ("b cannot load yet: it needs 1.00 GiB and 0.50 GiB is free, and the models holding "
                                "the rest (a: 2 in flight) stayed busy for 0.1 s; retry when they finish, "
                                "or allow more memory (--memory)")
        assert state(manager) == {"a": ("loaded", 2), "b": ("unloaded", 0)}
    assert (await use(manager, "b")).name == "b"
    assert machine.closes == ["a"]


async def test_a_model_that_cannot_fit_fails_at_once_with_what_to_change():
    machine = Machine({"a": GiB, "b": 3 * GiB}, 2 * GiB)
    manager = machine.make(entries("a", "b"), room_timeout_s=30)
    async with manager.lease("a"):  # busy, but even unloaded it would not make room enough
        with pytest.raises(ModelTooLarge) as e:
            await asyncio.wait_for(use(manager, "b"), 1)
    assert str(e.value) == ("b does not fit: it needs 3.00 GiB (weights and KV cache) but at most 2.00 GiB can be "
                            "free (1.00 GiB free now, 1.00 GiB held by models that may be unloaded); use a smaller "
                            "quantization of it, a shorter context (--ctx), or more memory (--memory)")
    assert e.value.exit_code == 2 and isinstance(e.value, ModelLoadError)
    assert machine.loads == ["a"] and machine.closes == []


async def test_free_memory_unknown_never_unloads_for_memory():
    machine = Machine({"a": 100 * GiB, "b": 100 * GiB}, None)
    manager = machine.make(entries("a", "b"))
    await use(manager, "a")
    await use(manager, "b")
    assert machine.closes == [] and state(manager) == {"a": ("loaded", 0), "b": ("loaded", 0)}


# --- keep_alive ---------------------------------------------------------------------------------

async def test_keep_alive_0_unloads_when_the_last_lease_exits():
    machine = Machine({"a": GiB}, 4 * GiB)
    manager = machine.make(entries("a"), clock=Clock())
    await use(manager, "a", keep_alive=0)
    assert machine.closes == ["a"] and state(manager) == {"a": ("unloaded", 0)}
    assert manager.status()[0].num_unloads == 1 and manager.loaded_bytes == 0
    # Two leases: the one that exits last decides.
    async with manager.lease("a"):
        await use(manager, "a", keep_alive="0s")
        assert state(manager) == {"a": ("loaded", 1)}
    assert machine.closes == ["a"] and manager.status()[0].keep_alive_left_s == 300.0
    async with manager.lease("a", keep_alive=0):
        await use(manager, "a")
    assert machine.closes == ["a", "a"] and state(manager) == {"a": ("unloaded", 0)}


async def test_keep_alive_runs_out_on_the_clock():
    clock = Clock()
    machine = Machine({"a": GiB, "b": GiB}, 4 * GiB)
    manager = machine.make(entries("a", "b"), clock=clock)
    await use(manager, "a")
    await use(manager, "b", keep_alive="10s")
    clock.now = 9.9
    assert await manager.reap() == []
    clock.now = 10.0
    assert await manager.reap() == ["b"]
    assert machine.closes == ["b"]
    a = manager.status()[0]
    assert (a.idle_s, a.keep_alive_left_s) == (10.0, 290.0)
    clock.now = 300.0
    assert await manager.reap() == ["a"]
    assert state(manager) == {"a": ("unloaded", 0), "b": ("unloaded", 0)}


async def test_the_reaper_task_unloads_expired_models():
    clock = Clock()
    machine = Machine({"a": GiB}, 4 * GiB)
    manager = machine.make(entries("a"), clock=clock, keep_alive_s="1m", reap_interval_s=0.01)
    await manager.start()
    await use(manager, "a")
    clock.now = 59.0
    await asyncio.sleep(0.05)
    assert machine.closes == []
    clock.now = 60.0
    for _ in range(200):
        if machine.closes:
            break
        await asyncio.sleep(0.01)
    assert machine.closes == ["a"]
    await manager.close()


async def test_forever_is_never_unloaded_on_the_clock():
    clock = Clock()
    machine = Machine({"a": GiB}, 4 * GiB)
    manager = machine.make(entries("a"), clock=clock)
    await use(manager, "a", keep_alive="-1s")
    clock.now = 1e9
    assert await manager.reap() == []
    a = manager.status()[0]
    assert (a.state, a.idle_s, a.keep_alive_left_s) == ("loaded", 1e9, None)
    forever = machine.make(entries("a"), clock=clock, keep_alive_s=-1)  # the manager's default
    await use(forever, "a")
    clock.now = 2e9
    assert await forever.reap() == []


async def test_pinned_models_load_at_start_and_stay():
    clock = Clock()
    machine = Machine({"a": GiB, "b": GiB}, 3 * GiB // 2)
    manager = machine.make(entries("b", "a", pinned=("a",)), clock=clock)
    await manager.start()
    assert machine.loads == ["a"] and state(manager) == {"b": ("unloaded", 0), "a": ("loaded", 0)}
    assert (await use(manager, None, keep_alive=0)).name == "a"
    clock.now = 1e9
    assert await manager.reap() == []
    with pytest.raises(ModelTooLarge) as e:
        await use(manager, "b")
    assert str(e.value) == ("b does not fit: it needs 1.00 GiB (weights and KV cache) but at most 0.50 GiB can be "
                            "free (0.50 GiB free now, 0.00 GiB held by models that may be unloaded); use a smaller "
                            "quantization of it, a shorter context (--ctx), fewer pinned models (--model; they hold "
                            "1.00 GiB), or more memory (--memory)")
    assert machine.closes == [] and state(manager)["a"] == ("loaded", 0)
    await manager.close()
    assert machine.closes == ["a"]


# --- unload and close ---------------------------------------------------------------------------

async def test_unload_by_name():
    machine = Machine({"a": GiB, "b": GiB}, 4 * GiB)
    manager = machine.make(entries("a", "b"))
    await use(manager, "a")
    assert await manager.unload("a-Q4_K_M") is True
    assert await manager.unload("a") is False
    assert await manager.unload("b") is False
    async with manager.lease("b"):
        with pytest.raises(ModelBusy) as e:
            await manager.unload("b")
    assert str(e.value) == ("b has 1 request(s) in flight, so it was not unloaded; stop it again once they finish, "
                            "or send its last request with keep_alive 0")
    assert machine.closes == ["a"] and state(manager) == {"a": ("unloaded", 0), "b": ("loaded", 0)}


async def test_a_lease_during_an_unload_waits_for_it_then_loads_anew():
    machine = Machine({"a": GiB}, 4 * GiB)
    manager = machine.make(entries("a"))
    machine.close_gate.clear()
    try:
        first = asyncio.create_task(use(manager, "a", keep_alive=0))
        for _ in range(200):
            if state(manager)["a"][0] == "unloading":
                break
            await asyncio.sleep(0.005)
        second = asyncio.create_task(use(manager, "a"))
        await asyncio.sleep(0.05)
        assert not second.done() and machine.loads == ["a"] and state(manager) == {"a": ("unloading", 1)}
    finally:
        machine.close_gate.set()
    old, new = await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert (old.number, new.number, machine.loads, machine.closes) == (1, 2, ["a", "a"], ["a"])
    assert state(manager) == {"a": ("loaded", 0)}


async def test_close_closes_every_loaded_model_once():
    machine = Machine({"a": GiB, "b": GiB, "c": GiB}, 4 * GiB)
    manager = machine.make(entries("a", "b", "c", pinned=("a",)))
    await manager.start()
    reaper = manager._reaper
    async with manager.lease("b"):
        await manager.close()
        assert sorted(machine.closes) == ["a", "b"]
    assert [m.num_closes for m in machine.models] == [1, 1]
    assert reaper.done() and state(manager) == {"a": ("unloaded", 0), "b": ("unloaded", 0), "c": ("unloaded", 0)}
    with pytest.raises(LocalLLMError, match="^the server is shutting down; c is not served$"):
        await use(manager, "c")
    await manager.close()
    assert sorted(machine.closes) == ["a", "b"] and machine.loads == ["a", "b"]


async def test_close_waits_for_a_load_under_way_and_closes_it():
    machine = Machine({"a": GiB}, 4 * GiB, load_s=0.1)
    manager = machine.make(entries("a"))
    lease = asyncio.create_task(use(manager, "a"))
    await asyncio.sleep(0.02)
    await manager.close()
    assert machine.loads == ["a"] and machine.closes == ["a"]
    with pytest.raises(LocalLLMError, match="the server is shutting down; a is not served"):
        await lease


async def test_on_change_hears_every_load_and_unload():
    heard: list[list[str]] = []
    machine = Machine({"a": GiB, "b": GiB}, 3 * GiB // 2)
    machine.make(entries("a", "b"))
    manager = ModelManager(entries("a", "b"), machine.load, lambda e: machine.sizes[e.name], machine.free,
                           on_change=lambda loaded: heard.append([e.name for e in loaded]))
    machine.manager = manager
    await use(manager, "a")
    await use(manager, "b", keep_alive=0)
    assert heard == [["a"], [], ["b"], []]


def test_every_load_is_reported_with_its_seconds_and_a_model_loaded_before_says_its_own():
    clock, reported = Clock(), []
    machine = Machine({"a": GiB, "b": GiB}, None)

    def load(entry: ModelEntry) -> FakeModel:
        clock.now += 2.5
        model = FakeModel(machine, entry.name, 0)
        if entry.name == "b":
            model.load_s = 7.0  # loaded before the manager took it (serve's pinned models)
        return model

    manager = ModelManager(entries("a", "b"), load, lambda e: GiB, lambda: None, clock=clock,
                           on_load=lambda e, s: reported.append((e.name, s)))

    async def main():
        for name in ("a", "b", "a"):
            async with manager.lease(name, keep_alive=0):
                pass
        await manager.close()

    asyncio.run(main())
    assert reported == [("a", 2.5), ("b", 7.0), ("a", 2.5)]
    assert [(s.name, s.num_loads, s.total_load_s) for s in manager.status()] == [("a", 2, 5.0), ("b", 1, 7.0)]
