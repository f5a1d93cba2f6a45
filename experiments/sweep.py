"""Sweeps: one job per (scheduler, batch cap, arrival rate), real or simulated, via Hydra multirun.

    python -m experiments.sweep -m [backend=sim calibration.profile=P] [scheduler=serial,static,continuous]
        [scheduler.max_num_seqs=4,8,16] [workload.rate=0.5,1,2]      # the defaults in conf/sweep.yaml
    python -m experiments.sweep -m backend=real model=tiny ...          # real runs, one at a time

Each job writes its own dir (metrics.json, requests.csv, trace.json, job.json); ``experiments.report``
reads a sweep dir. Simulated jobs run in parallel on the joblib launcher; real jobs run one at a
time so they don't share the cores they are timing. For sweeps that outgrow one machine, install
hydra-ray-launcher and add ``hydra/launcher=ray_cluster`` (conf/hydra/launcher/ray_cluster.yaml).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from engine.core.config import ModelConfig, SchedulerConfig
from engine.observe.workload import WorkloadConfig
from experiments.schema import register, to_object
from sim.run import SimOptions, load_cost_model, run_workload, write_outputs

BACKENDS = ("sim", "real")


@dataclass
class ProfilePath:
    profile: str | None = None  # calibration profile.json; required with backend=sim


@dataclass
class SweepApp:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    backend: str = "sim"
    calibration: ProfilePath = field(default_factory=ProfilePath)
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


register("sweep_schema", SweepApp)
# Simulated jobs are independent and CPU-light: use every core; real jobs time the model: one at a time.
OmegaConf.register_new_resolver("sweep_jobs", lambda backend: 1 if backend == "real" else (os.cpu_count() or 1),
                                replace=True)


def run_job(app: SweepApp, out_dir: Path) -> dict:
    """One point of the sweep; job.json says which, so a report can group jobs without Hydra."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if app.backend == "sim":
        cost = load_cost_model(app.calibration.profile, app.model)
        metrics = write_outputs(run_workload(cost, app.scheduler, app.workload, SimOptions()), out_dir,
                                app.scheduler.max_num_seqs)
    else:
        from experiments.run import RunApp, run_real

        metrics = run_real(RunApp(app.model, app.scheduler, app.workload, warmup=app.warmup), out_dir)
    job = {"backend": app.backend, "model": app.model.name, "scheduler": app.scheduler.name,
           "max_num_seqs": app.scheduler.max_num_seqs, "arrival": app.workload.arrival,
           "rate": app.workload.rate, "num_requests": app.workload.num_requests,
           "scheduler_config": asdict(app.scheduler)}
    (out_dir / "job.json").write_text(json.dumps(job, indent=2) + "\n")
    return metrics


@hydra.main(version_base="1.3", config_path="../conf", config_name="sweep")
def main(cfg) -> None:
    app: SweepApp = to_object(cfg, runs_model=cfg.backend == "real")
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    m = run_job(app, out_dir)
    print(f"{app.backend} {app.scheduler.name} max_num_seqs={app.scheduler.max_num_seqs} "
          f"rate={app.workload.rate}: {m['output_throughput_tok_s']:.1f} out tok/s, "
          f"TTFT p99 {m['ttft_s']['p99']:.3f} s, E2E p99 {m['e2el_s']['p99']:.3f} s")


if __name__ == "__main__":
    main()
