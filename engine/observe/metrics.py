"""Per-request and per-run latency metrics, with vLLM's definitions.

One module serves the in-process engine, the HTTP client and the simulator, so a real and a
simulated run are always measured the same way. Times are seconds from the start of the run.
  TTFT  = first token time − arrival
  TPOT  = (E2E − TTFT) / (output tokens − 1), requests with one output token excluded
  ITL   = gaps between consecutive output tokens of one request
  E2EL  = last token time − arrival
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.core.request import Request

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestRecord:
    """One request's times. ``token_times_s``: when each output token came out (engine, simulator),
    or each streamed chunk arrived (the HTTP client, as vLLM's bench times a stream: a chunk can
    carry several tokens); ``output_tokens`` counts the tokens, so TPOT divides by tokens and ITL
    is the gaps between those times, as vLLM's are."""

    request_id: str
    arrival_s: float
    first_scheduled_s: float
    token_times_s: tuple[float, ...]
    prompt_tokens: int
    output_tokens: int
    num_preemptions: int = 0
    status: str = "FINISHED_LENGTH"
    lookup_tokens: int = 0  # prefix caching, over its admissions: tokens looked up
    cached_tokens: int = 0  # and found cached (not computed)
    prefill_tokens: int = 0  # tokens its calls ran as prefill (Request.num_prefill_tokens)

    @classmethod
    def from_request(cls, request: Request) -> RequestRecord:
        return cls(
            request_id=request.request_id,
            arrival_s=request.arrival_s,
            first_scheduled_s=(request.first_scheduled_s if request.first_scheduled_s is not None
                               else math.nan),
            token_times_s=tuple(request.token_times_s),
            prompt_tokens=request.num_prompt_tokens,
            output_tokens=request.num_output_tokens,
            num_preemptions=request.num_preemptions,
            status=request.status.name,
            lookup_tokens=request.num_lookup_tokens,
            cached_tokens=request.num_cached_tokens,
            prefill_tokens=request.num_prefill_tokens,
        )

    @property
    def finish_s(self) -> float:
        return self.token_times_s[-1] if self.token_times_s else math.nan

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else math.nan

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        n = self.output_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else math.nan

    @property
    def queue_s(self) -> float:
        return self.first_scheduled_s - self.arrival_s

    @property
    def itl_s(self) -> np.ndarray:
        return np.diff(np.asarray(self.token_times_s, dtype=float))


