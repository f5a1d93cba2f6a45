"""What a profile keeps about the noise of the calls it timed, so predictions can carry bands.

Two parts, both as natural-log ratios (a call that took 10% longer is log 1.1):
- ``round_log``: per measuring round, the median over shapes of log(time / that shape's typical
  time): how the whole machine moved during the calibration (memory spells, neighbours). A run
  drawn with one of these is uniformly faster or slower, as a real run in a spell is.
- ``call_log``: every timed call (grid repeats and the engine's own calls) against the fitted
  prediction, less its round's factor: the fit's error on that shape plus the call's own jitter.
And per shape its spread (min–max over median, and the coefficient of variation).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np


def round_factors(times: Sequence[Sequence[float]], typical: Sequence[float], rounds: int) -> list[float]:
    """log factor of each of the first ``rounds`` repeats, the median over shapes."""
    out = []
    for r in range(rounds):
        logs = [math.log(t[r] / m) for t, m in zip(times, typical) if len(t) > r and m > 0 and t[r] > 0]
        if logs:
            out.append(float(statistics.median(logs)))
    return out


def noise_report(times: Sequence[Sequence[float]], typical: Sequence[float], predicted: Sequence[float],
                 kinds: Sequence[str], rounds: int, contended: Sequence[Sequence[bool]] = ()) -> dict:
    """The profile's ``noise`` entry. ``times[i]`` are shape i's timed calls in round order
    (engine calls: one each, ``kinds[i] == "engine"``), ``typical[i]`` the statistic the fit used,
    ``predicted[i]`` the fitted prediction; the first ``rounds`` repeats of grid shapes are rounds.
    Calls still contended after their retries (``contended[i][r]``) stay out of ``call_log``: a
    real run that others disturbed is flagged and run again, so the band is for undisturbed runs."""
    grid = [i for i, k in enumerate(kinds) if k != "engine"]
    factors = round_factors([times[i] for i in grid], [typical[i] for i in grid], rounds)
    calls: list[float] = []
    for i, ts in enumerate(times):
        flags = contended[i] if i < len(contended) else ()
        for r, t in enumerate(ts):
            if t <= 0 or predicted[i] <= 0 or (r < len(flags) and flags[r]):
                continue
            shift = factors[r] if kinds[i] != "engine" and r < len(factors) else 0.0
            calls.append(math.log(t / predicted[i]) - shift)
    spreads = [(max(times[i]) - min(times[i])) / statistics.median(times[i]) for i in grid]
    cvs = [float(np.std(times[i]) / np.mean(times[i])) for i in grid if len(times[i]) > 1]
    return {"round_log": factors, "call_log": [round(x, 5) for x in calls],
            "call_log_p5_p50_p95": [float(x) for x in np.percentile(calls, [5, 50, 95])] if calls else [],
            "shape_spread": {"median": float(np.median(spreads)) if spreads else 0.0,
                             "p90": float(np.percentile(spreads, 90)) if spreads else 0.0,
                             "max": float(max(spreads, default=0.0))},
            "shape_cv_median": float(np.median(cvs)) if cvs else 0.0}
