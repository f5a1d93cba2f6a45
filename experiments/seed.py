"""The seed's experiment: one burst through serial, static and continuous batching, each in a
fresh process after a warm-up, with every model call traced; prints the seed's table."""

from __future__ import annotations

import json
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from engine.config import ModelConfig, SchedulerConfig
from engine.trace import summarize_trace, write_chrome_trace
from engine.workload import WorkloadConfig, generate, make_requests
from experiments.report_table import format_seed_table
from experiments.schema import SeedApp, to_object

SEED_KEYS = ("output_tokens", "model_calls", "prefill_calls", "decode_calls", "output_throughput_tok_s",
             "ttft_s", "e2e_s", "occupancy_at_max", "gap_s")


def run_scheduler(model: ModelConfig, scheduler: SchedulerConfig, workload: WorkloadConfig, out_dir: Path,
                  warmup: bool = True, profile: bool = True) -> dict:
    """Serve the workload with one scheduler in this process; write its trace, requests and metrics."""
    import torch

    from engine.llm_engine import Engine
    from engine.metrics import write_metrics_json, write_requests_csv

    out_dir.mkdir(parents=True, exist_ok=True)
    engine = Engine(scheduler, model)
    if warmup:
        engine.warmup()
    requests = make_requests(generate(workload), vocab_size=engine.runner.vocab_size, seed=workload.seed)
    trace_path = out_dir / f"trace_{scheduler.name}.json"
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = engine.run(requests)
        _export_model_regions(prof, trace_path)
    else:
        result = engine.run(requests)
        write_chrome_trace(((s.plan.label, s.end_s - s.model_s, s.model_s) for s in result.steps), trace_path)
    metrics = result.metrics()
    write_requests_csv(result.records, out_dir / "requests.csv")
    write_metrics_json(metrics, out_dir / "metrics.json")
    trace = summarize_trace(trace_path, scheduler.max_num_seqs).to_dict()
    return {
        "output_tokens": metrics["total_output_tokens"],
        **{k: trace[k] for k in ("model_calls", "prefill_calls", "decode_calls", "calls_by_phase",
                                 "active_histogram", "busy_s_by_active", "busy_s", "span_s",
                                 "occupancy_at_max", "occupancy_below_max", "gap_s", "max_gap_s")},
        "output_throughput_tok_s": metrics["output_throughput_tok_s"],
        "duration_s": metrics["duration_s"],
        "ttft_s": metrics["ttft_s"],
        "e2e_s": metrics["e2el_s"],
        "tpot_s": metrics["tpot_s"],
        "trace": trace_path.name,
    }


def _export_model_regions(prof, path: Path) -> None:
    """Keep only the model-call regions of the profiler's trace: the operator events would make
    it tens of MB per run and the seed's analysis reads only the regions."""
    full = path.with_suffix(".full.json")
    prof.export_chrome_trace(str(full))
    data = json.loads(full.read_text())
    data["traceEvents"] = [e for e in data["traceEvents"]
                           if e.get("ph") == "M" or str(e.get("name", "")).startswith("miniserve.")]
    path.write_text(json.dumps(data))
    full.unlink()


def run_seed_experiment(app: SeedApp, out_dir: Path) -> dict:
    """Each scheduler in a fresh spawned process, as the seed ran a fresh server per strategy."""
    results = {}
    for name in app.schedulers:
        scheduler = replace(app.scheduler, name=name)
        with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
            results[name] = pool.submit(run_scheduler, app.model, scheduler, app.workload, out_dir / name,
                                        app.warmup, app.profile).result()
        results[name]["trace"] = f"{name}/{results[name]['trace']}"
    (out_dir / "seed.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


@hydra.main(version_base="1.3", config_path="../conf", config_name="seed")
def main(cfg) -> None:
    app: SeedApp = to_object(cfg)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    results = run_seed_experiment(app, out_dir)
    print(format_seed_table(results, app.scheduler.max_num_seqs))
    print(f"\nwrote {out_dir / 'seed.json'}")


if __name__ == "__main__":
    main()
