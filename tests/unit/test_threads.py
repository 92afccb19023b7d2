"""ThreadChooser's decisions on recorded step times (no model, no clock of the machine).

Each case plays a machine: a function of (kind, threads, time) giving the seconds a step takes,
figures shaped like those measured on a 2-core EPYC (docs/benchmarks.md, "A busy machine"):
idle, decode runs 40 ms a token on 2 threads and 65 ms on 1; with two busy processes beside
it, 2 threads take a second or more (a worker waits for the scheduler) and 1 thread 120 ms.
"""

from __future__ import annotations

import random

import pytest

from localllm.engine.threads import SHORT_PROMPT, ThreadChooser, bucket, step_kind


class Machine:
    """A fake clock that each step advances by its cost, and the CPUs left idle."""

    def __init__(self, cost, spare=lambda t: None):
        self.t = 0.0
        self.cost = cost
        self.spare = spare

    def clock(self) -> float:
        return self.t

    def spare_cpus(self):
        return self.spare(self.t)

    def chooser(self, max_threads: int, fixed: int | None = None) -> ThreadChooser:
        return ThreadChooser(max_threads, fixed, clock=self.clock, spare_cpus=self.spare_cpus)

    def run(self, chooser: ThreadChooser, until: float, kind: str = "decode", num_tokens: int = 1):
        """Steps until the clock reads ``until``; returns [(start time, threads, seconds)]."""
        steps = []
        while self.t < until:
            n = chooser.pick(kind, num_tokens)
            assert 1 <= n <= chooser.max_threads
            seconds = self.cost(kind, n, self.t)
            steps.append((self.t, n, seconds))
            self.t += seconds
            chooser.record(kind, n, num_tokens, seconds)
        return steps


def two_cores(load_from=float("inf"), load_until=float("inf")):
    def cost(kind, n, t):
        busy = load_from <= t < load_until
        return {(False, 1): 0.065, (False, 2): 0.040, (True, 1): 0.120, (True, 2): 1.2}[busy, n]
    return cost


def current_at(steps, t0, t1):
    return {n for t, n, _ in steps if t0 <= t < t1}


def test_bucket_is_ceil_log2():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 256, 257)] == [0, 1, 2, 2, 3, 3, 4, 8, 9]


def test_an_idle_machine_keeps_every_core_and_probes_rarely():
    m = Machine(two_cores())
    c = m.chooser(2)
    steps = m.run(c, until=120.0)
    assert c.current("decode") == 2
    probe_steps = [s for s in steps if s[1] == 1]
    lost = sum(s - 0.040 for _, _, s in probe_steps)
    assert lost / m.t < 0.01, f"probes cost {lost:.2f} s of {m.t:.0f}"
    # The timer backs off: the probes of the last minute are few.
    assert len([s for s in probe_steps if s[0] > 60]) <= 4
    assert c.counters("decode")[1] == 0  # never moved


def test_it_moves_to_fewer_threads_when_load_comes_and_back_when_it_goes():
    # /proc/stat says a CPU sits idle only when the load is gone and the engine runs on one.
    def spare(t):
        return 0.95 if t >= 40 and c.current("decode") == 1 else 0.0

    m = Machine(two_cores(load_from=10, load_until=40), spare)
    c = m.chooser(2)
    steps = m.run(c, until=60.0)
    moved_down = min(t for t, n, _ in steps if t >= 10 and n == 1)
    assert current_at(steps, 15, 40) <= {1, 2}
    at_two = [t for t, n, _ in steps if 13 <= t < 40 and n == 2]
    assert moved_down - 10 < 3.0 and len(at_two) <= 3, (moved_down, at_two)
    back = min(t for t, n, _ in steps if t >= 40 and n == 2)
    assert back - 40 < 2.0
    assert c.current("decode") == 2


