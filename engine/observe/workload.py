"""Workloads: an arrival process × a prompt-length and an output-length distribution, seeded.

Shared by the engine runs, the load generator and the simulator, so all three see the same
requests for the same settings.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from engine.core.request import Request

ARRIVALS = ("burst", "poisson", "gamma", "trace", "closed_loop")
LENGTH_KINDS = ("fixed", "cycle", "uniform", "lognormal", "empirical")
TRACE_COLUMNS = {  # our names, then the Splitwise/Vidur names
    "arrival_s": ("arrival_s", "arrived_at"),
    "prompt_tokens": ("prompt_tokens", "num_prefill_tokens"),
    "output_tokens": ("output_tokens", "num_decode_tokens"),
}


@dataclass(frozen=True)
class LengthDist:
    """Token counts: ``fixed`` (value), ``cycle`` (values in turn), ``uniform`` [low, high],
    ``lognormal`` (median ``value``, shape ``sigma``), ``empirical`` (drawn with replacement
    from ``column`` — prompt_tokens or output_tokens — of the trace CSV at ``path``), clipped to
    [1, max]."""

    kind: str = "fixed"
    value: int = 12
    values: tuple[int, ...] = ()
    low: int = 1
    high: int = 16
    sigma: float = 0.5
    max: int = 1 << 20
    path: str | None = None
    column: str = "prompt_tokens"

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length kind must be one of {LENGTH_KINDS}, got {self.kind!r}")
        if self.kind == "empirical" and not self.path:
            raise ValueError("an empirical length distribution needs path (a trace CSV)")
        if self.kind == "empirical" and self.column not in ("prompt_tokens", "output_tokens"):
            raise ValueError(f"empirical column must be prompt_tokens or output_tokens, got {self.column!r}")
        if self.kind == "cycle" and not self.values:
            raise ValueError("a cycle length distribution needs values")
        if self.kind == "uniform" and not 1 <= self.low <= self.high:
            raise ValueError(f"uniform lengths need 1 <= low <= high, got [{self.low}, {self.high}]")
        if self.value < 1 or self.max < 1 or any(v < 1 for v in self.values):
            raise ValueError("token lengths must be >= 1")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            out = np.full(n, self.value)
        elif self.kind == "cycle":
            out = np.resize(np.asarray(self.values), n)
        elif self.kind == "uniform":
            out = rng.integers(self.low, self.high + 1, n)
        elif self.kind == "empirical":
            out = rng.choice(_trace_column(self.path, self.column), n)
        else:
            out = np.rint(rng.lognormal(np.log(self.value), self.sigma, n))
        return np.clip(out, 1, self.max).astype(np.int64)


@dataclass(frozen=True)
class WorkloadConfig:
    """``burst``: all at t=0; ``poisson`` at ``rate`` req/s; ``gamma`` at ``rate`` with
    ``burstiness`` (gamma shape: 1 is Poisson, < 1 burstier); ``trace``: a CSV of
    arrival_s, prompt_tokens, output_tokens whose times are divided by ``time_scale``
    and lengths multiplied by ``length_scale`` (to fit a CPU); ``closed_loop``: ``concurrency``
    clients, each issuing its next request the moment its previous one finishes (arrival times
    are then decided by the run, not here)."""

    arrival: str = "burst"
    num_requests: int = 16
    rate: float = 1.0
    burstiness: float = 1.0
    prompt: LengthDist = field(default_factory=LengthDist)
    output: LengthDist = field(default_factory=lambda: LengthDist(kind="cycle", values=(4, 16, 8, 12)))
    path: str | None = None
    time_scale: float = 1.0
    length_scale: float = 1.0
    concurrency: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"workload.arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.num_requests < 1:
            raise ValueError(f"workload.num_requests must be >= 1, got {self.num_requests}")
        if not (self.rate > 0 and self.burstiness > 0 and self.time_scale > 0 and self.length_scale > 0):
            raise ValueError("workload.rate, burstiness, time_scale and length_scale must be > 0")
        if self.arrival == "trace" and not self.path:
            raise ValueError("workload.arrival=trace needs workload.path")
        if self.concurrency < 1:
            raise ValueError(f"workload.concurrency must be >= 1, got {self.concurrency}")


@dataclass(frozen=True)
class Workload:
    """Per-request arrays. ``concurrency`` set means closed loop: ``arrival_s`` is all zeros and
    whoever serves it issues request ``concurrency + k`` when some earlier request finishes."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    concurrency: int | None = None

    def __len__(self) -> int:
        return len(self.arrival_s)


@lru_cache(maxsize=8)
def _trace_column(path: str, column: str) -> np.ndarray:
    """One length column of a trace, read once per process (empirical distributions sample it)."""
    trace = read_trace(path)
    return trace.prompt_tokens if column == "prompt_tokens" else trace.output_tokens


def read_trace(path: str | Path) -> Workload:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        names = {}
        for ours, candidates in TRACE_COLUMNS.items():
            found = [c for c in candidates if c in (reader.fieldnames or ())]
            if not found:
                raise ValueError(f"trace {path} has no {ours} column (tried {candidates})")
            names[ours] = found[0]
        rows = [(float(r[names["arrival_s"]]), int(r[names["prompt_tokens"]]), int(r[names["output_tokens"]]))
                for r in reader]
    if not rows:
        raise ValueError(f"trace {path} holds no requests")
    arr = np.asarray(rows, dtype=float)
    return Workload(arr[:, 0], arr[:, 1].astype(np.int64), arr[:, 2].astype(np.int64))


def generate(cfg: WorkloadConfig) -> Workload:
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    if cfg.arrival == "trace":
        trace = read_trace(cfg.path)
        take = slice(0, min(n, len(trace)))
        arrival = (trace.arrival_s[take] - trace.arrival_s[0]) / cfg.time_scale
        scale = lambda x: np.maximum(1, np.rint(x[take] * cfg.length_scale)).astype(np.int64)  # noqa: E731
        return Workload(arrival, np.minimum(scale(trace.prompt_tokens), cfg.prompt.max),
                        np.minimum(scale(trace.output_tokens), cfg.output.max))
    if cfg.arrival in ("burst", "closed_loop"):
        arrival = np.zeros(n)
    else:
        shape = 1.0 if cfg.arrival == "poisson" else cfg.burstiness
        gaps = rng.gamma(shape, 1.0 / (cfg.rate * shape), n)
        gaps[0] = 0.0
        arrival = np.cumsum(gaps)
    concurrency = cfg.concurrency if cfg.arrival == "closed_loop" else None
    return Workload(arrival, cfg.prompt.sample(n, rng), cfg.output.sample(n, rng), concurrency)


def iter_requests(workload: Workload, vocab_size: int | None = None, seed: int = 0,
                  prefix: str = "req") -> Iterator[Request]:
    """``make_requests`` one at a time, so a long simulation never holds every request at once."""
    rng = np.random.default_rng(seed)
    for i, (t, p, o) in enumerate(zip(workload.arrival_s.tolist(), workload.prompt_tokens.tolist(),
                                      workload.output_tokens.tolist())):
        prompt = rng.integers(0, vocab_size, p).tolist() if vocab_size else range(p)
        yield Request(f"{prefix}-{i}", prompt, o, arrival_s=t)


def make_requests(workload: Workload, vocab_size: int | None = None, seed: int = 0,
                  prefix: str = "req") -> list[Request]:
    """Requests with random prompt ids in the vocabulary, or placeholder ``range`` prompts
    (length only) when ``vocab_size`` is None, as the simulator needs."""
    return list(iter_requests(workload, vocab_size, seed, prefix))
