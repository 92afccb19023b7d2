"""How often the screen follows a stream. Every paint of a growing Markdown answer costs the
UI thread CPU time, and on a laptop's few cores that time comes out of the model's decode
speed. The pacer keeps the UI's share of one core near a budget: when paints get dear (a
long code block re-highlighted each time), it paints less often; when they are cheap, more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MIN_INTERVAL_S = 0.1  # 10 paints a second at most: smooth to the eye
MAX_INTERVAL_S = 1.0  # never leave the screen more than a second behind
CPU_BUDGET = 0.08  # share of one core the UI may use while a local model streams


@dataclass
class PaintPacer:
    budget: float = CPU_BUDGET
    interval: float = MIN_INTERVAL_S
    _cpu: float = field(default_factory=time.thread_time)
    _wall: float = field(default_factory=time.perf_counter)

    def next_interval(self, cpu: float | None = None, wall: float | None = None) -> float:
        """After a paint: the delay before the next one, from the UI thread's CPU time since
        the previous call (``cpu`` and ``wall`` for tests; the real clocks otherwise)."""
        cpu = time.thread_time() if cpu is None else cpu
        wall = time.perf_counter() if wall is None else wall
        elapsed = wall - self._wall
        if elapsed > 0:
            share = (cpu - self._cpu) / elapsed
            if share > self.budget:
                self.interval = min(MAX_INTERVAL_S, self.interval * min(share / self.budget, 2.0))
            elif share < self.budget / 2:
                self.interval = max(MIN_INTERVAL_S, self.interval / 1.5)
        self._cpu, self._wall = cpu, wall
        return self.interval