def test_each_move_is_logged_at_debug_with_what_the_probe_measured(caplog):
    m = Machine(two_cores(load_from=10))
    c = m.chooser(2)
    with caplog.at_level("DEBUG", logger="localllm.threads"):
        m.run(c, until=20.0)
    moves = [r.getMessage() for r in caplog.records if r.name == "localllm.threads"]
    # one probe step on 1 thread: 0.120 s against 2 threads' recent 0.388 (0.04 s steps, then 1.2 s ones)
    assert moves == ["decode steps: 2 -> 1 threads: its steps of 1 token took 0.31 of the time on 2"]


def test_without_an_idle_cpu_reading_it_returns_when_steps_get_faster():
    m = Machine(two_cores(load_from=5, load_until=30))  # spare_cpus: None (macOS)
    c = m.chooser(2)
    steps = m.run(c, until=50.0)
    assert 1 in current_at(steps, 6, 10)
    assert c.current("decode") == 2
    returned = min(t for t, n, _ in steps if t >= 30 and n == 2)
    assert returned - 30 < 12.0  # the lost probes of 2 threads under load hold it off up to 10 s
    after = [(n, s) for t, n, s in steps if t >= returned]
    assert sum(s for n, s in after if n == 2) / sum(s for _, s in after) > 0.97


def test_under_lasting_load_probing_upward_costs_little():
    m = Machine(two_cores(load_from=0))
    c = m.chooser(2)
    steps = m.run(c, until=300.0)
    assert c.current("decode") == 1
    at_two = sum(s for t, n, s in steps if n == 2 and t > 10)
    assert at_two / 290 < 0.05, f"{at_two:.1f} s of 290 on the slow count"


def test_a_fixed_count_never_moves():
    m = Machine(two_cores(load_from=0))
    c = m.chooser(2, fixed=2)
    steps = m.run(c, until=20.0)
    assert current_at(steps, 0, 20) == {2}
    assert not c.adaptive and c.counters("decode") == (0, 0)


@pytest.mark.parametrize("best", [1, 4, 8])
def test_it_climbs_to_the_best_count_and_never_leaves_the_range(best):
    # Eight cores; steps cost least at `best` threads, more the farther from it.
    m = Machine(lambda kind, n, t: 0.05 * (1 + 0.15 * abs(n - best)))
    c = m.chooser(8)
    steps = m.run(c, until=40.0)
    assert c.current("decode") == best
    assert all(1 <= n <= 8 for _, n, _ in steps)
    late = [n for t, n, _ in steps if t > 20]
    assert late.count(best) / len(late) > 0.97


def test_decode_and_prefill_are_judged_apart():
    # Decode is best on 2 of 4 threads (memory-bound), prefill on all 4 (compute-bound).
    def cost(kind, n, t):
        if kind == "decode":
            return 0.03 * (1 + 0.2 * abs(n - 2))
        return 0.4 * 4 / n

    m = Machine(cost)
    c = m.chooser(4)
    for _ in range(100):  # interleaved as a server sees them: a prompt now and then
        m.run(c, until=m.t + 0.5, kind="decode")
        m.run(c, until=m.t + 0.01, kind="prefill", num_tokens=256)
    assert (c.current("decode"), c.current("prefill")) == (2, 4)


def test_noise_does_not_make_it_wander():
    rng = random.Random(7)
    base = two_cores()
    m = Machine(lambda kind, n, t: base(kind, n, t) * rng.uniform(0.8, 1.25))
    c = m.chooser(2)
    steps = m.run(c, until=120.0)
    at_best = sum(s for t, n, s in steps if n == 2)
    assert at_best / m.t > 0.97
    assert c.current("decode") == 2


def test_steps_of_a_size_never_timed_are_not_probed_against():
    m = Machine(two_cores())
    c = m.chooser(2)
    m.run(c, until=5.0, num_tokens=1)
    # A step of 64 tokens: no time for it on the count in use, so no probe compares with it.
    assert c.pick("decode", 64) == 2


