"""The highest arrival rate a configuration serves within its SLOs, by bisection over simulated runs.

Each probe simulates the same workload (same seed, so the same lengths and the same unit-rate
arrival pattern stretched to the probed rate) and checks p99 TTFT and p99 TPOT. Meeting the SLOs
is assumed monotone in the rate, which holds on average; the search reports every probe so a
non-monotone region is visible.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine.observe.workload import WorkloadConfig


@dataclass(frozen=True)
class Probe:
    rate: float
    ttft_p99_s: float
    tpot_p99_s: float
    ok: bool


@dataclass
class CapacityResult:
    rate: float | None  # highest rate that met the SLOs; None if even ``low`` did not
    probes: list[Probe] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"max_rate_req_s": self.rate,
                "probes": [p.__dict__ for p in sorted(self.probes, key=lambda p: p.rate)]}


def meets(metrics: dict, slo_ttft_p99_s: float | None, slo_tpot_p99_s: float | None) -> bool:
    ttft, tpot = metrics["ttft_s"]["p99"], metrics["tpot_s"]["p99"]
    return ((slo_ttft_p99_s is None or ttft <= slo_ttft_p99_s)
            and (slo_tpot_p99_s is None or tpot != tpot or tpot <= slo_tpot_p99_s))  # NaN: no TPOT


def check_settings(low: float, high: float, rel_tol: float, slo_ttft_p99_s: float | None,
                   slo_tpot_p99_s: float | None) -> None:
    """The search's bounds and SLOs, checkable before any run (experiments.simulate checks them
    when its config is built, search_capacity again)."""
    if not 0 < low < high < math.inf:
        raise ValueError(f"capacity.low and capacity.high must be 0 < low < high, got {low} and {high}")
    if not 0 < rel_tol < 1:
        raise ValueError(f"capacity.rel_tol must be in (0, 1), got {rel_tol}")
    for name, v in (("slo_ttft_p99_s", slo_ttft_p99_s), ("slo_tpot_p99_s", slo_tpot_p99_s)):
        if v is not None and not v > 0:
            raise ValueError(f"capacity.{name} must be positive seconds, got {v}")


def check_search(workload: WorkloadConfig, slo_ttft_p99_s: float | None, slo_tpot_p99_s: float | None) -> None:
    """What else a search needs: an SLO to meet, and a Poisson or Gamma rate to vary."""
    if slo_ttft_p99_s is None and slo_tpot_p99_s is None:
        raise ValueError("capacity search needs at least one SLO (p99 TTFT or p99 TPOT): capacity.slo_ttft_p99_s "
                         "or capacity.slo_tpot_p99_s")
    if workload.arrival not in ("poisson", "gamma"):
        raise ValueError(f"capacity search varies the rate of poisson/gamma arrivals, not {workload.arrival!r}")


def search_capacity(run: Callable[[WorkloadConfig], dict], workload: WorkloadConfig, low: float, high: float,
                    slo_ttft_p99_s: float | None = None, slo_tpot_p99_s: float | None = None,
                    rel_tol: float = 0.02, max_probes: int = 30) -> CapacityResult:
    """Bisect ``workload.rate`` in [low, high]; ``run(workload) -> metrics`` is one simulated run."""
    check_settings(low, high, rel_tol, slo_ttft_p99_s, slo_tpot_p99_s)
    check_search(workload, slo_ttft_p99_s, slo_tpot_p99_s)
    result = CapacityResult(rate=None)

    def probe(rate: float) -> bool:
        m = run(replace(workload, rate=rate))
        ok = meets(m, slo_ttft_p99_s, slo_tpot_p99_s)
        result.probes.append(Probe(rate, m["ttft_s"]["p99"], m["tpot_s"]["p99"], ok))
        return ok

    if not probe(low):
        return result
    if probe(high):
        result.rate = high
        return result
    good, bad = low, high
    while bad - good > rel_tol * good and len(result.probes) < max_probes:
        mid = (good + bad) / 2
        if probe(mid):
            good = mid
        else:
            bad = mid
    result.rate = good
    return result
