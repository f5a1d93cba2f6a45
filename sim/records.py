"""What the simulator keeps per finished request, and the run's metrics from it.

Full mode keeps engine.observe.metrics.RequestRecord (every token time), exactly as real runs do, and
summarizes with engine.observe.metrics.summarize. Compact mode, for runs of a million requests, keeps a
few numbers per request (a packed row, ``ROW``, joined into a block every ROWS_PER_BLOCK) and streams
inter-token latencies into a log-binned histogram: TTFT, TPOT, E2E and queue distributions stay
exact, ITL mean and std are exact up to rounding (a run's gaps come from the cost model's terms,
equal to its end times' differences up to rounding) and ITL percentiles are within
``RELATIVE_ERROR``. Both give metrics.json the same keys.
"""

from __future__ import annotations

import math
import struct
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
ROWS_PER_BLOCK = 1 << 12  # compact request rows listed before they are joined into a block
# A compact request row: COLUMNS (request_columns' arguments) in order, four times (s) then six
# counts, packed in one call per request (a typed array's append parses its argument each time,
# ten times a request) and read back as a record array
COLUMNS = ("arrival", "first_scheduled", "first_token", "finish", "prompt", "output", "preemptions", "cached",
           "lookups", "prefill")
ROW = struct.Struct("=4d6q")
ROW_DTYPE = np.dtype([(name, "=f8") for name in COLUMNS[:4]] + [(name, "=i8") for name in COLUMNS[4:]])