def test_prefill_follows_the_load_that_decode_steps_reveal():
    # A prompt every 3 s between decode steps, as a chat sees them. Load comes at 20 s: a
    # prefill step on 2 threads goes from 0.6 s to 3 s; on 1 from 1.1 s to 1.3 s.
    def cost(kind, n, t):
        busy = t >= 20
        if kind == "prefill":
            return {(False, 1): 1.1, (False, 2): 0.6, (True, 1): 1.3, (True, 2): 3.0}[busy, n]
        return two_cores(load_from=20)(kind, n, t)

    m = Machine(cost)
    c = m.chooser(2)
    prefills = []
    while m.t < 60:
        m.run(c, until=m.t + 2.5, kind="decode")
        prefills += m.run(c, until=m.t + 0.001, kind="prefill", num_tokens=200)
    idle = [n for t, n, _ in prefills if t < 20]
    # No probe of 1 thread while idle: the 3 s of work done by then would not pay for one
    # (the decode steps, cheap to probe, would have shown load).
    assert idle == [2] * len(idle)
    loaded = [n for t, n, _ in prefills if t >= 20]
    # Told by the decode steps, its first prompt under load runs on 1 thread, and the second on
    # 2 to compare with (the time on 2 it had is from before the load); from the third on, 1,
    # bar a check of 2 again half a minute of work later.
    assert sorted(loaded[:2]) == [1, 2] and loaded[2:].count(2) <= 1, loaded
    assert c.current("decode") == c.current("prefill") == 1


def test_on_a_noisy_busy_machine_faster_steps_do_not_keep_bringing_costly_probes():
    # Lasting load, step times wandering by 2x either way (the scheduler's doing), and the
    # CPUs never idle: a probe of 2 threads costs a second, so few are run.
    rng = random.Random(3)
    base = two_cores(load_from=0)
    m = Machine(lambda kind, n, t: base(kind, n, t) * rng.choice([0.5, 1.0, 2.0]), spare=lambda t: 0.0)
    c = m.chooser(2)
    steps = m.run(c, until=300.0)
    assert c.current("decode") == 1
    at_two = sum(s for t, n, s in steps if n == 2 and t > 10)
    assert at_two / 290 < 0.05, f"{at_two:.1f} s of 290 on the slow count"


def test_waiting_for_requests_brings_no_probes():
    # Lasting load; an answer of 3 s every minute. The timers run on working time, so the
    # minute between answers does not make a probe of 2 threads due at each answer's start.
    m = Machine(two_cores(load_from=0), spare=lambda t: 0.0)
    c = m.chooser(2)
    steps = []
    for _ in range(40):
        steps += m.run(c, until=m.t + 3.0)
        m.t += 60.0
    working = sum(s for _, _, s in steps)
    at_two = sum(s for t, n, s in steps if n == 2 and t > 60)
    assert at_two / working < 0.05, f"{at_two:.1f} s of {working:.0f} on the slow count"


def test_a_servers_prompts_of_every_size_bring_few_costly_probes():
    # An idle 2-core machine serving prompts of varied sizes every 3 s or so, as `localllm
    # serve` sees them (a burst of 4 clients: prefill steps of 2, 146, 256 and 185 tokens),
    # between decode steps. A prefill step costs in proportion to its tokens: 4 ms a token on
    # 2 threads, 7.8 on 1 (measured on the 2-vCPU Xeon through `serve`). Within a bucket (146
    # and 256 tokens) its time is no sign of load; and a probe that finds no step of its size
    # to compare with is retried later each time, not at once.
    def cost(kind, n, t, tokens=1):
        if kind == "prefill":
            return tokens * (0.0040 if n == 2 else 0.0078)
        return two_cores()(kind, n, t)

    m = Machine(cost)
    c = m.chooser(2)
    lost = work = 0.0
    for _ in range(30):
        for tokens in (2, 146, 256, 185):
            n = c.pick("prefill", tokens)
            s = cost("prefill", n, m.t, tokens)
            c.record("prefill", n, tokens, s)
            m.t += s
            work += s
            lost += s - cost("prefill", 2, m.t, tokens)
        work += sum(s for _, _, s in m.run(c, until=m.t + 2.0))
        m.t += 1.5  # waiting for the next requests
    assert c.current("prefill") == c.current("decode") == 2
    assert lost / work < 0.02, f"prefill probes cost {lost:.2f} s of {work:.0f}"
    assert c.counters("prefill")[0] <= 5  # 4 here; 8 when a burst's sizes read as load


