"""Did someone else use the CPU while we timed a call? Four sessions share two cores here.

Other processes' CPU time during an interval = the machine's busy time (/proc/stat, steal
included) minus this process's own CPU time. A call timed while others ran is not this
shape's cost; the profiler measures it again, the benchmark leaves it out of its median.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_STAT = Path("/proc/stat")
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
CONTENDED_SHARE = 0.15  # others' CPU, in cores, averaged over the call
MIN_INTERVAL_S = 0.05  # /proc/stat counts in 10 ms ticks: shorter calls cannot be judged


def _busy_s() -> float | None:
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _HZ


def _own_s() -> float:
    t = os.times()
    return t.user + t.system


class Interval:
    """``with Interval() as iv: ...`` then ``iv.others_cores``: other processes' mean CPU use."""

    def __enter__(self) -> Interval:
        self._busy, self._own, self._wall = _busy_s(), _own_s(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = self.wall_s = time.perf_counter() - self._wall
        busy = _busy_s()
        if busy is None or self._busy is None or wall <= 0:
            self.others_cores = 0.0
        else:
            self.others_cores = max(0.0, (busy - self._busy) - (_own_s() - self._own)) / wall

    @property
    def contended(self) -> bool:
        return self.wall_s >= MIN_INTERVAL_S and self.others_cores > CONTENDED_SHARE
