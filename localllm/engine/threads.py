"""ThreadChooser: how many CPU threads each engine step runs on, chosen from what steps cost now.

A laptop is never idle. When another program holds a core, a step that runs on every core
waits for the thread the scheduler put aside: llama.cpp's workers spin at each barrier for the
slowest of them, and on a 2-core machine with one busy process beside it decode ran 5 times
slower on 2 threads than on 1 (docs/benchmarks.md, "A busy machine"). No fixed count is
right: on an idle machine every physical core is fastest, on a busy one fewer are.

So the engine times its own steps and moves. Decode and prefill are judged apart (decode is
bound by memory, prefill by compute, and their best counts differ; ``step_kind``), each an
``_Arm`` holding the count in use and, per count and step size (a power-of-two bucket of
tokens, as the drafter's StepCost keeps them), the recent seconds a step took. A prefill
step's time grows with its tokens (compute), so within its bucket it is compared as if it had
the bucket's most tokens: a 146-token step and a 256-token one are the same load, not a 75 %
drift. Now and then the arm runs a step on a neighbouring count, a *probe*: if that count is
faster by ``DRIFT`` on that step, or by ``MARGIN`` on it and on a second one, it becomes the
count in use. A probe is compared with the count in use's recent time; where that is older than
``STALE`` (the load may have moved since: a prompt a minute after the last), with the next
step of its size on the count in use (within ``MATCH_WITHIN``; none coming, with that older
time after all); the probe's second step, if it needs one, with that same step.

Probes come

- soon, when the arm's steps got markedly slower or faster than at its last decision (load
  came or went: ``DRIFT``): fewer threads at once when its own steps got slower (long prompt
  steps on one thread already: two); otherwise, and for the other kind of step, once the last
  probe of that count (or the move away from it) is paid for (or ``FLOOR_UNSEEN`` passed,
  where idle CPUs are unknown);
- soon, upward, when CPUs sat idle while the arm runs on fewer than it may (load went; read
  from /proc/stat where the system has it);
- soon, the same way, when the other kind of step moved;
- first after ``FIRST_STEPS`` steps (the load may be there from the start; for prefill, whose
  steps are long, once the work done pays for a probe), then on a timer
  per count that doubles after each probe that lost, up to ``MAX_GAP``, and is never shorter
  than keeps what lost probes cost under ``COST_SHARE`` of the time.

Timers run on the engine's working time (the seconds its steps took), not the wall clock: an
engine that waited a minute for a request owes no probe for that minute.

Fewer threads can only win where others want the CPUs. So where the system tells what the
CPUs did (/proc/stat, less this process's own CPU time), a probe of fewer threads waits until
other programs used ``OTHERS_BUSY`` of a CPU or more since the last reading, or another engine
of this process (a second model behind the same port) stepped within ``OTHER_ENGINE``: on an idle
machine a step's time wanders with the host (a shared machine's decode steps between 25 and 55
ms), and each such drift would otherwise bring a probe of one thread, twice a step's time, and
a long prompt's probe a second. Where nothing tells (no /proc), it probes as said above. A fixed
count (``--threads N``) turns all of it off.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

KINDS = ("decode", "prefill")
MARGIN = 0.06  # a probed count this much faster on two steps is moved to
DRIFT = 0.3  # ... or this much faster on one; and the arm's step time moved this far: probe now
FIRST_STEPS = 4  # steps on the count in use before a neighbour is first tried
MIN_GAP = 0.5  # seconds of work: the first wait before probing a count again
MAX_GAP = 30.0  # seconds of work: the longest wait between timer probes of one count
COST_SHARE = 0.02  # lost probes may cost this share of the working time, at most
STALE = 2.0  # seconds (wall clock): an older step time is replaced by a new one, and not compared with
MATCH_WITHIN = 60.0  # seconds (wall clock): a probe step waits this long for a fresh step of its size to compare with
ALPHA = 0.3  # weight of a new step in a count's recent step time
SPARE_CPUS = 0.75  # idle CPUs beyond this, with room above the count in use: probe upward
SPARE_EVERY = 0.5  # seconds (wall clock) between reads of the CPUs' idle time
FLOOR_UNSEEN = 10.0  # seconds of work: the longest a lost probe holds off faster steps' probes without idle-CPU readings
OTHERS_BUSY = 0.5  # CPUs other programs used: below it, fewer threads are not probed
OTHER_ENGINE = 2.0  # seconds (wall clock): another engine of this process that stepped this recently is load

# Each move, at debug level (`LOCALLLM_LOG=debug localllm serve ...`): why the count changed.
log = logging.getLogger("localllm.threads")


SHORT_PROMPT = 64  # tokens: a prompt step of at most this many is judged with the decode steps


def step_kind(decode_only: bool, num_tokens: int) -> str:
    """The arm that judges a step: "decode" for decode steps, and for prompt steps of at most
    SHORT_PROMPT tokens; "prefill" for longer ones.

    Where a core is taken, a step on more threads pays a wait at each of its barriers (the
    same for every size of step) and gains in proportion to its tokens: with two busy
    processes on the 2-core EPYC, a 142-token prompt ran faster on 2 threads and decode on 1.
    A chat turn's or a cached prompt's short tail is a decode step's kind; one count for it
    and the long prompts did neither well (docs/benchmarks.md, "A busy machine").
    """
    return "decode" if decode_only or num_tokens <= SHORT_PROMPT else "prefill"


def bucket(num_tokens: int) -> int:
    """0 for 1 token, 1 for 2, 2 for 3-4, 3 for 5-8, ...: ceil(log2(num_tokens))."""
    return (max(1, num_tokens) - 1).bit_length()


@dataclass
class _Probe:
    count: int
    ratios: list[float] = field(default_factory=list)  # probe step time / the count in use's
    extra: float = 0.0  # seconds the probe's steps took beyond what the count in use would have
    unmatched: tuple[int, float, float] | None = None  # (bucket, seconds, when) of a step awaiting a fresh time to compare
    # (bucket, seconds): the count in use's step that its first step waited for, the base of
    # its second, however old (prompts a minute apart: each probe step has its own reference)
    fresh: tuple[int, float] | None = None


@dataclass
class _Arm:
    kind: str
    current: int
    recent: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # (count, bucket) -> (s, when)
    ref: dict[int, float] = field(default_factory=dict)  # bucket -> the current count's step time at the last decision
    gap: dict[int, float] = field(default_factory=dict)  # count -> seconds of work before it is probed again
    # count -> before this (work clock), faster steps do not bring a probe of it, idle CPUs do:
    # what its last probe lost, paid for at COST_SHARE (on a busy machine the step times of
    # the count in use wander, and a probe of more threads there can cost a second a step)
    floor: dict[int, float] = field(default_factory=dict)
    # count -> before this (work clock), the other kind's drifts do not bring a probe of it:
    # the count the last move left, until the work that the move won pays for
    held: dict[int, float] = field(default_factory=dict)
    due: dict[int, float] = field(default_factory=dict)  # count -> when (work clock) it may be probed next
    probe: _Probe | None = None
    last_probe: float = float("-inf")  # work clock
    steps: int = 0  # steps on the count in use since it became the count in use
    num_probes: int = 0
    num_moves: int = 0


class ThreadChooser:
    """Decides the thread count of each step. The engine asks ``pick(kind, num_tokens)``
    before a step and tells ``record(kind, threads, num_tokens, seconds)`` after it.

    max_threads: the most it uses (the physical cores); fixed: a count to keep (``--threads``),
    or None to adapt. clock, spare_cpus and others_busy are the outside world, replaceable in
    tests: spare_cpus() returns how many CPUs sat idle since its last call, others_busy() how
    many CPUs other programs used since its last call; either None where unknown. Given
    spare_cpus alone, others_busy is unknown.
    """

    def __init__(self, max_threads: int, fixed: int | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 spare_cpus: Callable[[], float | None] | None = None,
                 others_busy: Callable[[], float | None] | None = None):
        if max_threads < 1:
            raise ValueError(f"max_threads {max_threads} must be at least 1")
        self.max_threads = max_threads
        self.fixed = fixed
        self.clock = clock
        self._cpu_use: CpuUse | None = None
        if spare_cpus is None and others_busy is None:
            use = self._cpu_use = CpuUse()
            spare_cpus, others_busy = use.idle, use.others
            use.others()  # the first reading: the first check reads from here on
        self.spare_cpus = spare_cpus if spare_cpus is not None else (lambda: None)
        self.others_busy = others_busy if others_busy is not None else (lambda: None)
        self._others: float | None = None  # the last reading of others_busy
        self._others_checked = float("-inf")
        self._arms = {kind: _Arm(kind, current=fixed or max_threads) for kind in KINDS}
        self._work = 0.0  # seconds the recorded steps took, all kinds: the timers' clock
        self._spare_checked = float("-inf")
        self._spare_known = False  # whether idle CPUs have been read here

    @property
    def adaptive(self) -> bool:
        return self.fixed is None

    def current(self, kind: str) -> int:
        """The count steps of this kind run on now (probes aside)."""
        return self._arms[kind].current

    def counters(self, kind: str) -> tuple[int, int]:
        """(probes run, moves made) of one kind of step."""
        arm = self._arms[kind]
        return arm.num_probes, arm.num_moves

    # -- before a step ---------------------------------------------------------------------

    def pick(self, kind: str, num_tokens: int) -> int:
        arm = self._arms[kind]
        if self.fixed is not None:
            return self.fixed
        if arm.probe is not None:
            # A probe's second step; or, its step waiting for a fresh time, the count in use.
            return arm.current if arm.probe.unmatched else arm.probe.count
        work = self._work
        if (arm.current, bucket(num_tokens)) not in arm.recent or work - arm.last_probe < MIN_GAP / 2:
            return arm.current  # nothing to compare a probe with, or one just ended
        self._check_spare(arm)
        # A neighbour not tried yet is tried after FIRST_STEPS steps on the count in use (the
        # load may be there from the start); after that, when its timer says (or the load moves).
        # A prefill step can take a second, and a probe can double it: its first probe waits
        # until the work done pays for one; load there from the start shows in the decode
        # steps first, cheap to probe, and a move there brings one at once.
        first = arm.steps >= FIRST_STEPS and (
            kind != "prefill" or work * COST_SHARE >= arm.recent[(arm.current, bucket(num_tokens))][0])
        due = [c for c in (arm.current - 1, arm.current + 1)
               if 1 <= c <= self.max_threads and (work >= arm.due[c] if c in arm.due else first)]
        if due and due[0] < arm.current and (self._machine_ours() or (
                kind == "prefill" and due[0] < self._decode_count())):
            # Fewer threads: not while no other program wants the CPUs, nor for prompts fewer
            # than decode steps run on now (it stays due). Decode waits at a step's every
            # barrier for its few tokens, a prompt's step has many: where decode gains by a
            # count, a long prompt does (busy_machine.py: prompts' best count at or above
            # decode's at every load), and a prompt's probe costs a second.
            due = due[1:]
        if not due:
            return arm.current
        count = min(due, key=lambda c: arm.due.get(c, work))  # the longest overdue first
        arm.probe = _Probe(count)
        arm.last_probe = work
        arm.num_probes += 1
        return count

    def _decode_count(self) -> int:
        """The count decode steps run on, where one ran on it within MATCH_WITHIN (an engine
        that only reads prompts, an embedder's, has none: 1)."""
        arm, now = self._arms["decode"], self.clock()
        lately = any(c == arm.current and now - when <= MATCH_WITHIN for (c, _), (_, when) in arm.recent.items())
        return arm.current if lately else 1

    def _machine_ours(self) -> bool:
        """Whether other programs used less than OTHERS_BUSY of a CPU lately (read at most every
        SPARE_EVERY seconds); False where unknown."""
        now = self.clock()
        if now - self._others_checked >= SPARE_EVERY:
            self._others_checked = now
            self._others = self.others_busy()
        return self._others is not None and self._others < OTHERS_BUSY

    def _check_spare(self, arm: _Arm) -> None:
        """Idle CPUs while the arm runs on fewer than it may: load went; every arm below the
        most probes upward now."""
        now = self.clock()
        if arm.current >= self.max_threads or now - self._spare_checked < SPARE_EVERY:
            return
        self._spare_checked = now
        spare = self.spare_cpus()
        if spare is not None:
            self._spare_known = True
        if spare is not None and spare >= SPARE_CPUS:
            for other in self._arms.values():
                if other.current < self.max_threads:
                    other.due[other.current + 1] = self._work

    # -- after it --------------------------------------------------------------------------

    def record(self, kind: str, threads: int, num_tokens: int, seconds: float) -> None:
        if self.fixed is not None or seconds <= 0:
            return
        if self._cpu_use is not None:
            self._cpu_use.stepped()
        self._work += seconds
        arm = self._arms[kind]
        now = self.clock()
        b = bucket(num_tokens)
        if kind == "prefill":  # compute-bound: as if the step had its bucket's most tokens
            seconds *= (1 << b) / max(1, num_tokens)
        probe = arm.probe
        if probe is not None and threads == probe.count and not probe.unmatched:
            base = arm.recent.get((arm.current, b))
            if probe.fresh is not None and probe.fresh[0] == b and (base is None or now - base[1] > STALE):
                base = (probe.fresh[1], now)
            if base is None or now - base[1] > STALE:
                probe.unmatched = (b, seconds, now)  # compare with the next step of its size on the count in use
            else:
                self._judge(arm, probe, b, seconds, base[0])
            return
        if threads != arm.current:
            return  # a count from before a move
        t = self._remember(arm, threads, b, seconds, now)
        arm.steps += 1
        if probe is not None and probe.unmatched:
            pb, ps, when = probe.unmatched
            if pb == b:
                probe.unmatched = None
                self._judge(arm, probe, b, ps, seconds)
                return
            if now - when > MATCH_WITHIN:
                # No step of its size came in time (steps of other sizes do not tell: a
                # prompt's short head and its long body come in turn): judged against the
                # older time after all, so that what it lost is paid for before the next.
                probe.unmatched = None
                self._judge(arm, probe, pb, ps, arm.recent[(arm.current, pb)][0], last=True)
                return  # (a move clears the references this step would otherwise set)
        ref = arm.ref.get(b)
        if ref is None:
            arm.ref[b] = t
        elif t > ref * (1 + DRIFT) or t < ref * (1 - DRIFT):
            # Load came (slower: try fewer) or went (faster: try more). The other kind of step
            # meets the same machine: it tries the same way at its next step of a timed size.
            # Its own steps slower: fewer threads at once. Faster, or the other kind's steps
            # (a weaker sign: a decode step's time moves with the batch too): once the last
            # loss of that count, and the last move away from it, are paid for.
            # Long prompt steps on one thread already that got slower try two at once: more
            # programs than cores share the CPUs by threads, and a long step's gain from one
            # more outgrows its waits at the barriers (``step_kind``; busy_machine.py: beside
            # one busy process a prompt ran fastest on 1 thread, beside two on 2). What the
            # last probe of two lost was measured on the machine as it was before.
            way = -1 if t > ref else 1
            arm.held.clear()  # its own steps moved: the load the last move was measured under is past
            for other in self._arms.values():
                c = other.current + way
                if other is not arm:
                    other.due[c] = max(self._work, other.floor.get(c, self._work), other.held.get(c, self._work))
                elif way < 0:  # fewer threads at once; a long prompt step on one already: two
                    other.due[c if c >= 1 or kind != "prefill" else other.current + 1] = self._work
                else:
                    other.due[c] = max(self._work, other.floor.get(c, self._work))
            arm.ref[b] = t

    def _remember(self, arm: _Arm, threads: int, b: int, seconds: float, now: float) -> float:
        old = arm.recent.get((threads, b))
        t = seconds if old is None or now - old[1] > STALE else old[0] + ALPHA * (seconds - old[0])
        arm.recent[(threads, b)] = (t, now)
        return t

    def _judge(self, arm: _Arm, probe: _Probe, b: int, seconds: float, base: float, last: bool = False) -> None:
        """A probe step of ``seconds`` against the count in use's ``base``: move, lose, or
        (somewhat faster, and a second step may follow) wait for the second."""
        work = self._work
        probe.ratios.append(seconds / base)
        probe.extra += seconds - base
        if 1 - DRIFT <= probe.ratios[-1] < 1 - MARGIN and len(probe.ratios) < 2 and not last:
            probe.fresh = (b, base)
            return  # somewhat faster: confirm on a second step
        arm.probe = None
        if probe.ratios[-1] < 1 - DRIFT or (len(probe.ratios) == 2 and all(r < 1 - MARGIN for r in probe.ratios)):
            old = arm.current
            arm.current = probe.count
            arm.num_moves += 1
            log.debug("%s steps: %d -> %d threads: its steps of %s took %s of the time on %d",
                      arm.kind, old, probe.count, f"up to {1 << b} tokens" if b else "1 token",
                      " then ".join(f"{r:.2f}" for r in probe.ratios), old)
            arm.steps = 1
            arm.ref.clear()
            arm.recent[(probe.count, b)] = (seconds, self.clock())
            arm.gap.clear()
            # Keep climbing the same way soon; check the count left behind again after the
            # work that the step time just won pays for (a move by a hair is checked soon).
            # Until then the other kind's wandering step times do not bring it back (under
            # load they wander by a third, and a prompt of a second or more a minute apart
            # would be a probe each time); its own steps moving do.
            onward = probe.count + (probe.count - old)
            won = base - seconds
            back = min(MAX_GAP, won / COST_SHARE)
            arm.due = {onward: work + MIN_GAP, old: work + max(4 * MIN_GAP, back)}
            arm.floor.clear()
            arm.held = {old: work + (back if self._spare_known else min(back, FLOOR_UNSEEN))}
            # The other kind of step meets the same machine: it tries the same way (once the
            # last loss of that count is paid for).
            for other in self._arms.values():
                c = other.current + (probe.count - old)
                if other is not arm and 1 <= c <= self.max_threads:
                    other.due[c] = max(work, other.floor.get(c, work))
            return
        if probe.ratios[-1] < 1 - MARGIN:  # faster, but not surely: try again soon
            arm.due[probe.count] = work + MIN_GAP
            return
        # Lost: wait longer before trying this count again, long enough that what losing
        # costs stays a small share of the time.
        paid = max(probe.extra, 0.0) / COST_SHARE
        gap = max(min(2 * arm.gap.get(probe.count, MIN_GAP / 2), MAX_GAP), paid)
        arm.gap[probe.count] = gap
        arm.due[probe.count] = work + gap
        arm.floor[probe.count] = work + (paid if self._spare_known else min(paid, FLOOR_UNSEEN))
        arm.ref[b] = base


_STEPPED: dict[int, float] = {}  # id of a CpuUse -> when (time.monotonic) its engine last stepped


class CpuUse:
    """What the CPUs this process may run on did, from /proc/stat: ``idle()``, the CPUs that sat
    idle since its previous call; ``others()``, the CPUs that programs other than this one kept
    busy since its previous call (their busy time less this process's CPU time), and one more
    while another engine of this process steps (``stepped``: its CPU time is this process's).
    None where there is no /proc/stat, or on a first call."""

    def __init__(self, path: str = "/proc/stat"):
        self.path = path
        try:
            self.cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        except AttributeError:
            self.cpus = None
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last: dict[str, tuple[float, float, float, float]] = {}  # reader -> (idle s, busy s, own s, when)

    def idle(self) -> float | None:
        got = self._since("idle")
        return None if got is None else got[0]

    def others(self) -> float | None:
        got = self._since("others")
        if got is None:
            return None
        now = time.monotonic()
        engines = any(key != id(self) and now - when < OTHER_ENGINE for key, when in _STEPPED.items())
        return max(0.0, got[1] - got[2]) + (1.0 if engines else 0.0)

    def stepped(self) -> None:
        """Its engine stepped now (what the others of this process read)."""
        if id(self) not in _STEPPED:
            weakref.finalize(self, _STEPPED.pop, id(self), None)
        _STEPPED[id(self)] = time.monotonic()

    def _since(self, reader: str) -> tuple[float, float, float] | None:
        """(idle CPUs, busy CPUs, this process's CPUs) on average since this reader's last call."""
        now_read = self._read()
        if now_read is None:
            return None
        last, self._last[reader] = self._last.get(reader), now_read
        if last is None or now_read[3] <= last[3]:
            return None
        wall = now_read[3] - last[3]
        return tuple((now_read[i] - last[i]) / wall for i in range(3))

    def _read(self) -> tuple[float, float, float, float] | None:
        if self.cpus is None:
            return None
        try:
            with open(self.path, "rb") as f:
                lines = f.read().decode().splitlines()
        except OSError:
            self.cpus = None
            return None
        idle = busy = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if name in self.cpus:
                fields = [int(v) for v in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
                idle += fields[3] + fields[4]
                busy += fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
        return idle / self._ticks, busy / self._ticks, time.process_time(), time.monotonic()
