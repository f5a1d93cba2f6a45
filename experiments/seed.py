"""The seed's experiment, real engine and simulator side by side.

One burst (16 requests, 12-token prompts, outputs cycling 4, 16, 8, 12; max_num_seqs 8) through
serial, static and continuous batching, each in a fresh process after a warm-up with every model
call traced; then a quick calibration of this machine (unless a profile is given) and the same
burst through the simulator with the same scheduler code; then the seed's table, real beside
simulated, and the figures.

    python -m experiments.seed [model=tiny] [calibration.profile=P] [simulate=false] [hydra.run.dir=DIR]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from calibration.cost_model import other_kernels_warning, weights_read_gb_s
from calibration.roofline import MemoryStamp
from engine.core.config import SCHEDULER_NAMES, ModelConfig, SchedulerConfig
from engine.observe.trace import summarize_trace, write_chrome_trace
from engine.observe.workload import WorkloadConfig, generate, make_requests
from experiments.fresh_process import in_fresh_process
from experiments.report_table import format_seed_table, format_side_by_side
from experiments.schema import register, to_object

TRACE_KEYS = ("model_calls", "prefill_calls", "decode_calls", "calls_by_phase", "active_histogram",
              "busy_s_by_active", "busy_s", "span_s", "occupancy_at_max", "occupancy_below_max", "gap_s",
              "max_gap_s")


@dataclass
class SeedCalibration:
    profile: str | None = None  # None: a quick calibration in a fresh process, into DIR/calibration
    grid: str = "quick"


@dataclass
class SeedApp:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    schedulers: list[str] = field(default_factory=lambda: list(SCHEDULER_NAMES))
    warmup: bool = True
    profile: bool = True  # torch.profiler regions; false: the trace comes from the step records
    simulate: bool = True
    calibration: SeedCalibration = field(default_factory=SeedCalibration)


register("seed_schema", SeedApp)


def seed_row(metrics: dict, trace_path: Path, max_num_seqs: int, relative_to: Path) -> dict:
    """The seed's table row for one run (real or simulated): metrics plus the trace's analysis."""
    trace = summarize_trace(trace_path, max_num_seqs).to_dict()
    return {
        "output_tokens": metrics["total_output_tokens"],
        **{k: trace[k] for k in TRACE_KEYS},
        "output_throughput_tok_s": metrics["output_throughput_tok_s"],
        "duration_s": metrics["duration_s"],
        "ttft_s": metrics["ttft_s"],
        "e2e_s": metrics["e2el_s"],
        "tpot_s": metrics["tpot_s"],
        "trace": str(trace_path.relative_to(relative_to)),
    }


def run_scheduler(model: ModelConfig, scheduler: SchedulerConfig, workload: WorkloadConfig, out_dir: Path,
                  warmup: bool = True, profile: bool = True) -> dict:
    """Serve the workload with one scheduler in this process; write its trace, requests and metrics."""
    import torch

    from engine.llm_engine import Engine
    from engine.observe.metrics import write_metrics_json, write_requests_csv

    out_dir.mkdir(parents=True, exist_ok=True)
    engine = Engine(scheduler, model)
    if warmup:
        engine.warmup()
    served = generate(workload)
    requests = make_requests(served, vocab_size=engine.runner.vocab_size, seed=workload.seed)
    trace_path = out_dir / f"trace_{scheduler.name}.json"
    with MemoryStamp(engine.runner.device, engine.runner.decode_weights()) as memory:
        if profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                result = engine.run(requests, served.concurrency)
            _export_model_regions(prof, trace_path)
        else:
            result = engine.run(requests, served.concurrency)
            write_chrome_trace(result.trace_calls(), trace_path)
    metrics = result.metrics()
    write_requests_csv(result.records, out_dir / "requests.csv")
    write_metrics_json(metrics, out_dir / "metrics.json")
    return seed_row(metrics, trace_path, scheduler.max_num_seqs, out_dir.parent) | {
        "memory_read_gb_s": memory.gb_s, "weights_read_gb_s": memory.weights_gb_s,
        "kernels": engine.runner.kernels_used(), "device": engine.runner.device.type}


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


def calibrate_quick(model: ModelConfig, grid: str, out_dir: Path) -> str:
    from calibration.calibrate import CalibrationConfig
    from experiments.calibrate import CalibrateApp, calibrate

    return str(calibrate(CalibrateApp(model, CalibrationConfig(grid=grid, progress=False)), out_dir))


def simulate_scheduler(profile: str, model: ModelConfig, scheduler: SchedulerConfig, workload: WorkloadConfig,
                       out_dir: Path) -> dict:
    from sim.run import SimOptions, load_cost_model, run_workload, write_outputs

    cost = load_cost_model(profile, model)
    metrics = write_outputs(run_workload(cost, scheduler, workload, SimOptions()), out_dir, scheduler.max_num_seqs)
    measured_on = cost.info.get("measured_on", {})  # the calibration's, as the bandwidths are
    return seed_row(metrics, out_dir / "trace.json", scheduler.max_num_seqs, out_dir.parent.parent) | {
        "memory_read_gb_s": cost.memory_read_gb_s, "weights_read_gb_s": weights_read_gb_s(cost.info),
        "kernels": measured_on.get("kernels"), "device": measured_on.get("device")}


def run_seed_experiment(app: SeedApp, out_dir: Path) -> tuple[dict, dict | None]:
    """Real rows (seed.json) and, with ``simulate``, simulated rows (seed_sim.json)."""
    real = {}
    for name in app.schedulers:
        scheduler = replace(app.scheduler, name=name)
        real[name] = in_fresh_process(run_scheduler, app.model, scheduler, app.workload, out_dir / name,
                                      app.warmup, app.profile)
    (out_dir / "seed.json").write_text(json.dumps(real, indent=2) + "\n")
    if not app.simulate:
        return real, None
    profile = app.calibration.profile or in_fresh_process(calibrate_quick, app.model, app.calibration.grid,
                                                          out_dir / "calibration")
    sim = {name: simulate_scheduler(profile, app.model, replace(app.scheduler, name=name), app.workload,
                                    out_dir / name / "sim")
           for name in app.schedulers}
    (out_dir / "seed_sim.json").write_text(json.dumps(sim, indent=2) + "\n")
    return real, sim


@hydra.main(version_base="1.3", config_path="../conf", config_name="seed")
def main(cfg) -> None:
    from experiments.report import ReportApp, build_report

    app: SeedApp = to_object(cfg, runs_model=True)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    real, sim = run_seed_experiment(app, out_dir)
    print("real engine:")
    print(format_seed_table(real, app.scheduler.max_num_seqs))
    if sim is not None:
        print("\nsimulator (same scheduler code, calibrated cost model):")
        print(format_seed_table(sim, app.scheduler.max_num_seqs))
        print("\nreal vs simulated:")
        print(format_side_by_side(real, sim))
        warnings = {other_kernels_warning({"kernels": sim[n].get("kernels"), "device": sim[n].get("device")},
                                          real[n].get("kernels") or {}, real[n].get("device")) for n in real}
        for warning in sorted(w for w in warnings if w):
            print(f"warning: {warning}")
    summary = build_report(ReportApp(seed_dir=str(out_dir)), out_dir / "report")
    print(f"\nwrote {out_dir / 'seed.json'}" + (f", {out_dir / 'seed_sim.json'}" if sim else "") + f" and {summary}")


if __name__ == "__main__":
    main()
