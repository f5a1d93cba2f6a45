"""Prediction bands, two kinds.

- Replicates: the same workload simulated N times with call times drawn from measured noise
  (sim.executors.NoisyExecutor), each replicate seeded, and each metric's 5th, 50th and 95th
  percentile over them. A replicate draws one run-wide memory bandwidth from the machine's
  stamp history (calibration.noise.RunNoise: the slow drift of a shared host between runs) and a
  residual per call; a profile without a history draws a calibration round's factor instead,
  which holds only the noise of the calibration's minutes.
- Leave-one-row-out (split conformal): a row's deterministic prediction times the 5th and 95th
  percentiles of real/simulated over the real runs of every *other* row of a validation. Whatever
  moves real runs away from the simulation on this machine (drift, the simulator's own error) is
  in them, and they are as wide as that needs and no wider.

A real run inside a band is as the simulator expects; validate counts how often that holds (coverage)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from calibration.noise import RunNoise
from calibration.physical import AnyCostModel
from engine.core.config import SchedulerConfig
from engine.core.request import Request
from sim.executors import NoisyExecutor
from sim.simulator import SimResult, simulate

# a replicate's calls with their own measured noise and no run-wide draw: beside a deterministic run,
# which has no noise and so its tail percentiles at its medians, the median of such replicates
# (validate's sim_calls_noise, simulate's bands.calls_noise)
CALLS_ONLY = RunNoise((), (0.0,), "the calls' own noise")

# metric name → how to read it from a metrics dict (engine.observe.metrics.summarize's keys)
BAND_METRICS: dict[str, Callable[[dict], float]] = {
    "output_throughput": lambda m: m["output_throughput_tok_s"],
    "ttft_p50": lambda m: m["ttft_s"]["p50"],
    "ttft_p99": lambda m: m["ttft_s"]["p99"],
    "tpot_p50": lambda m: m["tpot_s"]["p50"],
    "tpot_p99": lambda m: m["tpot_s"]["p99"],
    "e2e_p50": lambda m: m["e2el_s"]["p50"],
    "e2e_p99": lambda m: m["e2el_s"]["p99"],
}


def check_counts(bands) -> None:
    """The apps' ``bands`` settings: counts of runs, 0 for none (a negative one ran none, silently)."""
    for name in ("replicates", "calls_noise"):
        value = getattr(bands, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"bands.{name} must be an integer >= 0 (0: none), got {value!r}")


def replicates(make_requests: Callable[[], Iterable[Request]], config: SchedulerConfig, cost: AnyCostModel, n: int,
               seed: int = 0, concurrency: int | None = None, run_noise: RunNoise | None = None,
               **options) -> list[SimResult]:
    """``n`` simulations of fresh requests from ``make_requests``; replicate i draws with seed
    ``seed + i``, so the same arguments give the same runs. ``run_noise``: where the run-wide
    draw comes from (default: the profile's, calibration.noise.RunNoise.of_profile)."""
    return [simulate(make_requests(), config, lambda i=i: NoisyExecutor(cost, seed + i, run_noise),
                     concurrency=concurrency, **options) for i in range(n)]


def prediction_ranks(n: int, level: float = 0.90) -> tuple[int, int]:
    """0-based ranks (lo, hi) of the sorted n draws whose span holds one more draw of the same kind
    with probability ≥ ``level``: rank ⌈(n+1)(1+level)/2⌉ from below and its mirror (the
    finite-sample correction; (hi − lo)/(n + 1) is the chance). Plain 5th/95th percentiles of 20
    draws hold a new one only 81% of the time. Below 19 draws no ranks reach 90%: the extremes."""
    hi = min(n, math.ceil((n + 1) * (1 + level) / 2)) - 1
    return n - 1 - hi, hi


def band(values: Sequence[float], level: float = 0.90) -> dict[str, float]:
    """{"p5", "p50", "p95"}: the ends of the ``level`` prediction band of ``values`` (the order
    statistics of ``prediction_ranks``; named for the 5th and 95th percentiles they stand for)
    and their median."""
    v = np.sort(np.asarray(values, dtype=float))
    lo, hi = prediction_ranks(len(v), level)
    return {"p5": float(v[lo]), "p50": float(np.median(v)), "p95": float(v[hi])}


def bands(metrics: Sequence[dict], readers: Mapping[str, Callable[[dict], float]] = BAND_METRICS
          ) -> dict[str, dict[str, float]]:
    """Each metric's band over the replicates' metrics dicts."""
    return {name: band([float(read(m)) for m in metrics]) for name, read in readers.items()}


def inside(value: float, b: Mapping[str, float]) -> bool:
    """Whether ``value`` lies in the band [p5, p95] (ends included)."""
    return b["p5"] <= value <= b["p95"]


def width(b: Mapping[str, float]) -> float:
    """The band's width relative to its median: (p95 − p5) / p50."""
    return (b["p95"] - b["p5"]) / b["p50"] if b["p50"] else float("nan")


def conformal_band(prediction: float, other_ratios: Sequence[float], level: float = 0.90) -> dict[str, float]:
    """{"p5", "p50", "p95"}: ``prediction`` scaled by the order statistics of the other rows'
    real/simulated ratios that bound a ``level`` share of them with the split-conformal
    finite-sample correction (rank ⌈(n+1)(1+level)/2⌉ from below, its mirror from above)."""
    r = np.sort(np.log(np.asarray(other_ratios, dtype=float)))
    n = len(r)
    if n < 2:
        raise ValueError("a conformal band needs the real runs of at least two other comparisons")
    lo, hi = prediction_ranks(n, level)
    return {"p5": prediction * math.exp(r[lo]), "p50": prediction * math.exp(float(np.median(r))),
            "p95": prediction * math.exp(r[hi])}
