"""``/metrics`` as Prometheus text: miniserve's own series, and the request-level ones under
vLLM's names (``vllm:time_to_first_token_seconds`` ...) so dashboards and benchmark tools built
for vLLM read this server unchanged."""

from __future__ import annotations

from engine.serving.engine_thread import EngineThread, Histogram


def prometheus_text(engine: EngineThread, rejected: dict[str, int], model_name: str) -> str:
    s = engine.stats
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]], prefix: str = "miniserve") -> None:
        lines.extend([f"# HELP {prefix}:{name} {help_}", f"# TYPE {prefix}:{name} {kind}"])
        lines.extend(f"{prefix}:{name}{labels} {value}" for labels, value in samples)

    def histogram(name: str, help_: str, h: Histogram, prefix: str = "miniserve", label: str = "") -> None:
        counts, count, total = list(h.counts), h.count, h.total
        sep = "," if label else ""
        samples = [(f'_bucket{{{label}{sep}le="{b}"}}', c) for b, c in zip(h.buckets, counts)]
        tail = f"{{{label}}}" if label else ""
        samples += [(f'_bucket{{{label}{sep}le="+Inf"}}', count), (f"_sum{tail}", total), (f"_count{tail}", count)]
        metric(name, "histogram", help_, samples, prefix)

    metric("healthy", "gauge", "1 once the engine is warmed up and serving", [("", int(engine.healthy))])
    metric("num_requests_waiting", "gauge", "Requests accepted and queued, not yet running",
           [("", s.num_waiting)])
    metric("num_requests_running", "gauge", "Requests in the running set", [("", s.num_running)])
    metric("kv_blocks_used", "gauge", "KV blocks held by requests", [("", s.kv_blocks_used)])
    metric("kv_blocks_total", "gauge", "KV blocks in the cache", [("", s.kv_blocks_total)])
    metric("kv_slots_used", "gauge", "Model-runner KV slots held by requests", [("", s.kv_slots_used)])
    metric("prompt_tokens_total", "counter", "Prompt tokens of accepted requests", [("", s.prompt_tokens)])
    metric("generation_tokens_total", "counter", "Output tokens generated", [("", s.generation_tokens)])
    metric("requests_finished_total", "counter", "Requests that finished (length or stop)", [("", s.finished)])
    metric("requests_aborted_total", "counter", "Requests cancelled (client gone, shutdown)", [("", s.aborted)])
    metric("requests_rejected_total", "counter", "Requests refused before acceptance",
           [(f'{{reason="{k}"}}', v) for k, v in rejected.items()])
    metric("prefix_cache_hit_requests_total", "counter", "Admissions that found part of their prompt cached",
           [("", s.prefix_hit_requests)])
    metric("steps_total", "counter", "Engine iterations by plan phase",
           [(f'{{phase="{k}"}}', v) for k, v in sorted(s.steps_by_phase.items())])
    histogram("step_duration_seconds", "One engine iteration: schedule, model call, apply", s.step_s)
    histogram("model_call_duration_seconds", "The model forward of one iteration", s.model_s)

    label = f'model_name="{model_name}"'
    one = [(f"{{{label}}}", 0)]
    metric("num_requests_running", "gauge", "Requests in the running set",
           [(one[0][0], s.num_running)], "vllm")
    metric("num_requests_waiting", "gauge", "Requests waiting to run", [(one[0][0], s.num_waiting)], "vllm")
    usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
    metric("kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (1 = full)", [(one[0][0], usage)], "vllm")
    metric("num_preemptions_total", "counter", "Preemptions of requests that have left the engine",
           [(one[0][0], s.preemptions)], "vllm")
    metric("prompt_tokens_total", "counter", "Prompt tokens of accepted requests", [(one[0][0], s.prompt_tokens)],
           "vllm")
    metric("generation_tokens_total", "counter", "Output tokens generated", [(one[0][0], s.generation_tokens)],
           "vllm")
    metric("prefix_cache_queries_total", "counter", "Tokens looked up in the prefix cache at admission",
           [(one[0][0], s.prefix_cache_queries)], "vllm")
    metric("prefix_cache_hits_total", "counter", "Tokens found in the prefix cache (not computed)",
           [(one[0][0], s.prefix_cache_hits)], "vllm")
    histogram("time_to_first_token_seconds", "Arrival to first output token", s.ttft_s, "vllm", label)
    histogram("time_per_output_token_seconds", "Mean gap between output tokens of a request", s.tpot_s, "vllm",
              label)
    histogram("e2e_request_latency_seconds", "Arrival to the last output token", s.e2e_s, "vllm", label)
    return "\n".join(lines) + "\n"


def parse_prometheus(text: str) -> dict[str, float]:
    """``name{labels}`` → value, for tests and the seed harness."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out
