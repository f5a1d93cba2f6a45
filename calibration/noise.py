"""What a profile keeps about the noise of the calls it timed, so predictions can carry bands.

Two parts, both as natural-log ratios (a call that took 10% longer is log 1.1):
- ``round_log``: per measuring round, the median over shapes of log(time / that shape's typical
  time): how the whole machine moved during the calibration (memory spells, neighbours). A run
  drawn with one of these is uniformly faster or slower, as a real run in a spell is.
- ``call_log``: every timed call (grid repeats and the engine's own calls) against the fitted
  prediction, less its round's factor: the fit's error on that shape plus the call's own jitter.
- ``call_lag1``: the correlation of one grid call's ``call_log`` entry with the next call's, in
  the order they were timed, over the base rounds (``call_lag1_pairs`` pairs; shapes in a fresh
  random order each round, so it is the machine's, not a shape's): a shared host's spells last longer than a call, so a slow call is followed by slow
  calls. A replicate draws its calls' residuals as a process with this correlation
  (sim.executors.NoisyExecutor): drawn independently, a request's decode steps averaged the noise
  away and the simulated TPOT p99 sat at its p50 (docs/architecture.md).
And over the grid shapes, their spread (min–max over median of the undisturbed repeats: what the
calibration report prints beside its errors) and coefficient of variation.
- ``memory_gb_s_history``: read-bandwidth stamps of this machine over a longer time than the
  calibration's minutes (its own stamps and calibration.bandwidth_history's per-machine file):
  the slow, run-level component a replicate draws from (RunNoise). Older profiles lack it and
  draw a round factor instead. ``memory_gb_s_history_from_calls`` marks the entries that are a
  validate run's calls' bandwidth (calls_gb_s) rather than a probe's stamp: a replicate drawing
  one of those centres its residuals (sim.executors.NoisyExecutor).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def _per_shape(rounds: int | Sequence[int], num_shapes: int) -> list[int]:
    return [rounds] * num_shapes if isinstance(rounds, int) else list(rounds)


def round_factors(times: Sequence[Sequence[float]], typical: Sequence[float],
                  rounds: int | Sequence[int]) -> list[float]:
    """log factor of each round, the median over the shapes timed in it: a shape's first
    ``rounds`` repeats (or ``rounds[i]``, per shape, where a time budget gave some fewer) are rounds,
    the rest extra rounds."""
    per_shape = _per_shape(rounds, len(times))
    out = []
    for r in range(max(per_shape, default=0)):
        logs = [math.log(t[r] / m) for t, m, k in zip(times, typical, per_shape)
                if k > r and len(t) > r and m > 0 and t[r] > 0]
        if logs:
            out.append(float(statistics.median(logs)))
    return out


def _flags(contended: Sequence[Sequence[bool]], i: int, n: int) -> list[bool]:
    """Shape i's contended flag for each of its ``n`` calls (callers may pass fewer flags, or none)."""
    given = list(contended[i][:n]) if i < len(contended) else []
    return given + [False] * (n - len(given))


