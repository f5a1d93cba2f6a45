"""Workloads: an arrival process × a prompt-length and an output-length distribution, seeded.

Shared by the engine runs, the load generator and the simulator, so all three see the same
requests for the same settings.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from engine.core.request import Request

log = logging.getLogger(__name__)

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
    and lengths multiplied by ``length_scale`` (to fit a CPU), every row replayed unless
    ``num_requests`` is set (then the first ones); ``closed_loop``: ``concurrency``
    clients, each issuing its next request the moment its previous one finishes (arrival times
    are then decided by the run, not here)."""

    arrival: str = "burst"
    num_requests: int | None = 16  # None: the whole trace (arrival=trace only)
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
        if self.num_requests is None and self.arrival != "trace":
            raise ValueError(f"workload.num_requests is needed for arrival={self.arrival} (only a trace has its own)")
        if self.num_requests is not None and self.num_requests < 1:
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
    trace = read_trace(path).workload
    return trace.prompt_tokens if column == "prompt_tokens" else trace.output_tokens


@dataclass(frozen=True)
class TraceRead:
    """What reading a trace found: rows in the file, rows left out (by reason) and the requests kept."""

    path: str
    rows: int
    skipped: dict[str, int]
    workload: Workload

    def summary(self, replayed: int, clipped: int = 0) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{n} {why}" for why, n in self.skipped.items()) or "none"
        line = (f"trace {self.path}: {self.rows} rows read, {skipped} skipped ({reasons}), "
                f"{replayed} replayed")
        return line + (f", {clipped} with lengths clipped to workload.prompt.max/output.max" if clipped else "")


def read_trace(path: str | Path) -> TraceRead:
    """Every row of a trace CSV. A row with a prompt or output of no tokens is skipped (and
    counted: it has nothing to serve); a row that is not numbers, a missing column, times that go
    backwards or an empty trace are errors naming the line."""
    try:
        f = open(path, newline="")
    except OSError as err:
        raise ValueError(f"cannot read trace {path}: {err.strerror}") from err
    with f:
        reader = csv.DictReader(f)
        names = {}
        for ours, candidates in TRACE_COLUMNS.items():
            found = [c for c in candidates if c in (reader.fieldnames or ())]
            if not found:
                raise ValueError(f"trace {path} has no {ours} column (tried {candidates}; "
                                 f"its header is {reader.fieldnames})")
            names[ours] = found[0]
        rows, skipped, last = [], {}, -float("inf")
        for line, r in enumerate(reader, start=2):
            try:
                t, p, o = (float(r[names["arrival_s"]]), int(r[names["prompt_tokens"]]),
                           int(r[names["output_tokens"]]))
            except (TypeError, ValueError):
                raise ValueError(f"trace {path} line {line}: expected a time and two token counts, got "
                                 f"{[r.get(n) for n in names.values()]}") from None
            if t < last:
                raise ValueError(f"trace {path} line {line}: arrival {t} comes before the previous row's {last}")
            last = t
            if p < 1 or o < 1:
                why = "with no prompt or output tokens"
                skipped[why] = skipped.get(why, 0) + 1
                continue
            rows.append((t, p, o))
    if not rows:
        raise ValueError(f"trace {path} holds no requests" + (f" (skipped: {skipped})" if skipped else ""))
    arr = np.asarray(rows, dtype=float)
    workload = Workload(arr[:, 0], arr[:, 1].astype(np.int64), arr[:, 2].astype(np.int64))
    return TraceRead(str(path), len(rows) + sum(skipped.values()), skipped, workload)


def trace_workload(cfg: WorkloadConfig) -> Workload:
    """The trace's requests, its first ``num_requests`` if set, scaled and clipped; says how many."""
    read = read_trace(cfg.path)
    trace = read.workload
    take = slice(0, len(trace) if cfg.num_requests is None else min(cfg.num_requests, len(trace)))
    arrival = (trace.arrival_s[take] - trace.arrival_s[0]) / cfg.time_scale
    prompt = np.maximum(1, np.rint(trace.prompt_tokens[take] * cfg.length_scale)).astype(np.int64)
    output = np.maximum(1, np.rint(trace.output_tokens[take] * cfg.length_scale)).astype(np.int64)
    clipped = int(np.count_nonzero((prompt > cfg.prompt.max) | (output > cfg.output.max)))
    log.info(read.summary(len(arrival), clipped))
    return Workload(arrival, np.minimum(prompt, cfg.prompt.max), np.minimum(output, cfg.output.max))


def generate(cfg: WorkloadConfig) -> Workload:
    if cfg.arrival == "trace":
        return trace_workload(cfg)
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
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
