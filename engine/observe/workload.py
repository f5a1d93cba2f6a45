"""Workloads: an arrival process × a prompt-length and an output-length distribution, seeded.

Shared by the engine runs, the load generator and the simulator, so all three see the same
requests for the same settings.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from engine.core.request import Request, placeholder_requests
from engine.observe import prompts
from engine.observe.prompts import Segments
from engine.observe.traces import read_rows

log = logging.getLogger(__name__)

ARRIVALS = ("burst", "poisson", "gamma", "trace", "closed_loop")
LENGTH_KINDS = ("fixed", "cycle", "uniform", "lognormal", "empirical")
CONTENTS = ("random", "shared_prefix", "multi_turn")
PLACEHOLDER_STRIDE = 1 << 40  # simulated prompts without content: request i's ids start at i × this


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
        if not 0 <= self.sigma < math.inf:
            raise ValueError(f"a lognormal length's sigma must be finite and >= 0, got {self.sigma!r}")

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
    ``burstiness`` (gamma shape: 1 is Poisson, < 1 burstier), both as ``vllm bench serve`` sends
    them: a drawn gap before each request, the first too, all scaled so the last arrives at
    ``num_requests / rate`` (a short run offers the rate asked for); ``trace``: a CSV of
    arrival_s, prompt_tokens, output_tokens whose times are divided by ``time_scale``
    and lengths multiplied by ``length_scale`` (to fit a CPU), every row replayed unless
    ``num_requests`` is set (then the first ones); ``closed_loop``: ``concurrency``
    clients, each issuing its next request the moment its previous one finishes (arrival times
    are then decided by the run, not here).

    ``content`` says what prompts hold (engine/observe/prompts.py): ``random`` (no two share
    anything; a trace with ``hash_ids`` keeps its own), ``shared_prefix`` (one of
    ``num_prefixes`` system prompts of ``prefix_tokens``, then the request's own ``prompt``
    tokens), ``multi_turn`` (the arrivals start conversations of ``turns`` turns, each
    ``turn_gap_s`` on average (exponential) after the last, resending the history: system prompt
    of ``prefix_tokens``, earlier messages and answers; ``prompt`` is each new message's length,
    ``prompt.max`` the longest prompt, ``num_requests`` counts turns)."""

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
    content: str = "random"
    prefix_tokens: int = 0
    num_prefixes: int = 1
    turns: int = 1
    turn_gap_s: float = 1.0

    def __post_init__(self) -> None:
        if self.content not in CONTENTS:
            raise ValueError(f"workload.content must be one of {CONTENTS}, got {self.content!r}")
        if self.content != "random" and self.arrival in ("trace", "closed_loop"):
            raise ValueError(f"workload.content={self.content} needs an open-loop arrival (burst, poisson, gamma)")
        if self.prefix_tokens < 0 or self.num_prefixes < 1 or self.turns < 1 or not 0 <= self.turn_gap_s < math.inf:
            raise ValueError("workload.prefix_tokens must be >= 0, num_prefixes and turns >= 1, turn_gap_s finite "
                             "and >= 0")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"workload.arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.num_requests is None and self.arrival != "trace":
            raise ValueError(f"workload.num_requests is needed for arrival={self.arrival} (only a trace has its own)")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"workload.num_requests must be >= 1, got {self.num_requests}")
        if not all(0 < v < math.inf for v in (self.rate, self.burstiness, self.time_scale, self.length_scale)):
            # an infinite rate was a burst at t = 0 under another name, and Infinity in results.json
            raise ValueError("workload.rate, burstiness, time_scale and length_scale must be finite and > 0 "
                             "(a burst is workload.arrival=burst)")
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
    prompt_segments: Sequence[Segments] | None = None  # prompt content (prompts.py); None: lengths only
    # a trace's requests whose lengths were cut to workload.prompt.max / output.max, and the tokens
    # cut (trace_workload; None: not a trace): outputs record it, a replay of a trace is then not all of it
    clipped: dict[str, int] | None = None

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
    format: str = "miniserve"

    def summary(self, replayed: int, clipped: int = 0) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{n} {why}" for why, n in self.skipped.items()) or "none"
        line = (f"trace {self.path} ({self.format}): {self.rows} rows read, {skipped} skipped ({reasons}), "
                f"{replayed} replayed")
        return line + (f", {clipped} with lengths clipped to workload.prompt.max/output.max" if clipped else "")


def read_trace(path: str | Path) -> TraceRead:
    """Every request of a trace, its format detected (engine/observe/traces.py); a bad row is an
    error naming its line."""
    rows = read_rows(path)
    workload = Workload(rows.arrival_s, rows.prompt_tokens, rows.output_tokens, prompt_segments=rows.segments)
    return TraceRead(rows.path, rows.rows, rows.skipped, workload, rows.format)


