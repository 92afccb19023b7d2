"""native/pool.c: every part of a call runs once, whichever thread claims it, and a thread held
off its core holds back no part it has not claimed. No model needed."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from localllm.runners.torch import native  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available(), reason="localllm._native was not built here")

TASK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)


def pool_run(fn, parts: int, threads: int) -> None:
    lib = native.library()
    lib.lm_pool_run.restype = None
    lib.lm_pool_run.argtypes = [TASK, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.lm_pool_run(TASK(fn), None, parts, threads)


def parts_of(lib_units: int, threads: int) -> int:
    lib = native.library()
    lib.lm_pool_parts.restype = ctypes.c_int
    lib.lm_pool_parts.argtypes = [ctypes.c_int, ctypes.c_int]
    return lib.lm_pool_parts(lib_units, threads)


@pytest.mark.parametrize("parts,threads", [(1, 1), (7, 1), (7, 2), (50, 3), (3, 8)])
def test_every_part_runs_once_and_the_caller_takes_part(parts, threads):
    ran = []
    lock = threading.Lock()

    def part(arg, i, n):
        with lock:
            ran.append((i, n, threading.get_native_id()))

    for _ in range(20):  # calls one after another: each one's parts, none of another's
        ran.clear()
        pool_run(part, parts, threads)
        assert sorted(i for i, _, _ in ran) == list(range(parts))
        assert {n for _, n, _ in ran} == {parts}
        assert len({tid for _, _, tid in ran}) <= min(parts, threads)
    if threads == 1:
        assert {tid for _, _, tid in ran} == {threading.get_native_id()}


def test_a_worker_held_up_holds_back_only_the_part_it_claimed():
    """A worker that stops for a while inside its first part (as one descheduled behind another
    program): the caller does every other part, and the call ends only when that part is done."""
    me = threading.get_native_id()
    done, lock = [], threading.Lock()
    held = []

    def part(arg, i, n):
        if threading.get_native_id() != me and not held:
            held.append(i)
            time.sleep(0.3)
        with lock:
            done.append((i, threading.get_native_id()))

    for _ in range(3):
        done.clear()
        held.clear()
        pool_run(part, 40, 2)
        assert sorted(i for i, _ in done) == list(range(40))  # every part, the held one too, before the return
        by_workers = [i for i, tid in done if tid != me]
        assert by_workers == held  # the held worker claimed nothing more; the caller did the rest
        assert len(held) <= 1


def test_parts_are_a_few_a_thread_and_never_more_than_the_work():
    assert parts_of(112, 1) == 1
    assert parts_of(112, 2) == 8
    assert parts_of(5, 2) == 5
    assert parts_of(1, 8) == 1
    assert parts_of(10**6, 64) == 256