def test_load_there_from_the_start_moves_prefill_as_soon_as_decode_moves():
    # Busy from the first step: a prefill step takes 3 s on 2 threads, 1.3 s on 1. Its first
    # probe would wait for the work to pay for it (150 s); the decode steps, cheap to probe,
    # find 1 thread within a few seconds, and the prefill steps follow at the next prompt.
    def cost(kind, n, t):
        if kind == "prefill":
            return {1: 1.3, 2: 3.0}[n]
        return two_cores(load_from=0)(kind, n, t)

    m = Machine(cost, spare=lambda t: 0.0)
    c = m.chooser(2)
    prefills = []
    while m.t < 40:
        prefills += m.run(c, until=m.t + 0.001, kind="prefill", num_tokens=200)
        m.run(c, until=m.t + 2.5, kind="decode")
    # The first two prompts come before decode has moved; the third is the probe the move
    # brings; the fourth, on 2 again, gives a fresh time to compare with (the last was 9 s
    # old); from then on, 1 thread (without the hint: 2, until 150 s of work).
    assert [n for _, n, _ in prefills] == [2, 2, 1, 2] + [1] * (len(prefills) - 4), prefills
    assert c.current("decode") == c.current("prefill") == 1


def test_prompts_in_two_steps_of_different_sizes_far_apart_still_move_prefill():
    # One busy process from the start, a prompt a minute: its cached head (8 tokens) and its
    # body (142) are prefill steps of different sizes, in turn. A probe of the body on 1
    # thread waits for the next body on 2 to compare with; the heads between do not tell.
    def cost(kind, n, t, tokens=1):
        if kind == "prefill":
            return tokens * {1: 0.008, 2: 0.017}[n]
        return two_cores(load_from=0)(kind, n, t)

    m = Machine(cost, spare=lambda t: 0.0)
    c = m.chooser(2)
    bodies = []
    for _ in range(12):
        for tokens in (8, 142):
            n = c.pick("prefill", tokens)
            s = cost("prefill", n, m.t, tokens)
            c.record("prefill", n, tokens, s)
            m.t += s
            if tokens == 142:
                bodies.append(n)
        m.run(c, until=m.t + 3.0)
        m.t += 60.0
    # Decode moves within its first answer and brings a probe; the bodies on 1 thread from
    # the fourth prompt on (before this was fixed, every one ran on 2).
    assert bodies == [2, 2, 2] + [1] * 9 and c.current("prefill") == 1, bodies


def test_probes_with_nothing_fresh_to_compare_with_are_still_paid_for():
    # Two busy processes: a prompt's body (142 tokens) takes 1.4 s on 1 thread, 2.6 s on 2.
    # A prompt every 100 s, its cached head and its body with decode steps between (as
    # benchmarks/busy_machine.py runs them): a probe of the body on 2 threads finds no fresh
    # time on 1 to compare with, nor a body within a minute; it is judged against the older
    # time, and what it lost holds off the next probe.
    def cost(kind, n, t, tokens=1):
        if kind == "prefill":
            return tokens * {1: 0.010, 2: 0.018}[n]
        return two_cores(load_from=0)(kind, n, t)

    def prefill(tokens):
        n = c.pick("prefill", tokens)
        s = cost("prefill", n, m.t, tokens)
        c.record("prefill", n, tokens, s)
        m.t += s
        return n

    m = Machine(cost, spare=lambda t: 0.0)
    c = m.chooser(2)
    bodies = []
    for _ in range(30):
        prefill(8)
        m.run(c, until=m.t + 5.0)
        bodies.append(prefill(142))
        m.t += 95.0
    assert c.current("prefill") == 1
    assert bodies.count(2) <= 4, bodies  # 4 here: the first two, and two probes; 6 when unpaid


