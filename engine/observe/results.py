"""``results.json``: a run's summary under ``vllm bench serve --save-result``'s keys and units.

A vLLM user compares miniserve's real, HTTP and simulated runs with their own benchmark files
without a converter: latencies in ms as ``mean/median/std/p99_<metric>_ms``, throughputs per
second, goodput from the same ``--goodput`` SLO syntax (``"ttft:500 tpot:50"``, milliseconds).
The one writer for run, bench and simulate; it reads engine.observe.metrics' summary dict.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from engine.observe.workload import WorkloadConfig

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class Goodput:
    """Per-request SLOs in ms; a request is good when it meets every one given (vLLM's ``--goodput``)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, spec: str | None) -> Goodput:
        """``"ttft:500 tpot:50"`` (spaces or commas between pairs) → Goodput; None or "" → no SLOs."""
        slos: dict[str, float] = {}
        for pair in (spec or "").replace(",", " ").split():
            name, sep, value = pair.partition(":")
            if not sep:
                raise ValueError(f"goodput: {pair!r} is not KEY:VALUE (e.g. 'ttft:500 tpot:50', in ms)")
            if name not in GOODPUT_METRICS:
                raise ValueError(f"goodput: unknown metric {name!r}; use one of {GOODPUT_METRICS}")
            try:
                slos[f"{name}_ms"] = float(value)
            except ValueError:
                raise ValueError(f"goodput: {name} needs a number of milliseconds, got {value!r}") from None
            if not slos[f"{name}_ms"] >= 0:
                raise ValueError(f"goodput: {name} must be >= 0 ms, got {value}")
        return cls(**slos)

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def seconds(self) -> dict[str, float | None]:
        """The SLOs as engine.observe.metrics.summarize takes them."""
        s = lambda ms: None if ms is None else ms / 1e3  # noqa: E731
        return {"slo_ttft_s": s(self.ttft_ms), "slo_tpot_s": s(self.tpot_ms), "slo_e2el_s": s(self.e2el_ms)}

    def spec(self) -> str | None:
        pairs = [f"{m}:{v:g}" for m in GOODPUT_METRICS if (v := getattr(self, f"{m}_ms")) is not None]
        return " ".join(pairs) or None


def offered_load(workload: WorkloadConfig) -> dict:
    """``request_rate``, ``burstiness`` and ``max_concurrency`` as vLLM states its traffic: a burst
    or a trace (timed by its own rows, as vLLM's timed_trace) is rate "inf", a closed loop is rate
    "inf" capped at its concurrency."""
    return {"request_rate": workload.rate if workload.arrival in ("poisson", "gamma") else "inf",
            "burstiness": workload.burstiness if workload.arrival == "gamma" else 1.0,
            "max_concurrency": workload.concurrency if workload.arrival == "closed_loop" else None}


def vllm_results(metrics: dict, *, backend: str, label: str, model_id: str, num_prompts: int,
                 traffic: dict, goodput: Goodput) -> dict:
    """The summary in ``vllm bench serve --save-result``'s layout (without the per-request lists)."""
    out = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": None,
        "num_prompts": num_prompts,
        **traffic,
        "goodput": goodput.spec(),
        "duration": metrics["duration_s"],
        "completed": metrics["completed"],
        "failed": metrics["failed"],
        "total_input_tokens": metrics["total_input_tokens"],
        "total_output_tokens": metrics["total_output_tokens"],
        "request_throughput": metrics["request_throughput_req_s"],
        "request_goodput": metrics["goodput_req_s"] if goodput else None,
        "output_throughput": metrics["output_throughput_tok_s"],
        "total_token_throughput": metrics["total_token_throughput_tok_s"],
    }
    for name in LATENCY_METRICS:
        d = metrics[f"{name}_s"]
        ms = lambda x: x * 1e3 if not math.isnan(x) else None  # noqa: E731
        out.update({f"mean_{name}_ms": ms(d["mean"]), f"median_{name}_ms": ms(d["p50"]),
                    f"std_{name}_ms": ms(d["std"]), f"p99_{name}_ms": ms(d["p99"])})
    return out


def write_results_json(path: Path, metrics: dict, *, backend: str, label: str, model_id: str,
                       workload: WorkloadConfig, goodput: Goodput, max_concurrency: int | None = None) -> dict:
    """Write ``path`` (results.json) from a summary dict; ``max_concurrency`` is the client's cap."""
    traffic = offered_load(workload)
    if max_concurrency is not None:
        traffic["max_concurrency"] = max_concurrency
    results = vllm_results(metrics, backend=backend, label=label, model_id=model_id,
                           num_prompts=metrics["completed"] + metrics["failed"], traffic=traffic, goodput=goodput)
    Path(path).write_text(json.dumps(results, indent=2) + "\n")
    return results
