"""Every runner runs a step on the thread count the engine gives it (engine/threads.py chooses
it; here a scripted chooser gives it), and the count does not change the answer."""

from __future__ import annotations

import os
import threading

import pytest

from localllm.engine.request import SamplingParams

PROMPT = "def fibonacci(n):\n    " + "# compute the n-th Fibonacci number iteratively, with a loop\n    " * 6


class Scripted:
    """A chooser that gives the counts of a script, one per step, and keeps nothing."""

    adaptive = True

    def __init__(self, counts, max_threads):
        self.counts = list(counts)
        self.max_threads = max_threads
        self.given = []

    def pick(self, kind, num_tokens):
        n = self.counts[len(self.given) % len(self.counts)]
        self.given.append(n)
        return n

    def record(self, *args):
        pass

    def current(self, kind):
        return self.given[-1] if self.given else self.max_threads


def cpu_by_thread() -> dict[int, int]:
    """CPU ticks (user + system) of each thread of this process, from /proc/self/task."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        ticks[int(tid)] = int(fields[11]) + int(fields[12])
    return ticks


def run_with(engine, counts):
    """Generate with a script of counts; returns the answer, per step (count given, count the
    runner reports while it runs the step), and the threads other than this one that used the
    CPU meanwhile (ticks of 10 ms; None without /proc)."""
    scripted = Scripted(counts, 2)
    engine.threads = scripted
    seen = []
    execute = engine.runner.execute

    def watched(out):
        logits = execute(out)
        seen.append((scripted.given[-1], engine.runner.threads))
        return logits

    engine.runner.execute = watched
    before = cpu_by_thread() if os.path.isdir("/proc/self/task") else None
    try:
        out = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, logprobs=True))[0]
    finally:
        del engine.runner.execute
    others = None
    if before is not None:
        after, me = cpu_by_thread(), threading.get_native_id()
        others = {tid: t - before.get(tid, 0) for tid, t in after.items() if tid != me and t > before.get(tid, 0)}
    return out, seen, others


@pytest.mark.parametrize("runner", ["llamacpp", "torch"])
def test_a_runner_runs_each_step_on_the_count_it_is_given(engines, qwen_path, runner):
    engine = engines.get(qwen_path, runner)
    chooser = engine.threads
    try:
        check_counts_applied(engine, runner)
    finally:
        engine.threads = chooser


def check_counts_applied(engine, runner):
    two, seen_two, others_two = run_with(engine, [2])
    engine.reset()
    one, seen_one, others_one = run_with(engine, [1])
    assert set(seen_two) == {(2, 2)} and set(seen_one) == {(1, 1)}
    if others_one is not None:
        # On 2 threads a second thread computes beside this one (the prompt's step alone is
        # tens of ms); on 1 none does (a tick or two of a worker ending its wait aside).
        assert sum(others_two.values()) >= 3, others_two
        assert sum(others_one.values()) <= 2, others_one
    engine.reset()
    mixed, seen_mixed, _ = run_with(engine, [2, 1, 2, 2, 1])
    assert all(given == used for given, used in seen_mixed), seen_mixed
    assert {used for _, used in seen_mixed} == {1, 2}
    if runner == "llamacpp":
        from localllm.runners.llamacpp import L

        assert (L.llama_n_threads(engine.runner.ctx), L.llama_n_threads_batch(engine.runner.ctx)) == (seen_mixed[-1][1],) * 2
    elif engine.runner.native:
        import torch

        from localllm.runners.torch import native

        # The native layers computed the steps: the count is their pool's, and torch's own
        # stays at one (its idle OpenMP workers would spin beside the pool).
        assert native.threads() == seen_mixed[-1][1] and torch.get_num_threads() == 1
    # The count changes how a step is shared out, not what it computes.
    assert mixed.token_ids == one.token_ids == two.token_ids
    assert mixed.logprobs == pytest.approx(one.logprobs, abs=1e-4)