def prompts(c, m, cost, n, decode_seconds=5.0, gap=25.0, tokens=142, at=None):
    """n prompts of ``tokens`` tokens, each after ``decode_seconds`` of decode and followed by
    ``gap`` seconds of waiting; ``at(i)`` is called before prompt i. Returns the counts."""
    counts = []
    for i in range(n):
        if at is not None:
            at(i)
        m.run(c, until=m.t + decode_seconds)
        k = c.pick("prefill", tokens)
        s = cost("prefill", k, m.t, tokens)
        c.record("prefill", k, tokens, s)
        m.t += s + gap
        counts.append(k)
    return counts


def test_a_count_somewhat_faster_on_prompts_far_apart_is_moved_to():
    # One busy process, then two: a 142-token prompt takes 10 ms a token on 1 thread and 18 on
    # 2, then 24.4 on 1 and 18.5 on 2 (0.76x: faster, but not by DRIFT, so a probe needs a
    # second step). A prompt every 100 s: each probe step waits for the next prompt on the
    # count in use to compare with, and the probe's second step is compared with that one.
    # (Before, each probe ended after its one step, "not surely faster", and the next began
    # anew: the prompts took 1 and 2 threads in turn for as long as the load lasted.)
    per_token = {1: 0.010, 2: 0.018}

    def cost(kind, n, t, tokens=1):
        if kind == "prefill":
            return tokens * per_token[n]
        return two_cores(load_from=0)(kind, n, t)

    def at(i):
        if i == 10:
            per_token.update({1: 0.0244, 2: 0.0185})

    m = Machine(cost, spare=lambda t: 0.0)
    c = m.chooser(2)
    bodies = prompts(c, m, cost, 40, gap=95.0, at=at)
    assert 1 in bodies[:10], bodies
    # (the last ten on 2 but for the timer's check of 1, one prompt in ten at most)
    assert bodies[-10:].count(2) >= 9 and c.current("prefill") == 2, "".join(map(str, bodies))


def test_short_prompt_steps_are_judged_with_decode():
    assert step_kind(True, 1) == step_kind(True, 200) == "decode"  # decode steps, a batch of them
    assert step_kind(False, 18) == step_kind(False, SHORT_PROMPT) == "decode"  # a chat turn's tail
    assert step_kind(False, SHORT_PROMPT + 1) == step_kind(False, 142) == "prefill"


