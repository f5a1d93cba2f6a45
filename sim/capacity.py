"""The highest arrival rate a configuration serves within its SLOs, by bisection over simulated runs.

Each probe simulates the same workload (same seed, so the same lengths and the same unit-rate
arrival pattern stretched to the probed rate) and checks p99 TTFT and p99 TPOT. Meeting the SLOs
is assumed monotone in the rate, which holds on average; the search reports every probe so a
non-monotone region is visible.
"""

from __future__ import annotations

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


def search_capacity(run: Callable[[WorkloadConfig], dict], workload: WorkloadConfig, low: float, high: float,
                    slo_ttft_p99_s: float | None = None, slo_tpot_p99_s: float | None = None,
                    rel_tol: float = 0.02, max_probes: int = 30) -> CapacityResult:
    """Bisect ``workload.rate`` in [low, high]; ``run(workload) -> metrics`` is one simulated run."""
    if not 0 < low < high:
        raise ValueError(f"need 0 < low < high, got [{low}, {high}]")
    if workload.arrival not in ("poisson", "gamma"):
        raise ValueError(f"capacity search varies the rate of poisson/gamma arrivals, not {workload.arrival!r}")
    if slo_ttft_p99_s is None and slo_tpot_p99_s is None:
        raise ValueError("capacity search needs at least one SLO (p99 TTFT or p99 TPOT)")
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