class ItlSketch:
    """Streaming inter-token latencies: exact count, mean and std; percentiles from log bins.

    Gaps are buffered in lists (a compiled build appends to a list natively; a typed array's
    append parses its argument each time) and binned FLUSH_AT at a time: single weighted gaps, unit
    gaps (a request's own), and arithmetic series (the steps of a run of decodes advanced at once,
    stored as four numbers and spelt out in numpy when binned)."""

    def __init__(self) -> None:
        nbins = (HIGH_DECADE - LOW_DECADE) * BINS_PER_DECADE
        self.counts = np.zeros(nbins + 2, dtype=np.int64)  # [0] zeros and underflow, [-1] overflow
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self._gaps: list[float] = []  # weighted by _weights
        self._weights: list[int] = []
        self._unit_gaps: list[float] = []  # weight 1
        self._series: list[tuple[float, float, int, int]] = []  # first gap, increment, length, weight
        self._buffered = 0

    def add(self, gap_s: float, count: int = 1) -> None:
        """``count`` gaps of ``gap_s`` (a decode-lane step: every member's gap is the same)."""
        self._gaps.append(gap_s)
        self._weights.append(count)
        self._buffered += 1
        if self._buffered >= FLUSH_AT:
            self._flush()

    def add_series(self, first_s: float, step_s: float, num: int, count: int) -> None:
        """``num`` gaps ``first_s + i × step_s`` (i = 0 … num − 1), ``count`` of each (a run of
        decode steps of ``count`` members, each step one context token per member longer)."""
        self._series.append((first_s, step_s, num, count))
        self._buffered += num
        if self._buffered >= FLUSH_AT:
            self._flush()

    def add_gaps(self, gaps: list[float]) -> None:
        """Single gaps (a finished request's, those no uniform step counted)."""
        self._unit_gaps += gaps
        self._buffered += len(gaps)
        if self._buffered >= FLUSH_AT:
            self._flush()

    def _bins(self, gaps: np.ndarray) -> np.ndarray:
        """Each gap's bin: [0] for zero (and underflow), log bins, [-1] for overflow."""
        with np.errstate(divide="ignore", invalid="ignore"):
            idx = np.floor((np.log10(gaps) - LOW_DECADE) * BINS_PER_DECADE)
        idx = np.where(gaps > 0, np.clip(idx + 1, 0, len(self.counts) - 1), 0)
        return idx.astype(np.int64)

    def _flush(self) -> None:
        """Bin the buffered gaps and merge their count, mean and M2 (Chan et al.). A series counts
        in closed form (an arithmetic series' mean and spread) and, when its first and last gap
        share a bin (most: a step adds a few context tokens' cost), into that bin whole; the
        others are spelt out."""
        if not self._buffered:
            return
        gaps = np.array(self._gaps + self._unit_gaps, dtype=np.float64)
        weights = np.concatenate([np.array(self._weights, dtype=np.int64),
                                  np.ones(len(self._unit_gaps), dtype=np.int64)])
        table = np.array(self._series, dtype=np.float64).reshape(-1, 4)  # lengths, weights: exact below 2**53
        first, step = table[:, 0], table[:, 1]
        num, count = table[:, 2].astype(np.int64), table[:, 3].astype(np.int64)
        self._gaps, self._weights, self._unit_gaps, self._series = [], [], [], []
        self._buffered = 0
        keep = weights > 0
        gaps, weights = gaps[keep], weights[keep]
        m = num.astype(np.float64)
        series_weight = m * count
        series_mean = first + step * (m - 1) / 2
        series_m2 = count * step * step * (m * m * m - m) / 12
        n = int(weights.sum()) + int(series_weight.sum())
        if n == 0:
            return
        mean = float(((gaps * weights).sum() + (series_weight * series_mean).sum()) / n)
        m2 = float((weights * (gaps - mean) ** 2).sum() + (series_m2 + series_weight * (series_mean - mean) ** 2).sum())
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total
        nbins = len(self.counts)
        lo, hi = self._bins(first), self._bins(first + step * (m - 1))
        whole = lo == hi
        self.counts += np.bincount(lo[whole], weights=series_weight[whole], minlength=nbins).astype(np.int64)
        spread = ~whole
        if spread.any():
            lengths = num[spread]
            series = np.repeat(np.arange(len(lengths)), lengths)
            index = np.arange(len(series)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            gaps = np.concatenate([gaps, first[spread][series] + step[spread][series] * index])
            weights = np.concatenate([weights, count[spread][series]])
        self.counts += np.bincount(self._bins(gaps), weights=weights, minlength=nbins).astype(np.int64)

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


class RequestLog:
    """Finished requests of one simulated run."""

    def __init__(self, keep_token_times: bool = True) -> None:
        self.keep_token_times = keep_token_times
        self.records: list[RequestRecord] = []
        self.ids: list[str] = []
        self._rows: list[bytes] = []  # compact rows (ROW) since the last block
        self._blocks: list[np.ndarray] = []  # record arrays of ROW_DTYPE
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
        self._rows.append(ROW.pack(request.arrival_s, math.nan if first_scheduled is None else first_scheduled,
                                   times[0] if times else math.nan, times[-1] if times else math.nan,
                                   request.num_prompt_tokens,
                                   request.num_output_tokens,  # compact: times holds each lane stay's ends only
                                   request.num_preemptions, request.num_cached_tokens, request.num_lookup_tokens,
                                   request.num_prefill_tokens))
        if len(self._rows) >= ROWS_PER_BLOCK:
            self._seal()
        self.itl.add_gaps(request.gaps_outside_lane_steps())

    @property
    def total_output_tokens(self) -> int:
        if self.keep_token_times:
            return sum(r.output_tokens for r in self.records)
        return int(self._table()["output"].sum())

    def _seal(self) -> None:
        if self._rows:
            self._blocks.append(np.frombuffer(b"".join(self._rows), dtype=ROW_DTYPE))
            self._rows = []

    def _table(self) -> np.ndarray:
        """Every compact row so far, one record (ROW_DTYPE) per request."""
        self._seal()
        if len(self._blocks) > 1:
            self._blocks = [np.concatenate(self._blocks)]
        return self._blocks[0] if self._blocks else np.zeros(0, dtype=ROW_DTYPE)

    def columns(self) -> dict[str, np.ndarray]:
        """Per-request arrays (either mode): engine.observe.metrics.request_columns."""
        if self.keep_token_times:
            return record_columns(self.records)
        table = self._table()
        return request_columns(*(table[name] for name in COLUMNS))

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
