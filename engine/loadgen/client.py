"""A load generator for an OpenAI-compatible server, after ``vllm bench serve``.

Requests come from engine.observe.workload (burst, Poisson at ``rate``, Gamma with ``burstiness``, trace
CSV), are sent at their arrival times over streaming HTTP (httpx), optionally capped at
``max_concurrency`` in flight (vLLM's ``--max-concurrency``: arrivals keep their schedule, a
request waits for a free slot). The client records send, every token and end times; metrics
come from engine.observe.metrics, the same code the in-process engine and the simulator use.

Against a miniserve server the final chunk also carries the engine's own times, so the client
can report what the HTTP layer adds (client TTFT/E2E minus engine TTFT/E2E).
"""

from __future__ import annotations

import asyncio
import csv
import json
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from engine.core.request import Request
from engine.observe.metrics import RequestRecord, distribution, summarize, write_metrics_json, write_requests_csv
from engine.observe.results import Goodput

log = logging.getLogger(__name__)

FINISHED = {"length": "FINISHED_LENGTH", "stop": "FINISHED_STOPPED"}


@dataclass(frozen=True)
class BenchConfig:
    """``goodput``: vLLM's ``--goodput`` SLOs in ms, e.g. ``"ttft:500 tpot:50"``. ``progress``: a
    bar on a terminal only (never into a log file); the run ends with one summary line either way."""

    url: str = "http://127.0.0.1:8000"
    max_concurrency: int | None = None
    ignore_eos: bool = True
    goodput: str | None = None
    timeout_s: float = 600.0
    progress: bool = True
    # prompts are token ids drawn below this; None: the vocab_size miniserve's /v1/models reports
    # (another OpenAI-compatible server, e.g. vLLM, reports none: set it to its model's vocabulary)
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"bench.max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ValueError(f"bench.vocab_size must be >= 2, got {self.vocab_size}")
        Goodput.parse(self.goodput)  # a malformed SLO fails here, before any request is sent
        if not self.timeout_s > 0:
            raise ValueError(f"bench.timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class HttpRecord:
    """One request as the client saw it; times are seconds from the start of the run.
    ``token_times_s`` holds when each streamed chunk that carried a choice arrived, as vLLM's bench
    times a stream (a chunk may hold several tokens, or none: a special token's empty text), and
    the tokens are counted apart: the usage the server reports, else the chunks' token ids, else
    their non-empty texts."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    scheduled_s: float
    send_s: float = math.nan
    end_s: float = math.nan
    token_times_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    status_code: int = 0
    finish_reason: str | None = None
    error: str | None = None
    server_timing: dict | None = None
    t0_abs: float = math.nan  # the client's perf_counter at the run's start
    streamed_tokens: int | None = None  # counted from the chunks (None: as many as chunks)
    usage_tokens: int | None = None  # usage.completion_tokens, where the server sent it

    @property
    def output_tokens(self) -> int:
        if self.usage_tokens is not None:
            return self.usage_tokens
        return len(self.token_times_s) if self.streamed_tokens is None else self.streamed_tokens

    def same_host_split_s(self) -> tuple[float, float]:
        """(ingress, egress): client send → engine arrival, engine first token → client receipt.
        Only meaningful with client and server on one host (perf_counter is CLOCK_MONOTONIC)."""
        t = self.server_timing or {}
        times = t.get("token_times_s") or []
        if not times or not self.token_times_s or t.get("arrival_s") is None:
            return math.nan, math.nan
        return t["arrival_s"] - (self.t0_abs + self.send_s), (self.t0_abs + self.token_times_s[0]) - times[0]

    @property
    def ok(self) -> bool:
        """Finished, with a token (a stream that ends without one has no TTFT: failed, not lost)."""
        return self.error is None and self.finish_reason in FINISHED and self.output_tokens > 0 \
            and bool(self.token_times_s)

    def to_request_record(self) -> RequestRecord:
        status = FINISHED.get(self.finish_reason, "FAILED") if self.ok else "FAILED"
        if self.status_code == 429:
            status = "REJECTED"
        return RequestRecord(self.request_id, self.send_s, math.nan, tuple(self.token_times_s),
                             self.prompt_tokens, self.output_tokens if self.token_times_s else 0, status=status)

    def engine_ttft_e2e_s(self) -> tuple[float, float]:
        """TTFT and E2E as the engine measured them (from the server's accepting the request)."""
        t = self.server_timing or {}
        times = t.get("token_times_s") or []
        if not times or t.get("arrival_s") is None:
            return math.nan, math.nan
        return times[0] - t["arrival_s"], times[-1] - t["arrival_s"]

    def overhead_s(self) -> tuple[float, float]:
        """What the HTTP path adds: (client TTFT − engine TTFT, client E2E − engine E2E)."""
        ttft, e2e = self.engine_ttft_e2e_s()
        if math.isnan(ttft) or not self.token_times_s:
            return math.nan, math.nan
        return (self.token_times_s[0] - self.send_s) - ttft, (self.token_times_s[-1] - self.send_s) - e2e


@dataclass
class BenchResult:
    records: list[HttpRecord]
    duration_s: float
    metrics: dict


async def fetch_model_info(url: str) -> dict:
    """The served model's id, vocabulary and context (miniserve reports them in /v1/models)."""
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]


def prompt_vocab_size(info: dict, cfg: BenchConfig) -> int:
    """Below which token id the prompts are drawn: ``bench.vocab_size``, else what the server reports."""
    if cfg.vocab_size is not None:
        return cfg.vocab_size
    if "vocab_size" not in info:
        raise ValueError(f"the server at {cfg.url} does not report its vocabulary in /v1/models (only miniserve "
                         f"does): set bench.vocab_size to its model's, so prompts hold valid token ids")
    return int(info["vocab_size"])


async def _send(client: httpx.AsyncClient, request: Request, record: HttpRecord, model: str | None,
                cfg: BenchConfig, t0: float) -> None:
    payload = {"prompt": list(request.prompt_token_ids), "max_tokens": request.max_tokens,
               "ignore_eos": cfg.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        payload["model"] = model
    record.send_s = time.perf_counter() - t0
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as resp:
            record.status_code = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                try:
                    record.error = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    record.error = body[:200] or f"HTTP {resp.status_code}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                chunk = json.loads(data)
                if not isinstance(chunk, dict) or not isinstance(chunk.get("choices") or [], list):
                    raise ValueError(f"a stream chunk is not an OpenAI completion chunk: {data[:80]!r}")
                if "error" in chunk:
                    err = chunk["error"]
                    record.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                choices = [c for c in chunk.get("choices") or () if isinstance(c, dict)]
                if choices:  # vLLM's bench times every chunk with a choice, its text empty or not
                    record.token_times_s.append(now)
                for choice in choices:
                    ids = choice.get("token_ids")
                    n = len(ids) if ids is not None else int(bool(choice.get("text")))  # text-only servers
                    record.token_ids += ids or []
                    record.streamed_tokens = (record.streamed_tokens or 0) + n
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                        record.server_timing = chunk.get("timing")
                usage = chunk.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    record.usage_tokens = usage["completion_tokens"]
        record.end_s = time.perf_counter() - t0
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"


async def run_bench(requests: list[Request], cfg: BenchConfig, model: str | None = None) -> BenchResult:
    """Send every request at its ``arrival_s`` (seconds after start) and wait for all of them."""
    requests = sorted(requests, key=lambda r: r.arrival_s)
    records = [HttpRecord(r.request_id, r.num_prompt_tokens, r.max_tokens, r.arrival_s) for r in requests]
    width = cfg.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else nullcontext()
    bar = tqdm(total=len(requests), disable=None if cfg.progress else True, desc="requests", unit="req")
    async with httpx.AsyncClient(base_url=cfg.url, timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        t0 = time.perf_counter()
        for record in records:
            record.t0_abs = t0

        async def one(request: Request, record: HttpRecord) -> None:
            await asyncio.sleep(max(0.0, t0 + request.arrival_s - time.perf_counter()))
            async with gate:
                await _send(client, request, record, model, cfg, t0)
            bar.update(1)

        await asyncio.gather(*(one(q, r) for q, r in zip(requests, records)))
        duration = time.perf_counter() - t0
    bar.close()
    metrics = bench_metrics(records, duration, cfg)
    log.info(f"sent {len(records)} requests in {duration:.1f} s: {metrics['completed']} completed, "
             f"{metrics['failed']} failed, {metrics['output_throughput_tok_s']:.1f} out tok/s")
    return BenchResult(records, duration, metrics)


def bench_metrics(records: list[HttpRecord], duration_s: float, cfg: BenchConfig) -> dict:
    """engine.observe.metrics' summary of the requests that completed, plus failures and HTTP overhead."""
    ok = [r for r in records if r.ok]
    goodput = Goodput.parse(cfg.goodput)
    metrics = summarize([r.to_request_record() for r in ok], duration_s, **goodput.seconds())
    metrics["failed"] = len(records) - len(ok)
    metrics["rejected_429"] = sum(r.status_code == 429 for r in records)
    metrics["errors"] = sorted({r.error for r in records if r.error})[:10]
    engine = [r.engine_ttft_e2e_s() for r in ok]
    overhead = [r.overhead_s() for r in ok]
    metrics["engine_ttft_s"] = distribution(t for t, _ in engine)
    metrics["engine_e2el_s"] = distribution(e for _, e in engine)
    metrics["http_overhead_ttft_s"] = distribution(t for t, _ in overhead)
    metrics["http_overhead_e2el_s"] = distribution(e for _, e in overhead)
    split = [r.same_host_split_s() for r in ok]
    metrics["http_ingress_s"] = distribution(i for i, _ in split)
    metrics["http_egress_first_token_s"] = distribution(e for _, e in split)
    metrics["max_concurrency"] = cfg.max_concurrency
    metrics["goodput"] = goodput.spec()
    return metrics


def write_outputs(result: BenchResult, out_dir: Path) -> None:
    """requests.csv and metrics.json (engine.observe.metrics' formats) and http_requests.csv (send/end
    times, HTTP status, engine-side TTFT/E2E and the overhead per request)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_requests_csv([r.to_request_record() for r in result.records], out_dir / "requests.csv")
    write_metrics_json(result.metrics, out_dir / "metrics.json")
    with open(out_dir / "http_requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["request_id", "scheduled_s", "send_s", "first_token_s", "end_s", "status_code",
                    "finish_reason", "output_tokens", "engine_ttft_s", "engine_e2e_s", "overhead_ttft_s",
                    "overhead_e2e_s", "ingress_s", "egress_first_token_s", "error"])
        for r in result.records:
            first = r.token_times_s[0] if r.token_times_s else math.nan
            w.writerow([r.request_id, r.scheduled_s, r.send_s, first, r.end_s, r.status_code, r.finish_reason,
                        r.output_tokens, *r.engine_ttft_e2e_s(), *r.overhead_s(), *r.same_host_split_s(),
                        r.error or ""])


def format_summary(m: dict) -> str:
    """The summary table in ``vllm bench serve``'s layout (latencies in ms)."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    row = lambda label, value: lines.append(f"{label:<40}{value:>10}")  # noqa: E731
    ms = lambda x: f"{1e3 * x:.2f}" if not math.isnan(x) else "nan"  # noqa: E731
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if m.get("max_concurrency"):
        row("Maximum request concurrency:", m["max_concurrency"])
    row("Benchmark duration (s):", f"{m['duration_s']:.2f}")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", f"{m['request_throughput_req_s']:.2f}")
    if m.get("goodput"):
        row("Request goodput (req/s):", f"{m['goodput_req_s']:.2f}")
    row("Output token throughput (tok/s):", f"{m['output_throughput_tok_s']:.2f}")
    row("Total token throughput (tok/s):", f"{m['total_token_throughput_tok_s']:.2f}")
    sections = [("ttft_s", "Time to First Token", "TTFT"), ("tpot_s", "Time per Output Token (excl. 1st token)", "TPOT"),
                ("itl_s", "Inter-token Latency", "ITL"), ("e2el_s", "End-to-end Latency", "E2EL"),
                ("http_overhead_ttft_s", "HTTP overhead on TTFT (client - engine)", "TTFT overhead"),
                ("http_overhead_e2el_s", "HTTP overhead on E2EL (client - engine)", "E2EL overhead")]
    for key, title, short in sections:
        d = m[key]
        if key.startswith("http_") and math.isnan(d["mean"]):
            continue
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {short} (ms):", ms(d["mean"]))
        row(f"Median {short} (ms):", ms(d["p50"]))
        row(f"P90 {short} (ms):", ms(d["p90"]))
        row(f"P99 {short} (ms):", ms(d["p99"]))
    lines.append("=" * 50)
    return "\n".join(lines)