def noise_report(times: Sequence[Sequence[float]], typical: Sequence[float], predicted: Sequence[float],
                 kinds: Sequence[str], rounds: int | Sequence[int], contended: Sequence[Sequence[bool]] = (),
                 order: Sequence[int] = ()) -> dict:
    """The profile's ``noise`` entry. ``times[i]`` are shape i's timed calls in round order
    (engine calls: one each, ``kinds[i] == "engine"``), ``typical[i]`` the statistic the fit used,
    ``predicted[i]`` the fitted prediction; the first ``rounds`` (or ``rounds[i]``) repeats of
    grid shapes are rounds.
    Calls still contended after their retries (``contended[i][r]``) stay out of ``call_log``: a
    real run that others disturbed is flagged and run again, so the band is for undisturbed runs.
    ``order``: the shape index of every grid call in the order it was timed
    (calibration.profiler.MeasureLog.order), for ``call_lag1``."""
    per_shape = _per_shape(rounds, len(times))
    grid = [i for i, k in enumerate(kinds) if k != "engine"]
    factors = round_factors([times[i] for i in grid], [typical[i] for i in grid], [per_shape[i] for i in grid])
    flags = [_flags(contended, i, len(ts)) for i, ts in enumerate(times)]
    calls: list[float] = []
    residual: list[list[float | None]] = []  # per shape, per call: its call_log entry (None: left out)
    for i, ts in enumerate(times):
        residual.append([])
        for r, (t, disturbed) in enumerate(zip(ts, flags[i])):
            if t <= 0 or predicted[i] <= 0 or disturbed:
                residual[i].append(None)
                continue
            shift = factors[r] if kinds[i] != "engine" and r < min(len(factors), per_shape[i]) else 0.0
            calls.append(math.log(t / predicted[i]) - shift)
            # call_lag1 over the base rounds: each a fresh random order, its factor taken out (the
            # extra rounds run shortest first, with none)
            residual[i].append(calls[-1] if r < per_shape[i] else None)
    spreads = []  # over each grid shape's undisturbed repeats, as the fit takes them
    for i in grid:
        clean = [t for t, disturbed in zip(times[i], flags[i]) if not disturbed]
        if len(clean) > 1:
            spreads.append((max(clean) - min(clean)) / statistics.median(clean))
    cvs = [float(np.std(times[i]) / np.mean(times[i])) for i in grid if len(times[i]) > 1]
    rho, pairs = lag1(residual, order)
    return {"round_log": factors, "call_log": [round(x, 5) for x in calls], "call_lag1": rho, "call_lag1_pairs": pairs,
            "call_log_p5_p50_p95": [float(x) for x in np.percentile(calls, [5, 50, 95])] if calls else [],
            "shape_spread": {"median": float(np.median(spreads)) if spreads else 0.0,
                             "p90": float(np.percentile(spreads, 90)) if spreads else 0.0,
                             "max": float(max(spreads, default=0.0))},
            "shape_cv_median": float(np.median(cvs)) if cvs else 0.0}


def lag1(residual: Sequence[Sequence[float | None]], order: Sequence[int]) -> tuple[float, int]:
    """The correlation of each call's residual with the next call's, in time order, and over how
    many pairs: ``order`` names the shape of every call kept, shape i's k-th entry being
    ``residual[i][k]`` (None: left out, which breaks the pairs it is in). (0.0, 0) where the order
    does not account for every call or too few pairs were left."""
    seen = [0] * len(residual)
    for i in order:
        if not 0 <= i < len(residual):
            return 0.0, 0
        seen[i] += 1
    if not order or any(n != len(residual[i]) for i, n in enumerate(seen) if n):
        return 0.0, 0
    taken = [0] * len(residual)
    sequence: list[float | None] = []
    for i in order:
        sequence.append(residual[i][taken[i]])
        taken[i] += 1
    pairs = [(a, b) for a, b in zip(sequence, sequence[1:]) if a is not None and b is not None]
    if len(pairs) < 10:
        return 0.0, 0
    x, y = np.asarray(pairs).T
    if x.std() == 0 or y.std() == 0:
        return 0.0, 0
    return float(np.corrcoef(x, y)[0, 1]), len(pairs)


def calibration_stamps(profile: dict) -> list[float]:
    """The memory stamps a calibration took (before, after, and between its rounds): every
    profile with a ``memory_read_gb_s`` entry has the first two; its ``rounds`` (profiles before
    58d5a4f kept them only as ``grid.round_stamps_gb_s``) the rest."""
    stamp = profile.get("memory_read_gb_s") or {}
    out = [stamp[k] for k in ("before", "after") if stamp.get(k)]
    rounds = stamp.get("rounds", (profile.get("grid") or {}).get("round_stamps_gb_s", ()))
    return out + [float(x) for x in rounds or () if x > 0]


