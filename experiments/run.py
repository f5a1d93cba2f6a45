"""One real run: the engine serves a workload, in this process or through a fresh server.

    python -m experiments.run [model=tiny] [scheduler=static] [workload=poisson workload.rate=2]
        [mode=inprocess|server] [hydra.run.dir=DIR]

Writes DIR/metrics.json and DIR/requests.csv (the simulator writes the same keys), results.json
(``vllm bench serve --save-result``'s keys; ``goodput='ttft:500 tpot:50'``), trace.json (the model
calls, same labels as the simulator's) and run.json (the trace's analysis).
"""

from __future__ import annotations

import asyncio
import csv
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from engine.core.config import ModelConfig, SchedulerConfig
from engine.observe.metrics import write_metrics_json, write_requests_csv
from engine.observe.results import Goodput, write_results_json
from engine.observe.trace import summarize_trace, write_chrome_trace
from engine.observe.workload import WorkloadConfig, generate, make_requests
from experiments.schema import register, to_object

MODES = ("inprocess", "server")


@dataclass
class RunApp:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    mode: str = "inprocess"
    warmup: bool = True
    goodput: str | None = None  # vLLM's --goodput SLOs in ms, e.g. "ttft:500 tpot:50"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


register("run_schema", RunApp)


def run_inprocess(app: RunApp, out_dir: Path) -> dict:
    """Serve the workload with the in-process engine; the step records become the trace."""
    from engine.llm_engine import Engine

    engine = Engine(app.scheduler, app.model)
    if app.warmup:
        engine.warmup()
    workload = generate(app.workload)
    requests = make_requests(workload, vocab_size=engine.runner.vocab_size, seed=app.workload.seed)
    result = engine.run(requests, concurrency=workload.concurrency)  # closed loop: that many clients
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = result.metrics(**Goodput.parse(app.goodput).seconds())
    write_metrics_json(metrics, out_dir / "metrics.json")
    write_requests_csv(result.records, out_dir / "requests.csv")
    write_chrome_trace(result.trace_calls(),
                       out_dir / "trace.json", process_name="miniserve-engine")
    with open(out_dir / "steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "start_s", "end_s", "model_s"])
        w.writerows((s.plan.label, s.start_s, s.end_s, s.model_s) for s in result.steps)
    return metrics


def run_server(app: RunApp, out_dir: Path) -> dict:
    """Serve the workload through a fresh server process, measured from the client's side."""
    from engine.loadgen.client import BenchConfig, fetch_model_info, run_bench, write_outputs
    from engine.serving.app import ServerConfig
    from experiments.server_process import ServerProcess, free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    trace = (out_dir / "trace.json").resolve()
    server = ServerConfig(port=free_port(), trace_path=str(trace), max_waiting=1 << 20)
    with ServerProcess(app.model, app.scheduler, server, log_path=out_dir / "server.log") as proc:
        proc.wait_healthy(600.0)
        info = asyncio.run(fetch_model_info(proc.url))
        workload = generate(app.workload)
        requests = make_requests(workload, vocab_size=info["vocab_size"], seed=app.workload.seed)
        # a closed loop's clients are the client's cap: each finish frees a slot for the next request
        bench = BenchConfig(url=proc.url, progress=False, goodput=app.goodput, max_concurrency=workload.concurrency)
        result = asyncio.run(run_bench(requests, bench, model=info["id"]))
        if proc.stop() != 0:
            raise RuntimeError(f"the server exited badly; see {out_dir / 'server.log'}")
    write_outputs(result, out_dir)
    return result.metrics


def run_real(app: RunApp, out_dir: Path) -> dict:
    """metrics.json, requests.csv, trace.json and run.json (trace analysis) in ``out_dir``."""
    metrics = run_inprocess(app, out_dir) if app.mode == "inprocess" else run_server(app, out_dir)
    write_results_json(out_dir / "results.json", metrics, backend="miniserve" if app.mode == "inprocess" else "openai",
                       label=app.scheduler.name, model_id=app.model.path or app.model.name, workload=app.workload,
                       goodput=Goodput.parse(app.goodput))
    summary = summarize_trace(out_dir / "trace.json", app.scheduler.max_num_seqs).to_dict()
    (out_dir / "run.json").write_text(json.dumps({"mode": app.mode, "trace": summary}, indent=2) + "\n")
    return {**metrics, "trace": summary}


@hydra.main(version_base="1.3", config_path="../conf", config_name="run")
def main(cfg) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app: RunApp = to_object(cfg, runs_model=True)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    m = run_real(app, out_dir)
    print(f"{app.scheduler.name}: {m['completed']} requests, {m['total_output_tokens']} tokens in "
          f"{m['trace']['model_calls']} calls, {m['output_throughput_tok_s']:.2f} out tok/s, "
          f"TTFT p50/p99 {m['ttft_s']['p50']:.3f}/{m['ttft_s']['p99']:.3f} s, "
          f"E2E p50/p99 {m['e2el_s']['p50']:.3f}/{m['e2el_s']['p99']:.3f} s")
    print(f"wrote {out_dir / 'metrics.json'}")


if __name__ == "__main__":
    main()
