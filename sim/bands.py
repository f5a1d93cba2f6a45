"""Prediction bands: the same workload simulated N times with call times drawn from the profile's
measured noise (sim.executors.NoisyExecutor), each replicate seeded, and each metric's 5th, 50th
and 95th percentile over the replicates. A real run inside the 5–95 band is as the simulator
expects; validate counts how often that holds (coverage)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from calibration.cost_model import CostModel
from engine.core.config import SchedulerConfig
from engine.core.request import Request
from sim.executors import NoisyExecutor
from sim.simulator import SimResult, simulate

BAND_PERCENTILES = (5.0, 50.0, 95.0)

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


def replicates(make_requests: Callable[[], Iterable[Request]], config: SchedulerConfig, cost: CostModel, n: int,
               seed: int = 0, concurrency: int | None = None, **options) -> list[SimResult]:
    """``n`` simulations of fresh requests from ``make_requests``; replicate i draws with seed
    ``seed + i``, so the same arguments give the same runs."""
    return [simulate(make_requests(), config, lambda i=i: NoisyExecutor(cost, seed + i), concurrency=concurrency,
                     **options) for i in range(n)]


def band(values: Sequence[float]) -> dict[str, float]:
    """{"p5", "p50", "p95"} of ``values``."""
    lo, mid, hi = np.percentile(np.asarray(values, dtype=float), BAND_PERCENTILES)
    return {"p5": float(lo), "p50": float(mid), "p95": float(hi)}


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