def test_after_a_move_the_other_kinds_wandering_steps_do_not_bring_the_count_left_back():
    # One busy process, then two (as in the case above): prompts move from 1 thread to 2,
    # decode stays on 1. The decode steps' times wander by half every 40 s (the scheduler's
    # doing), a drift that says "load came" to both arms each time. A prompt every 30 s
    # with 5 s of decode before it.
    per_token = {1: 0.010, 2: 0.018}

    def cost(kind, n, t, tokens=1):
        if kind == "prefill":
            return tokens * per_token[n]
        return two_cores(load_from=0)(kind, n, t) * (1.5 if int(t // 40) % 2 else 1.0)

    before = []

    def at(i):
        if i == 10:
            per_token.update({1: 0.0244, 2: 0.0185})
        before.append(c.current("prefill"))

    m = Machine(cost, spare=lambda t: 0.0)
    c = m.chooser(2)
    counts = prompts(c, m, cost, 50, at=at)
    after_move = [n for i, n in enumerate(counts) if i >= 10 and before[i] == 2]
    assert c.current("prefill") == 2 and c.current("decode") == 1
    # The count left behind comes back on the timer, after the work that the move won pays
    # for (about 30 s of work, four prompts here), not at the next drift of the decode
    # steps (before: one of the first four prompts after the move ran on 1 thread).
    assert after_move[:4] == [2, 2, 2, 2], after_move
    assert after_move.count(1) <= len(after_move) // 5 + 1, after_move


def test_prompts_on_one_thread_try_two_as_soon_as_theirs_get_slower():
    # The torch runner's figures on the 2-core EPYC: beside one busy process a 142-token
    # prompt takes 13.9 ms a token on 1 thread and 15.6 on 2; beside two, 22.7 on 1 and 17.0
    # on 2. A prompt every 30 s. Its own steps 60 % slower say the machine changed: 2 threads
    # are tried at the next prompt (what their probes lost beside one busy process says
    # nothing now), and moved to two prompts later.
    per_token = {1: 0.0139, 2: 0.0156}

    def cost(kind, n, t, tokens=1):
        return tokens * per_token[n] if kind == "prefill" else two_cores(load_from=0)(kind, n, t)

    def at(i):
        if i == 10:
            per_token.update({1: 0.0227, 2: 0.0170})

    m = Machine(cost, spare=lambda t: 0.0)
    c = m.chooser(2)
    counts = prompts(c, m, cost, 20, at=at)
    assert counts[8:10] == [1, 1], counts  # beside one busy process: 1 thread
    # The first under the new load on 1 (then found slower), a probe of 2, the count in use
    # to compare it with (a half-minute-old time is not), the probe's second step: moved.
    assert counts[10:14] == [1, 2, 1, 2] and counts[14:18] == [2] * 4, counts  # then the timer's check of 1
    assert c.current("prefill") == 2


def test_prompts_wandering_a_fifth_bring_few_costly_probes():
    # Lasting load, 2 threads 1.8x slower than 1 for prompts, each prompt's time wandering
    # by up to a fifth either way: drifts of a third come now and then, and each brings a
    # probe of 2 (the rule above); the time lost on the slow count stays small (5.6 % here,
    # 3.5-4 % before the rule; by a tenth either way, 3.5 % with it or without).
    rng = random.Random(1)

    def cost(kind, n, t, tokens=1):
        if kind == "prefill":
            return tokens * {1: 0.0139, 2: 0.025}[n] * rng.uniform(0.8, 1.2)
        return two_cores(load_from=0)(kind, n, t)

    m = Machine(cost, spare=lambda t: 0.0)
    c = m.chooser(2)
    steps = []
    orig = c.record
    c.record = lambda kind, n, tokens, s: (steps.append((kind, n, s)), orig(kind, n, tokens, s))
    prompts(c, m, cost, 200)
    at_two = [s for kind, n, s in steps[20:] if kind == "prefill" and n == 2]
    every = [s for kind, n, s in steps[20:] if kind == "prefill"]
    lost = sum(s * (1 - 1 / 1.8) for s in at_two) / sum(every)
    assert c.current("prefill") == 1
    assert lost < 0.07, f"{lost:.3f} of the prompts' time lost on 2 threads ({len(at_two)} of {len(every)})"


def test_with_no_other_program_on_the_cpus_fewer_threads_are_never_probed():
    """A shared host makes an idle machine's step times wander by half and more; where the
    CPUs' use is known and no other program uses them, no drift brings a probe of one thread
    (each costs twice a step, a long prompt's a second)."""
    rng = random.Random(3)
    base = two_cores()

    def cost(kind, n, t):
        return (base("decode", n, t) if kind == "decode" else 0.6 * n ** -0.8) * rng.choice([0.6, 1.0, 1.4])

    m = Machine(cost)
    c = ThreadChooser(2, clock=m.clock, spare_cpus=lambda: 0.0, others_busy=lambda: 0.1)
    steps = m.run(c, until=60.0) + m.run(c, until=120.0, kind="prefill", num_tokens=142)
    assert {n for _, n, _ in steps} == {2}
    assert c.counters("decode") == c.counters("prefill") == (0, 0)


def test_load_other_programs_bring_is_followed_where_the_cpus_use_is_known():
    m = Machine(two_cores(load_from=5, load_until=30))
    others = lambda: 1.0 if 5 <= m.t < 30 else 0.0  # noqa: E731
    c = ThreadChooser(2, clock=m.clock, spare_cpus=lambda: 0.0 if 5 <= m.t < 30 else 1.0, others_busy=others)
    steps = m.run(c, until=60.0)
    assert current_at(steps, 0, 5) == {2}  # idle: not even a probe
    moved_down = min(t for t, n, _ in steps if t >= 5 and n == 1)
    at_two = [t for t, n, _ in steps if 8 <= t < 30 and n == 2]
    assert moved_down - 5 < 3.0 and len(at_two) <= 3, (moved_down, at_two)
    back = min(t for t, n, _ in steps if t >= 30 and n == 2)
    assert back - 30 < 2.0
    assert c.current("decode") == 2


def test_cpu_use_counts_this_process_as_its_own(tmp_path, monkeypatch):
    from localllm.engine import threads

    stat = tmp_path / "stat"
    clock = {"wall": 100.0, "own": 5.0}
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(threads.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(threads.os, "sysconf", lambda name: 100)

    def write(user0, idle0, user1, idle1):
        stat.write_text(f"cpu  {user0 + user1} 0 0 {idle0 + idle1} 0 0 0 0 0 0\n"
                        f"cpu0 {user0} 0 0 {idle0} 0 0 0 0 0 0\n"
                        f"cpu1 {user1} 0 0 {idle1} 0 0 0 0 0 0\ncpu2 999 0 0 999 0 0 0 0 0 0\n")

    write(1000, 1000, 1000, 1000)
    use = threads.CpuUse(str(stat))
    assert (use.idle(), use.others()) == (None, None)  # a first reading
    # Two seconds: cpu0 busy throughout, cpu1 half the time (3 CPU-seconds, 1.5 of them this
    # process's); cpu2 is not this process's to run on.
    clock["wall"] += 2.0
    clock["own"] += 1.5
    write(1200, 1000, 1100, 1100)
    assert use.idle() == pytest.approx(0.5)
    assert use.others() == pytest.approx(0.75)
    # The readers keep their own intervals: a second idle() reads from the first one's end.
    clock["wall"] += 1.0
    write(1300, 1000, 1100, 1200)
    assert use.idle() == pytest.approx(1.0)
    assert use.others() == pytest.approx(1.0)  # cpu0's second, none of it this process's


def test_another_engine_of_this_process_stepping_counts_as_load(tmp_path, monkeypatch):
    """Two models behind one port: each engine's steps are this process's CPU time, not another
    program's, and still load for the other engine."""
    from localllm.engine import threads

    stat = tmp_path / "stat"
    stat.write_text("cpu0 0 0 0 0 0 0 0 0 0 0\n")
    clock = {"wall": 100.0}
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    mine, other = threads.CpuUse(str(stat)), threads.CpuUse(str(stat))
    mine.others()
    clock["wall"] += 1.0
    mine.stepped()
    assert mine.others() == 0.0  # its own steps: not load
    other.stepped()
    clock["wall"] += 1.0
    assert mine.others() == 1.0  # the other engine stepped a second ago
    clock["wall"] += threads.OTHER_ENGINE
    assert mine.others() == 0.0  # and stopped
    gone = id(other)
    del other  # an engine closed: forgotten
    assert gone not in threads._STEPPED and id(mine) in threads._STEPPED


def test_prompts_do_not_probe_fewer_threads_than_decode_runs_on():
    """Decode steps at two threads, fine there; prompts between them wander as a busy machine's
    do: no prompt is spent on one thread. An engine that only reads prompts still probes."""
    rng = random.Random(5)
    base = two_cores()

    def cost(kind, n, t):
        return base(kind, n, t) if kind == "decode" else 0.6 * n ** -0.8 * rng.choice([0.6, 1.0, 1.5])

    m = Machine(cost)
    c = m.chooser(2)
    prompts = []
    while m.t < 300:
        m.run(c, until=m.t + 2.0)
        prompts += m.run(c, until=m.t + 0.01, kind="prefill", num_tokens=142)
    assert {n for _, n, _ in prompts} == {2} and c.counters("prefill") == (0, 0)
    m2 = Machine(cost)
    c2 = m2.chooser(2)
    only = m2.run(c2, until=300.0, kind="prefill", num_tokens=142)
    assert 1 in {n for _, n, _ in only}

