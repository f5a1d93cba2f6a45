"""The seed's experiment over HTTP: per scheduler a fresh server process on a free loopback port,
warmed up (healthy), the 16-request burst sent concurrently by the load generator, SIGTERM;
the seed's table from the client's side. Call shapes and occupancy come from the server's
step trace (server.trace_path), latencies and throughput from the client.

    python -m experiments.seed_http [model=tiny] [hydra.run.dir=DIR]
"""

from __future__ import annotations

import asyncio
import logging
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import hydra
import httpx
from hydra.core.hydra_config import HydraConfig

from engine.loadgen.client import BenchConfig, fetch_model_info, run_bench, write_outputs
from engine.core.config import SCHEDULER_NAMES, ModelConfig, SchedulerConfig
from engine.serving.app import ServerConfig, parse_prometheus
from experiments.server_process import ServerProcess, free_port
from engine.observe.workload import WorkloadConfig, generate, make_requests
from experiments.report_table import format_seed_table
from experiments.schema import register, to_object
from experiments.seed import seed_row


@dataclass
class SeedHttpApp:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    schedulers: list[str] = field(default_factory=lambda: list(SCHEDULER_NAMES))
    startup_timeout_s: float = 300.0


register("seed_http_schema", SeedHttpApp)


def run_scheduler_http(app: SeedHttpApp, name: str, out_dir: Path) -> dict:
    """One fresh server for one scheduler; returns the seed's row plus the HTTP overhead."""
    out_dir.mkdir(parents=True, exist_ok=True)
    scheduler = replace(app.scheduler, name=name)
    trace_path = out_dir / f"trace_{name}.json"
    server = replace(app.server, port=free_port(app.server.host), trace_path=str(trace_path.resolve()))
    with ServerProcess(app.model, scheduler, server, log_path=out_dir / "server.log") as proc:
        proc.wait_healthy(app.startup_timeout_s)
        info = asyncio.run(fetch_model_info(proc.url))
        workload = generate(app.workload)
        requests = make_requests(workload, vocab_size=info["vocab_size"], seed=app.workload.seed)
        # a closed loop's clients are the client's cap
        bench = BenchConfig(url=proc.url, progress=False, max_concurrency=workload.concurrency)
        result = asyncio.run(run_bench(requests, bench, model=info["id"]))
        server_metrics = parse_prometheus(httpx.get(f"{proc.url}/metrics").text)
        exit_code = proc.stop()
    write_outputs(result, out_dir)
    if exit_code != 0:
        raise RuntimeError(f"{name} server exited with {exit_code}; see {out_dir / 'server.log'}")
    m = result.metrics
    if m["failed"]:
        raise RuntimeError(f"{name}: {m['failed']} requests failed: {m['errors']}")
    return {
        **seed_row(m, trace_path, scheduler.max_num_seqs, out_dir.parent),
        "engine_ttft_s": m["engine_ttft_s"],
        "engine_e2e_s": m["engine_e2el_s"],
        "http_overhead_ttft_s": m["http_overhead_ttft_s"],
        "http_overhead_e2el_s": m["http_overhead_e2el_s"],
        "server_generation_tokens": server_metrics.get("miniserve:generation_tokens_total"),
        "server_exit_code": exit_code,
    }


def format_overhead_table(results: dict) -> str:
    from experiments.report_table import format_table

    ms = lambda d: f"{1e3 * d['p50']:.1f}/{1e3 * d['p99']:.1f}"  # noqa: E731
    rows = [[name, ms(r["ttft_s"]), ms(r["engine_ttft_s"]), ms(r["http_overhead_ttft_s"]),
             ms(r["http_overhead_e2el_s"])] for name, r in results.items()]
    return format_table(["scheduler", "client TTFT p50/p99 ms", "engine TTFT p50/p99 ms",
                         "HTTP +TTFT p50/p99 ms", "HTTP +E2E p50/p99 ms"], rows)


@hydra.main(version_base="1.3", config_path="../conf", config_name="seed_http")
def main(cfg) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    app: SeedHttpApp = to_object(cfg, runs_model=True)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    results = {name: run_scheduler_http(app, name, out_dir / name) for name in app.schedulers}
    (out_dir / "seed_http.json").write_text(json.dumps(results, indent=2) + "\n")
    print(format_seed_table(results, app.scheduler.max_num_seqs))
    print()
    print(format_overhead_table(results))
    print(f"\nwrote {out_dir / 'seed_http.json'}")


if __name__ == "__main__":
    main()