def distribution(values: Iterable[float]) -> dict[str, float]:
    """mean, std and p50/p90/p99 of the finite values (NaN where there are none)."""
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if arr.size == 0:
        return {"mean": math.nan, "std": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    return {"mean": float(arr.mean()), "std": float(arr.std()),
            **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def request_columns(arrival_s, first_scheduled_s, first_token_s, finish_s, prompt_tokens, output_tokens,
                    num_preemptions, cached_tokens, lookup_tokens, prefill_tokens) -> dict[str, np.ndarray]:
    """Per-request arrays and the latencies derived from them (REQUEST_COLUMNS less id, status and
    token times): what summarize_columns and write_requests_csv read, from full records or the
    simulator's compact ones alike."""
    arrival, first_sched, first, finish = (np.asarray(a, dtype=float) for a in
                                           (arrival_s, first_scheduled_s, first_token_s, finish_s))
    prompt, output, preempt, cached, lookups, prefill = (np.asarray(a, dtype=np.int64) for a in (
        prompt_tokens, output_tokens, num_preemptions, cached_tokens, lookup_tokens, prefill_tokens))
    ttft = first - arrival
    e2e = finish - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(output > 1, (e2e - ttft) / np.maximum(output - 1, 1), math.nan)
    return {"arrival_s": arrival, "first_scheduled_s": first_sched, "first_token_s": first, "finish_s": finish,
            "prompt_tokens": prompt, "output_tokens": output, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e,
            "queue_s": first_sched - arrival, "num_preemptions": preempt, "cached_tokens": cached,
            "lookup_tokens": lookups, "prefill_tokens": prefill}


def record_columns(records: Sequence[RequestRecord]) -> dict[str, np.ndarray]:
    return request_columns([r.arrival_s for r in records], [r.first_scheduled_s for r in records],
                           [r.token_times_s[0] if r.token_times_s else math.nan for r in records],
                           [r.finish_s for r in records], [r.prompt_tokens for r in records],
                           [r.output_tokens for r in records], [r.num_preemptions for r in records],
                           [r.cached_tokens for r in records], [r.lookup_tokens for r in records],
                           [r.prefill_tokens for r in records])


def summarize_columns(c: dict[str, np.ndarray], itl: dict[str, float], duration_s: float | None = None,
                      slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
                      slo_e2el_s: float | None = None) -> dict:
    """Run-level metrics from request_columns and the inter-token latencies' distribution.
    ``duration_s`` defaults to first arrival → last token. Goodput counts requests meeting every
    SLO given (vLLM's ``--goodput``; engine.observe.results parses its syntax)."""
    done = c["output_tokens"] > 0
    if duration_s is None:
        duration_s = float(c["finish_s"][done].max() - c["arrival_s"].min()) if done.any() else 0.0
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    good = done.copy()
    if slo_ttft_s is not None:
        good &= c["ttft_s"] <= slo_ttft_s
    if slo_tpot_s is not None:
        good &= np.isnan(c["tpot_s"]) | (c["tpot_s"] <= slo_tpot_s)
    if slo_e2el_s is not None:
        good &= c["e2e_s"] <= slo_e2el_s
    out_tokens = int(c["output_tokens"][done].sum())
    in_tokens = int(c["prompt_tokens"][done].sum())
    n_done = int(done.sum())
    return {
        "completed": n_done,
        "failed": len(done) - n_done,
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput_req_s": per_s(n_done),
        "output_throughput_tok_s": per_s(out_tokens),
        "total_token_throughput_tok_s": per_s(out_tokens + in_tokens),
        "goodput_req_s": per_s(int(good.sum())),
        "ttft_s": distribution(c["ttft_s"][done].tolist()),
        "tpot_s": distribution(c["tpot_s"][done].tolist()),
        "itl_s": itl,
        "e2el_s": distribution(c["e2e_s"][done].tolist()),
        "queue_s": distribution(c["queue_s"][done].tolist()),
        "num_preemptions": int(c["num_preemptions"].sum()),
        **prefix_cache_metrics(int(c["lookup_tokens"].sum()), int(c["cached_tokens"].sum()),
                               int((c["cached_tokens"] > 0).sum()), len(done), int(c["prefill_tokens"].sum())),
    }


def prefix_cache_metrics(queries: int, hits: int, hit_requests: int, requests: int, computed: int) -> dict:
    """Prefix caching's effect: tokens looked up at admission (prompt, or prompt and outputs on
    recompute) and found cached, as vLLM's prefix_cache_queries / _hits count them; requests
    with a hit; prefill tokens saved (the hits) and computed (what the calls ran as prefill:
    under preemption not queries less hits, since a request preempted midway was looked up whole).
    Zero hits when off."""
    return {
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "prefix_hit_requests": hit_requests,
        "prefix_hit_rate_requests": hit_requests / requests if requests else 0.0,
        "prefill_tokens_saved": hits,
        "prefill_tokens_computed": computed,
    }


def summarize(records: Sequence[RequestRecord], duration_s: float | None = None,
              slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
              slo_e2el_s: float | None = None) -> dict:
    """Run-level metrics of full records (every token time known, so ITL is exact)."""
    itls = np.concatenate([r.itl_s for r in records if r.token_times_s] or [np.array([])])
    return summarize_columns(record_columns(records), distribution(itls.tolist()), duration_s,
                             slo_ttft_s, slo_tpot_s, slo_e2el_s)


REQUEST_COLUMNS = ("request_id", "arrival_s", "first_scheduled_s", "first_token_s", "finish_s",
                   "prompt_tokens", "output_tokens", "ttft_s", "tpot_s", "e2e_s", "queue_s",
                   "num_preemptions", "status", "cached_tokens", "lookup_tokens", "prefill_tokens", "token_times_s")


def write_requests_csv(records: Sequence[RequestRecord], path: Path) -> None:
    write_columns_csv([r.request_id for r in records], record_columns(records), [r.status for r in records],
                      [r.token_times_s for r in records], path)


def write_columns_csv(ids: Sequence[str], c: dict[str, np.ndarray], statuses: Sequence[str],
                      token_times: Sequence[Sequence[float]] | None, path: Path) -> None:
    """requests.csv: one row per request; ``token_times`` None (compact records) leaves that column empty."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(REQUEST_COLUMNS)
        for i, rid in enumerate(ids):
            times = " ".join(repr(t) for t in token_times[i]) if token_times is not None else ""
            w.writerow([rid, *(c[k][i].item() for k in REQUEST_COLUMNS[1:-5]), statuses[i],
                        *(c[k][i].item() for k in REQUEST_COLUMNS[-4:-1]), times])


def read_requests_csv(path: Path) -> list[RequestRecord]:
    with open(path, newline="") as f:
        return [RequestRecord(
            request_id=row["request_id"], arrival_s=float(row["arrival_s"]),
            first_scheduled_s=float(row["first_scheduled_s"]),
            token_times_s=tuple(float(t) for t in row["token_times_s"].split()),
            prompt_tokens=int(row["prompt_tokens"]), output_tokens=int(row["output_tokens"]),
            num_preemptions=int(row["num_preemptions"]), status=row["status"],
            cached_tokens=int(row.get("cached_tokens") or 0), lookup_tokens=int(row.get("lookup_tokens") or 0),
            prefill_tokens=int(row.get("prefill_tokens") or 0),
        ) for row in csv.DictReader(f)]


def write_metrics_json(metrics: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(metrics, indent=2, allow_nan=True) + "\n")