@dataclass(frozen=True)
class RunNoise:
    """A replicate's slow, run-wide component of the noise.

    A real run on a shared host sits in one memory spell for its whole length, and the calls'
    per-call residuals average out over hundreds of calls, so the run-to-run spread comes from
    the spell. With ``memory_gb_s`` (read-bandwidth stamps: what this machine was measured to give
    over a longer time than one calibration) a replicate draws one stamp and the simulator prices
    its calls at it through the physical model's memory-bound terms (sim.executors.NoisyExecutor).
    Without stamps (profiles from before the history) it draws one calibration round's factor
    from ``round_log``, as before."""

    memory_gb_s: tuple[float, ...] = ()
    round_log: tuple[float, ...] = (0.0,)
    source: str = "calibration rounds"
    # which of memory_gb_s are a bandwidth some run's calls saw (calls_gb_s: the calls' total is
    # the run's there, so it holds their mean residual) rather than a probe's stamp, which holds
    # none (NoisyExecutor centres the residuals on the former only); () none of them
    from_calls: tuple[bool, ...] = ()

    def seen_by_calls(self, i: int) -> bool:
        """Whether draw ``i`` of ``memory_gb_s`` is a bandwidth a run's calls saw."""
        return i < len(self.from_calls) and self.from_calls[i]

    @classmethod
    def of_profile(cls, profile: dict) -> RunNoise:
        """What a profile (or a cost model's ``info``) gives: its bandwidth history, else its rounds."""
        noise = profile.get("noise") or {}
        rounds = tuple(noise.get("round_log") or (0.0,))
        # profiles from before the flags: every entry a stamp
        history, flags = _positive(noise.get("memory_gb_s_history") or (),
                                   noise.get("memory_gb_s_history_from_calls") or ())
        if history:
            return cls(history, rounds, noise.get("memory_gb_s_history_source") or "the profile's bandwidth history",
                       flags)
        return cls((), rounds, f"{len(rounds)} calibration rounds")

    def with_stamps(self, stamps: Sequence[float], source: str, from_calls: Sequence[bool] = ()) -> RunNoise:
        """The same with more bandwidths drawn from (``source`` says whence, for the log and
        validation.csv; ``from_calls``: which of them a run's calls saw, none where not given)."""
        extra, extra_flags = _positive(stamps, from_calls)
        mine = _positive(self.memory_gb_s, self.from_calls)[1]
        return RunNoise(self.memory_gb_s + extra, self.round_log,
                        f"{self.source} + {source}" if self.memory_gb_s else source, mine + extra_flags)

    def describe(self) -> str:
        """One line for the log and validation.csv's ``band_source``."""
        if not self.memory_gb_s:
            return f"round factor from {self.source}"
        return (f"bandwidth from {len(self.memory_gb_s)} stamps, {min(self.memory_gb_s):.0f}–"
                f"{max(self.memory_gb_s):.0f} GB/s ({self.source})")


def _positive(values: Sequence[float], flags: Sequence[bool]) -> tuple[tuple[float, ...], tuple[bool, ...]]:
    """The positive values (others are no measurement) and each one's flag, False where ``flags``
    is shorter."""
    padded = list(flags) + [False] * (len(values) - len(flags))
    kept = [(float(x), bool(f)) for x, f in zip(values, padded) if x > 0]
    return tuple(x for x, _ in kept), tuple(f for _, f in kept)


def calls_gb_s(physical, calls: Sequence[tuple[object, float]], low: float = 1.0, high: float = 1e4) -> float | None:
    """The read bandwidth a run's calls saw, on the physical cost model's scale: the ``b`` at
    which ``physical`` (calibration.physical.PhysicalCostModel) priced at ``b`` predicts the
    run's whole model time (Σ predicted = Σ measured). ``calls``: (plan, seconds). The total, not
    the median call: within one run on a busy host the calls spread 0.75–1.8× their prediction,
    with the long tail, so the bandwidth that fits the median call prices the run faster than it
    ran (on a Zen 5's default validation matrix, throughput 1.9% median / 8.3% worst off against
    0.8% / 8.2% with the total; README's validation section).
    A stamp is a 0.1 s probe before and after a run; this is the whole run as the calls felt it,
    the machine's slow component measured where it matters. None when no bandwidth in
    [low, high] fits (calls all compute-bound, or none)."""
    return _total_fit(lambda b: physical.with_machine(memory_gb_s=b), [(p, t) for p, t in calls if t > 0], low, high)


