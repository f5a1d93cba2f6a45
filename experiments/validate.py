"""Validate the simulator against the real engine: same arrivals, same scheduler code, compare.

    python -m experiments.validate [model=tiny] [calibration.profile=P] [matrix.schedulers=[continuous]]
        [matrix.max_num_seqs=[4,8]] [matrix.arrivals=[poisson,gamma]] [matrix.load_levels=[0.3,0.6,0.9]]
        [matrix.seed_burst=true] [workload=trace workload.path=FILE matrix.arrivals=[]] [hydra.run.dir=DIR]

Rows: the seed burst (matrix.seed_burst), and ``workload``'s lengths with each of
``matrix.arrivals`` at each load level (a fraction of the simulated saturation throughput of that
scheduler and cap); with ``matrix.arrivals=[]`` the workload runs as given (e.g. a trace). Each
row runs for real first; the simulator then replays that run's actual arrival times and lengths.
Writes DIR/validation.csv (workload, scheduler, max_num_seqs, metric, real, sim, rel_error,
tolerance, ok, and the memory bandwidth the real run and the calibration ran at: memory_gb_s,
calibration_memory_gb_s) and prints the error table. Without a profile, a quick calibration runs
first. ``use_run_bandwidth=true`` times each row's simulation with the profile's physical model
priced at the bandwidth stamped around that row's real run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import hydra
import pandas as pd
from hydra.core.hydra_config import HydraConfig

from calibration.cost_model import CostModel
from calibration.physical import AnyCostModel, at_run_bandwidth
from calibration.roofline import MemoryStamp
from engine.core.config import ModelConfig, SchedulerConfig
from engine.core.request import Request
from engine.observe.trace import parse_label, summarize_calls
from engine.observe.workload import WorkloadConfig, generate, make_requests
from experiments.report_table import format_table
from experiments.schema import register, to_object
from sim.run import load_cost_model, saturation_rate
from sim.simulator import simulate
from sim.executors import CostModelExecutor

SEED_BURST = WorkloadConfig()  # WorkloadConfig's defaults are the seed's burst


@dataclass
class Matrix:
    schedulers: list[str] = field(default_factory=lambda: ["serial", "static", "continuous"])
    max_num_seqs: list[int] = field(default_factory=lambda: [4, 8])
    seed_burst: bool = True
    arrivals: list[str] = field(default_factory=lambda: ["poisson", "gamma"])
    load_levels: list[float] = field(default_factory=lambda: [0.3, 0.6, 0.9])


@dataclass
class Tolerance:
    """Largest |sim − real| / real that passes, per kind of metric."""

    throughput: float = 0.05
    p50: float = 0.05
    p99: float = 0.10
    calls: float = 0.05
    occupancy: float = 0.05


@dataclass
class ValidateCalibration:
    profile: str | None = None  # None: calibrate (grid below) into DIR/calibration first
    grid: str = "quick"


@dataclass
class ValidateApp:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    calibration: ValidateCalibration = field(default_factory=ValidateCalibration)
    matrix: Matrix = field(default_factory=Matrix)
    tolerance: Tolerance = field(default_factory=Tolerance)
    saturation_requests: int = 64  # burst size used to find each configuration's saturation rate
    # price the simulation of each row at the read bandwidth stamped around its real run (the
    # profile's physical cost model), so a slow spell of the host's memory is not counted as error
    use_run_bandwidth: bool = False


register("validate_schema", ValidateApp)

METRICS = (  # (name, how to read it from the metrics dict, tolerance kind)
    ("output_throughput", lambda m: m["output_throughput_tok_s"], "throughput"),
    ("ttft_p50", lambda m: m["ttft_s"]["p50"], "p50"),
    ("ttft_p99", lambda m: m["ttft_s"]["p99"], "p99"),
    ("tpot_p50", lambda m: m["tpot_s"]["p50"], "p50"),
    ("tpot_p99", lambda m: m["tpot_s"]["p99"], "p99"),
    ("e2e_p50", lambda m: m["e2el_s"]["p50"], "p50"),
    ("e2e_p99", lambda m: m["e2el_s"]["p99"], "p99"),
    ("model_calls", lambda m: m["model_calls"], "calls"),
    ("occupancy_at_max", lambda m: m["occupancy_at_max"], "occupancy"),
)


@dataclass(frozen=True)
class Row:
    name: str
    scheduler: SchedulerConfig
    workload: WorkloadConfig


def matrix_rows(app: ValidateApp, cost: CostModel) -> list[Row]:
    rows = []
    for name in app.matrix.schedulers:
        for cap in app.matrix.max_num_seqs:
            scheduler = replace(app.scheduler, name=name, max_num_seqs=cap)
            if app.matrix.seed_burst:
                rows.append(Row("seed_burst", scheduler, SEED_BURST))
            if not app.matrix.arrivals:
                rows.append(Row(app.workload.arrival, scheduler, app.workload))
                continue
            mu = saturation_rate(cost, scheduler, app.workload, app.saturation_requests)
            for arrival in app.matrix.arrivals:
                for level in app.matrix.load_levels:
                    wl = replace(app.workload, arrival=arrival, rate=level * mu)
                    rows.append(Row(f"{arrival}@{level:g}", scheduler, wl))
    return rows


def with_trace(metrics: dict, calls: list[tuple[str, float, float]], max_num_seqs: int) -> dict:
    trace = summarize_calls([parse_label(label, start, dur) for label, start, dur in calls], max_num_seqs)
    return {**metrics, "model_calls": trace.model_calls, "occupancy_at_max": trace.occupancy_at_max}


def rel_error(real: float, sim: float) -> float:
    if real == 0:
        return 0.0 if sim == 0 else math.inf
    return (sim - real) / real


def validate_row(engine, cost: AnyCostModel, row: Row, use_run_bandwidth: bool = False) -> tuple[dict, dict]:
    """Real run, then the simulator on that run's actual arrivals and lengths. The real side
    carries the memory bandwidth it ran at (``MemoryStamp``): decode runs at memory speed,
    which moves with the host's load on a shared VM; ``use_run_bandwidth`` prices the simulation
    at that bandwidth (calibration.physical.at_run_bandwidth)."""
    engine.reset(row.scheduler)
    engine.warmup()
    with MemoryStamp() as memory:
        real = engine.run(make_requests(generate(row.workload), vocab_size=engine.runner.vocab_size,
                                        seed=row.workload.seed))
    real_m = with_trace(real.metrics(), real.trace_calls(), row.scheduler.max_num_seqs)
    real_m["memory_read_gb_s"] = memory.gb_s
    replay = [Request(r.request_id, range(r.prompt_tokens), r.output_tokens, arrival_s=r.arrival_s)
              for r in real.records]
    if use_run_bandwidth:
        cost = at_run_bandwidth(cost, memory.gb_s)
    sim = simulate(replay, row.scheduler, lambda: CostModelExecutor(cost), keep_steps=True)
    sim_m = with_trace(sim.metrics(), sim.trace_calls(), row.scheduler.max_num_seqs)
    return real_m, sim_m


def run_validation(app: ValidateApp, out_dir: Path) -> pd.DataFrame:
    from engine.llm_engine import Engine
    from engine.model.runner import ModelRunner

    out_dir.mkdir(parents=True, exist_ok=True)
    profile = app.calibration.profile
    if profile is None:
        from calibration.calibrate import CalibrationConfig
        from experiments.calibrate import CalibrateApp, calibrate

        profile = str(calibrate(CalibrateApp(app.model, CalibrationConfig(grid=app.calibration.grid)),
                                out_dir / "calibration"))
    cost = load_cost_model(profile, app.model, physical=app.use_run_bandwidth)
    widest = replace(app.scheduler, max_num_seqs=max(app.matrix.max_num_seqs))
    runner = ModelRunner(app.model, widest)
    engine = Engine(widest, app.model, runner=runner)
    tolerance = vars(app.tolerance)
    calibration_memory = math.nan if cost.memory_read_gb_s is None else cost.memory_read_gb_s  # older profiles
    records = []
    for row in matrix_rows(app, cost):
        real_m, sim_m = validate_row(engine, cost, row, app.use_run_bandwidth)
        for metric, read, kind in METRICS:
            real, sim = float(read(real_m)), float(read(sim_m))
            err = rel_error(real, sim)
            records.append({"workload": row.name, "scheduler": row.scheduler.name,
                            "max_num_seqs": row.scheduler.max_num_seqs, "metric": metric, "real": real,
                            "sim": sim, "rel_error": err, "tolerance": tolerance[kind],
                            "ok": abs(err) <= tolerance[kind], "memory_gb_s": real_m["memory_read_gb_s"],
                            "calibration_memory_gb_s": calibration_memory})
        print(f"  {row.name:14s} {row.scheduler.name:10s} cap={row.scheduler.max_num_seqs}: "
              f"real {real_m['output_throughput_tok_s']:.2f} vs sim {sim_m['output_throughput_tok_s']:.2f} "
              f"out tok/s; memory {real_m['memory_read_gb_s']:.0f} GB/s (calibration {calibration_memory:.0f})",
              flush=True)
    df = pd.DataFrame.from_records(records)
    df.to_csv(out_dir / "validation.csv", index=False)
    return df


def format_validation(df: pd.DataFrame) -> str:
    """Per metric: median and worst |error| over the matrix, and how many rows pass."""
    rows = []
    for metric, _, _ in METRICS:
        sel = df[df.metric == metric]
        errs = sel.rel_error.abs()
        rows.append([metric, f"{errs.median():.1%}", f"{errs.max():.1%}", f"{sel.tolerance.iloc[0]:.0%}",
                     f"{int(sel.ok.sum())}/{len(sel)}"])
    return format_table(["metric", "median |err|", "worst |err|", "tolerance", "pass"], rows)


@hydra.main(version_base="1.3", config_path="../conf", config_name="validate")
def main(cfg) -> None:
    app: ValidateApp = to_object(cfg, runs_model=True)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    df = run_validation(app, out_dir)
    print(format_validation(df))
    print(f"\n{int(df.ok.sum())}/{len(df)} comparisons within tolerance; wrote {out_dir / 'validation.csv'}")


if __name__ == "__main__":
    main()