def trace_workload(cfg: WorkloadConfig) -> Workload:
    """The trace's requests, its first ``num_requests`` if set, scaled and clipped; says how many."""
    read = read_trace(cfg.path)
    trace = read.workload
    take = slice(0, len(trace) if cfg.num_requests is None else min(cfg.num_requests, len(trace)))
    arrival = (trace.arrival_s[take] - trace.arrival_s[0]) / cfg.time_scale
    prompt = np.maximum(1, np.rint(trace.prompt_tokens[take] * cfg.length_scale)).astype(np.int64)
    output = np.maximum(1, np.rint(trace.output_tokens[take] * cfg.length_scale)).astype(np.int64)
    segments = None
    if trace.prompt_segments is not None:  # scaled segment by segment: equal blocks stay equal
        segments = [prompts.scale_segments(seg, cfg.length_scale, 1 << 62) for seg in trace.prompt_segments[take]]
        prompt = np.asarray([prompts.num_tokens(seg) for seg in segments], dtype=np.int64)
    clipped = int(np.count_nonzero((prompt > cfg.prompt.max) | (output > cfg.output.max)))
    log.info(read.summary(len(arrival), clipped))
    if segments is not None:
        segments = [prompts.scale_segments(seg, 1.0, cfg.prompt.max) for seg in segments]
    kept_prompt, kept_output = np.minimum(prompt, cfg.prompt.max), np.minimum(output, cfg.output.max)
    cut = {"requests": clipped, "prompt_tokens_cut": int((prompt - kept_prompt).sum()),
           "output_tokens_cut": int((output - kept_output).sum()),
           "prompt_tokens_kept": int(kept_prompt.sum()), "output_tokens_kept": int(kept_output.sum())}
    return Workload(arrival, kept_prompt, kept_output, prompt_segments=segments, clipped=cut)


def generate(cfg: WorkloadConfig) -> Workload:
    if cfg.arrival == "trace":
        return trace_workload(cfg)
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    if cfg.arrival in ("burst", "closed_loop"):
        arrival = np.zeros(n)
    else:  # as vLLM's bench (get_request): n gaps from the first request on, scaled to end at n / rate
        shape = 1.0 if cfg.arrival == "poisson" else cfg.burstiness
        arrival = np.cumsum(rng.gamma(shape, 1.0 / (cfg.rate * shape), n))
        if arrival[-1] > 0:  # (a tiny shape's draws can all underflow to 0: then all at once)
            arrival *= (n / cfg.rate) / arrival[-1]
    concurrency = cfg.concurrency if cfg.arrival == "closed_loop" else None
    if cfg.content == "multi_turn":
        return _multi_turn(cfg, arrival, rng)
    prompt, output = cfg.prompt.sample(n, rng), cfg.output.sample(n, rng)
    if cfg.content == "shared_prefix":
        segments = prompts.shared_prefix(prompt.tolist(), cfg.prefix_tokens, cfg.num_prefixes)
        return Workload(arrival, prompt + cfg.prefix_tokens, output, prompt_segments=segments)
    return Workload(arrival, prompt, output, concurrency)


def _multi_turn(cfg: WorkloadConfig, starts: np.ndarray, rng: np.random.Generator) -> Workload:
    """``num_requests`` turns of conversations that start at ``starts`` (prompts.multi_turn)."""
    n = cfg.num_requests
    shape = (n, cfg.turns)  # at most n conversations are needed; their first turns come first
    gaps = rng.exponential(cfg.turn_gap_s, shape) if cfg.turn_gap_s > 0 else np.zeros(shape)
    user = cfg.prompt.sample(n * cfg.turns, rng).reshape(shape)
    output = cfg.output.sample(n * cfg.turns, rng).reshape(shape)
    conversations = -(-n // cfg.turns)
    arrival, segments, out = prompts.multi_turn(starts[:conversations], cfg.turns, gaps, user, output,
                                                cfg.prefix_tokens, cfg.prompt.max)
    if len(arrival) < n:  # conversations ended early at prompt.max: more of them
        arrival, segments, out = prompts.multi_turn(starts, cfg.turns, gaps, user, output, cfg.prefix_tokens,
                                                    cfg.prompt.max)
    arrival, segments, out = arrival[:n], segments[:n], out[:n]
    if len(arrival) == 0:
        raise ValueError(f"workload.prompt.max={cfg.prompt.max} leaves no room for a first turn")
    return Workload(arrival - arrival[0], np.asarray([prompts.num_tokens(s) for s in segments], dtype=np.int64),
                    out, prompt_segments=segments)


def iter_requests(workload: Workload, vocab_size: int | None = None, seed: int = 0,
                  prefix: str = "req") -> Iterator[Request]:
    """``make_requests`` one at a time, so a long simulation never holds every request at once."""
    arrival, lengths, outputs = (workload.arrival_s.tolist(), workload.prompt_tokens.tolist(),
                                 workload.output_tokens.tolist())
    if workload.prompt_segments is None and not vocab_size:
        # no values, only a length; ids unique to the request, so prefix caching finds nothing
        return placeholder_requests(arrival, lengths, outputs, prefix, PLACEHOLDER_STRIDE)
    return _requests_with_content(workload.prompt_segments, arrival, lengths, outputs, vocab_size, seed, prefix)


def _requests_with_content(segments: list | None, arrival: list[float], lengths: list[int], outputs: list[int],
                           vocab_size: int | None, seed: int, prefix: str) -> Iterator[Request]:
    rng = np.random.default_rng(seed)
    for i, (t, p, o) in enumerate(zip(arrival, lengths, outputs)):
        if segments is not None:  # the same token ids in real and simulated runs
            prompt = prompts.expand(segments[i])
        else:
            prompt = rng.integers(0, vocab_size, p).tolist()
        yield Request(f"{prefix}-{i}", prompt, o, arrival_s=t)


def make_requests(workload: Workload, vocab_size: int | None = None, seed: int = 0,
                  prefix: str = "req") -> list[Request]:
    """Requests with the workload's prompt content if it has any; else random prompt ids in the
    vocabulary, or placeholder ``range`` prompts (length only) when ``vocab_size`` is None, as
    the simulator needs."""
    return list(iter_requests(workload, vocab_size, seed, prefix))