# the fewest calls either group of calls_machine's is fitted from: a run's handful of prefills
# would otherwise set its matmul rate from one or two calls' jitter
MIN_GROUP_CALLS = 8


def calls_machine(physical, calls: Sequence[tuple[object, float]]) -> tuple[float | None, float | None]:
    """(read GB/s, matmul GFLOP/s) a run's calls saw: the bandwidth at which its memory-bound calls'
    total is priced right and the matmul rate at which its compute-bound calls' is (a call is
    compute-bound where, priced on the calibration's machine, more of its time goes away with
    unlimited arithmetic than with unlimited bandwidth). ``calls_gb_s`` moves the bandwidth only,
    so a spell of the CPU itself (a neighbour's turn on the core, another clock) stays in the
    prefills, and with it in each request's TTFT (docs/architecture.md has the figures). With
    fewer than MIN_GROUP_CALLS calls in either group, or a group no limit in range prices:
    ``calls_gb_s`` over every call and no matmul rate (None: the calibration's)."""
    calls = [(p, t) for p, t in calls if t > 0]
    memory_part = _lifted(physical, calls, memory_gb_s=1e12)
    compute_part = _lifted(physical, calls, matmul_gflops=1e12)
    compute = [c for c, m, f in zip(calls, memory_part, compute_part) if f > m]
    memory = [c for c, m, f in zip(calls, memory_part, compute_part) if f <= m]
    if len(compute) < MIN_GROUP_CALLS or len(memory) < MIN_GROUP_CALLS:
        return calls_gb_s(physical, calls), None
    gflops = physical.machine.matmul_gflops
    for _ in range(20):  # each group moves mostly with its own limit: a few turns settle both
        gb_s = _total_fit(lambda b, f=gflops: physical.with_machine(memory_gb_s=b, matmul_gflops=f), memory, 1.0, 1e4)
        fitted = None if gb_s is None else _total_fit(
            lambda f, b=gb_s: physical.with_machine(memory_gb_s=b, matmul_gflops=f), compute, 1.0, 1e6)
        if fitted is None:  # a group no limit in range prices: the bandwidth alone, as calls_gb_s
            return calls_gb_s(physical, calls), None
        settled = abs(math.log(fitted / gflops)) < 1e-3
        gflops = fitted
        if settled:  # the bandwidth was fitted at this rate, to the bisection's 0.1%
            break
    return gb_s, gflops


def _lifted(physical, calls: Sequence[tuple[object, float]], **unlimited: float) -> list[float]:
    """Each call's predicted seconds that go away when one limit (``memory_gb_s`` or
    ``matmul_gflops``) is lifted to ``unlimited``'s value."""
    lifted = physical.with_machine(**unlimited)
    return [physical.predict(p) - lifted.predict(p) for p, _ in calls]


def _total_fit(priced_at, calls: Sequence[tuple[object, float]], low: float, high: float) -> float | None:
    """The limit ``x`` in [low, high] at which the cost model ``priced_at(x)`` predicts the calls'
    measured total (bisection in log x, to 0.1%: the prediction falls as x rises); None where no
    such x is in range, or there are no calls."""
    if not calls:
        return None
    measured = math.fsum(t for _, t in calls)

    def gap(log_x: float) -> float:
        at = priced_at(math.exp(log_x))
        return math.log(measured / math.fsum(at.predict(p) for p, _ in calls))

    lo, hi = math.log(low), math.log(high)
    if gap(lo) > 0 or gap(hi) < 0:
        return None
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return math.exp((lo + hi) / 2)
