"""What the simulator keeps per finished request, and the run's metrics from it.

Full mode keeps engine.observe.metrics.RequestRecord (every token time), exactly as real runs do, and
summarizes with engine.observe.metrics.summarize. Compact mode, for runs of a million requests, keeps a
few numbers per request in typed arrays and streams inter-token latencies into a log-binned
histogram: TTFT, TPOT, E2E and queue distributions stay exact, ITL mean and std are exact and
ITL percentiles are within ``RELATIVE_ERROR``. Both give metrics.json the same keys.
"""

from __future__ import annotations

import math
from typing import ClassVar
from array import array
from pathlib import Path

import numpy as np

from engine.observe.metrics import (PERCENTILES, RequestRecord, distribution, record_columns, request_columns,
                                   summarize, summarize_columns, write_columns_csv, write_requests_csv)
from engine.core.request import Request, RequestStatus


# ItlSketch's bins (module constants: a compiled build reads them as C constants)
BINS_PER_DECADE = 1000
LOW_DECADE, HIGH_DECADE = -9, 6  # 1 ns … 11.6 days
RELATIVE_ERROR = 10 ** (0.5 / BINS_PER_DECADE) - 1  # half a bin: 0.12 %
FLUSH_AT = 1 << 16  # gaps buffered before they are binned


class ItlSketch:
    """Streaming inter-token latencies: exact count, mean and std; percentiles from log bins.

    Gaps are buffered as typed arrays and binned FLUSH_AT at a time: single weighted gaps, unit
    gaps (a request's own), and runs of step end times whose consecutive differences are the gaps
    (decode steps that ran at once: the differences are taken in numpy, not one by one)."""

    def __init__(self) -> None:
        nbins = (HIGH_DECADE - LOW_DECADE) * BINS_PER_DECADE
        self.counts = np.zeros(nbins + 2, dtype=np.int64)  # [0] zeros and underflow, [-1] overflow
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self._gaps = array("d")  # weighted by _weights
        self._weights = array("q")
        self._unit_gaps = array("d")  # weight 1
        self._ends = array("d")  # runs of step end times, one after another
        self._run_lengths: list[int] = []
        self._run_counts: list[int] = []
        self._buffered = 0

    def add(self, gap_s: float, count: int = 1) -> None:
        """``count`` gaps of ``gap_s`` (a decode-lane step: every member's gap is the same)."""
        self._gaps.append(gap_s)
        self._weights.append(count)
        self._buffered += 1
        if self._buffered >= FLUSH_AT:
            self._flush()

    def add_steps(self, ends_s: list[float], count: int) -> None:
        """``count`` gaps between each two consecutive ``ends_s`` (a run of decode steps, ``count`` members)."""
        self._ends.extend(ends_s)
        self._run_lengths.append(len(ends_s))
        self._run_counts.append(count)
        self._buffered += len(ends_s)
        if self._buffered >= FLUSH_AT:
            self._flush()

    def add_gaps(self, gaps: list[float]) -> None:
        """Single gaps (a finished request's, those no uniform step counted)."""
        self._unit_gaps.extend(gaps)
        self._buffered += len(gaps)
        if self._buffered >= FLUSH_AT:
            self._flush()

    def _buffered_gaps(self) -> tuple[np.ndarray, np.ndarray]:
        """Every buffered gap and its weight; the buffers start again empty."""
        parts = [(np.frombuffer(self._gaps, dtype=np.float64), np.frombuffer(self._weights, dtype=np.int64)),
                 (np.frombuffer(self._unit_gaps, dtype=np.float64), np.ones(len(self._unit_gaps), dtype=np.int64))]
        if self._run_lengths:
            ends = np.frombuffer(self._ends, dtype=np.float64)
            lengths = np.asarray(self._run_lengths, dtype=np.int64)
            weights = np.repeat(np.asarray(self._run_counts, dtype=np.int64), lengths)[1:]
            weights[np.cumsum(lengths)[:-1] - 1] = 0  # the difference across two runs is no gap
            parts.append((np.diff(ends), weights))
        self._gaps, self._weights, self._unit_gaps, self._ends = array("d"), array("q"), array("d"), array("d")
        self._run_lengths, self._run_counts, self._buffered = [], [], 0
        return np.concatenate([g for g, _ in parts]), np.concatenate([w for _, w in parts])

    def _flush(self) -> None:
        if not self._buffered:
            return
        gaps, weights = self._buffered_gaps()
        keep = weights > 0
        gaps, weights = gaps[keep], weights[keep]
        n = int(weights.sum())
        if n == 0:
            return
        # merge count/mean/M2 (Chan et al.), then histogram
        mean = float((gaps * weights).sum() / n)
        m2 = float((weights * (gaps - mean) ** 2).sum())
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total
        with np.errstate(divide="ignore"):
            idx = np.floor((np.log10(gaps) - LOW_DECADE) * BINS_PER_DECADE).astype(np.int64) + 1
        idx = np.clip(np.where(gaps > 0, idx, 0), 0, len(self.counts) - 1)
        self.counts += np.bincount(idx, weights=weights, minlength=len(self.counts)).astype(np.int64)

    def _value(self, rank: int) -> float:
        """The rank-th smallest gap (0-based), as the geometric middle of its bin."""
        i = int(np.searchsorted(np.cumsum(self.counts), rank, side="right"))
        if i == 0:
            return 0.0
        return 10 ** (LOW_DECADE + (i - 1 + 0.5) / BINS_PER_DECADE)

    def distribution(self) -> dict[str, float]:
        self._flush()
        if self.n == 0:
            return distribution([])
        out = {"mean": self.mean, "std": math.sqrt(self.m2 / self.n)}
        for p in PERCENTILES:  # numpy's linear interpolation between the two neighbouring ranks
            pos = (self.n - 1) * p / 100
            lo, frac = int(pos), pos - int(pos)
            a = self._value(lo)
            out[f"p{p}"] = a if frac == 0 else a + (self._value(lo + 1) - a) * frac
        return out


