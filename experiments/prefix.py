"""Prefix caching off and on, real and simulated: the same multi-turn workload four ways.

    python -m experiments.prefix calibration.profile=DIR/profile.json [model=qwen2_5_0_5b]
        [workload=multi_turn workload.num_requests=32] [real=false] [hydra.run.dir=OUT]

Each conversation turn resends the history, so with caching on a turn finds its previous turn's
prompt cached and prefills only what is new. Writes OUT/{off,on}/{real,sim}/ (metrics.json,
requests.csv, as ``run`` and ``simulate`` do), prefix.json (the table: calls, prefill tokens
computed, TTFT p50/p99, throughput, hit rates, and the simulator's error on each) and prefix.png.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from engine.core.config import ModelConfig, SchedulerConfig
from engine.observe.metrics import write_metrics_json, write_requests_csv
from engine.observe.workload import WorkloadConfig, generate, make_requests
from experiments.schema import register, to_object
from experiments.simulate import SimCalibration

COLUMNS = (("calls", "calls"), ("prefill_tokens", "prefill tokens"), ("ttft_p50_s", "TTFT p50 s"),
           ("ttft_p99_s", "TTFT p99 s"), ("output_tok_s", "out tok/s"), ("hit_rate", "hit rate (tokens)"),
           ("hit_rate_requests", "hit rate (requests)"))


@dataclass
class PrefixApp:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    calibration: SimCalibration = field(default_factory=SimCalibration)
    real: bool = True  # false: the simulated side only (seconds, no model)
    warmup: bool = True


register("prefix_schema", PrefixApp)


def row(metrics: dict, calls: int) -> dict:
    """The table's numbers for one run."""
    return {"calls": calls, "prefill_tokens": metrics["prefill_tokens_computed"],
            "ttft_p50_s": metrics["ttft_s"]["p50"], "ttft_p99_s": metrics["ttft_s"]["p99"],
            "output_tok_s": metrics["output_throughput_tok_s"], "hit_rate": metrics["prefix_hit_rate"],
            "hit_rate_requests": metrics["prefix_hit_rate_requests"]}


def run_real(app: PrefixApp, configs: dict[str, SchedulerConfig], out_dir: Path) -> dict[str, dict]:
    from engine.llm_engine import Engine
    from engine.model.runner import ModelRunner

    runner = ModelRunner(app.model, replace(app.scheduler, enable_prefix_caching=True))  # loaded once
    rows = {}
    for name, config in configs.items():
        engine = Engine(config, app.model, runner=runner)
        if app.warmup:
            engine.warmup()
        requests = make_requests(generate(app.workload), vocab_size=runner.vocab_size, seed=app.workload.seed)
        result = engine.run(requests)
        engine.reset()
        run_dir = out_dir / name / "real"
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = result.metrics()
        write_metrics_json(metrics, run_dir / "metrics.json")
        write_requests_csv(result.records, run_dir / "requests.csv")
        rows[name] = row(metrics, len(result.steps))
    return rows


def run_sim(app: PrefixApp, configs: dict[str, SchedulerConfig], out_dir: Path) -> dict[str, dict]:
    from sim.run import SimOptions, load_cost_model, run_workload, write_outputs

    cost = load_cost_model(app.calibration.profile, app.model)
    rows = {}
    for name, config in configs.items():
        result = run_workload(cost, config, app.workload, SimOptions(timeseries=False))
        metrics = write_outputs(result, out_dir / name / "sim", config.max_num_seqs)
        rows[name] = row(metrics, result.num_steps)
    return rows


def relative_error(sim: float, real: float) -> float:
    return (sim - real) / real if real else math.nan


def run_app(app: PrefixApp, out_dir: Path) -> dict:
    configs = {"off": replace(app.scheduler, enable_prefix_caching=False),
               "on": replace(app.scheduler, enable_prefix_caching=True)}
    table: dict[str, dict] = {}
    sim = run_sim(app, configs, out_dir) if app.calibration.profile else {}
    real = run_real(app, configs, out_dir) if app.real else {}
    for name in configs:
        if name in real:
            table[f"{name} real"] = real[name]
        if name in sim:
            table[f"{name} sim"] = sim[name]
        if name in real and name in sim:
            table[f"{name} sim error"] = {k: relative_error(sim[name][k], real[name][k]) for k, _ in COLUMNS}
    if not table:
        raise ValueError("nothing to run: real=false and no calibration.profile")
    result = {"workload": {"content": app.workload.content, "requests": len(generate(app.workload)),
                           "prompt_tokens": int(generate(app.workload).prompt_tokens.sum())},
              "model": app.model.name, "table": table}
    (out_dir / "prefix.json").write_text(json.dumps(result, indent=2) + "\n")
    from experiments.report import plot_prefix
    plot_prefix(table, out_dir / "prefix.png")
    return result


def table_text(table: dict[str, dict]) -> str:
    lines = ["| run | " + " | ".join(label for _, label in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, r in table.items():
        cells = [("n/a" if math.isnan(r[k]) else f"{r[k]:+.1%}") if "error" in name
                 else (f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k])) for k, _ in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="../conf", config_name="prefix")
def main(cfg) -> None:
    app: PrefixApp = to_object(cfg)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        result = run_app(app, out_dir)
    except ValueError as err:  # a missing or mismatched profile, an impossible request: say so
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(table_text(result["table"]))
    print(f"wrote {out_dir / 'prefix.json'} and {out_dir / 'prefix.png'}")


if __name__ == "__main__":
    main()