def _numpy(a: array) -> np.ndarray:
    """A typed array's values without a copy ('d': float64, 'q': int64)."""
    dtype = np.float64 if a.typecode == "d" else np.int64
    return np.frombuffer(a, dtype=dtype) if a else np.zeros(0, dtype=dtype)


class RequestLog:
    """Finished requests of one simulated run."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("arrival", "first_scheduled", "first_token", "finish", "prompt", "output",
                                          "preemptions", "cached", "lookups")

    def __init__(self, keep_token_times: bool = True) -> None:
        self.keep_token_times = keep_token_times
        self.records: list[RequestRecord] = []
        self.ids: list[str] = []
        self.arrival = array("d")
        self.first_scheduled = array("d")
        self.first_token = array("d")
        self.finish = array("d")
        self.prompt = array("q")
        self.output = array("q")
        self.preemptions = array("q")
        self.cached = array("q")
        self.lookups = array("q")
        self.statuses: list[RequestStatus] = []
        self.itl = ItlSketch()

    def __len__(self) -> int:
        return len(self.records) if self.keep_token_times else len(self.ids)

    def add(self, request: Request) -> None:
        if self.keep_token_times:
            self.records.append(RequestRecord.from_request(request))
            return
        times = request.token_times_s
        first_scheduled = request.first_scheduled_s
        self.ids.append(request.request_id)
        self.statuses.append(request.status)
        self.arrival.append(request.arrival_s)
        self.first_scheduled.append(math.nan if first_scheduled is None else first_scheduled)
        self.first_token.append(times[0] if times else math.nan)
        self.finish.append(times[-1] if times else math.nan)
        self.prompt.append(request.num_prompt_tokens)
        self.output.append(len(times))
        self.preemptions.append(request.num_preemptions)
        self.cached.append(request.num_cached_tokens)
        self.lookups.append(request.num_lookup_tokens)
        self.itl.add_gaps(request.gaps_outside_lane_steps())

    @property
    def total_output_tokens(self) -> int:
        if self.keep_token_times:
            return sum(r.output_tokens for r in self.records)
        return int(np.frombuffer(self.output, dtype=np.int64).sum()) if self.output else 0

    def columns(self) -> dict[str, np.ndarray]:
        """Per-request arrays (either mode): engine.observe.metrics.request_columns."""
        if self.keep_token_times:
            return record_columns(self.records)
        return request_columns(*(_numpy(getattr(self, name)) for name in self.COLUMNS))

    def summarize(self, duration_s: float | None = None, slo_ttft_s: float | None = None,
                  slo_tpot_s: float | None = None, slo_e2el_s: float | None = None) -> dict:
        """engine.observe.metrics.summarize's dict, computed from whichever form was kept."""
        if self.keep_token_times:
            return summarize(self.records, duration_s, slo_ttft_s, slo_tpot_s, slo_e2el_s)
        return summarize_columns(self.columns(), self.itl.distribution(), duration_s, slo_ttft_s, slo_tpot_s,
                                 slo_e2el_s)

    def write_csv(self, path: Path) -> None:
        """requests.csv with the real runs' columns; compact mode leaves token_times_s empty."""
        if self.keep_token_times:
            write_requests_csv(self.records, path)
        else:
            write_columns_csv(self.ids, self.columns(), [s.name for s in self.statuses], None, path)
