"""Sweeps: one job per (scheduler, batch cap, load), real or simulated, via Hydra multirun.

    python -m experiments.sweep -m [backend=sim calibration.profile=P] [scheduler=serial,static,continuous]
        [scheduler.max_num_seqs=4,8,16] [load=0.2,0.4,0.6,0.8,1.0,1.2]    # the defaults in conf/sweep.yaml
    python -m experiments.sweep -m ... load=null workload.rate=0.5,1,2  # absolute rates instead
    python -m experiments.sweep -m backend=real model=tiny ...          # real runs, one at a time

``load`` is the arrival rate as a fraction of each configuration's own simulated saturation
throughput (sim.run.saturation_rate, as experiments.validate uses), so every curve has points
below and above its knee whatever the machine's profile; it needs calibration.profile for real runs too.

Each job writes its own dir (metrics.json, requests.csv, trace.json, job.json); ``experiments.report``
reads a sweep dir. Simulated jobs run in parallel on the joblib launcher; real jobs run one at a
time so they don't share the cores they are timing. For sweeps that outgrow one machine, install
hydra-ray-launcher and add ``hydra/launcher=ray_cluster`` (conf/hydra/launcher/ray_cluster.yaml).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from engine.core.config import ModelConfig, SchedulerConfig
from engine.observe.workload import WorkloadConfig
from experiments.schema import register, to_object
from sim.run import SimOptions, load_cost_model, run_workload, saturation_rate, write_outputs

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
    load: float | None = None  # rate = load × this configuration's simulated saturation throughput
    saturation_requests: int = 64  # the simulated burst that measures saturation

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.load is not None and not self.load > 0:
            raise ValueError(f"load must be > 0 (a fraction of saturation throughput), got {self.load}")
        if self.load is not None and self.workload.arrival not in ("poisson", "gamma"):
            raise ValueError(f"load sets an arrival rate: it needs workload=poisson or gamma, "
                             f"not arrival={self.workload.arrival}")


register("sweep_schema", SweepApp)
# Simulated jobs are independent and CPU-light: use every core; real jobs time the model: one at a time.
OmegaConf.register_new_resolver("sweep_jobs", lambda backend: 1 if backend == "real" else (os.cpu_count() or 1),
                                replace=True)


def run_job(app: SweepApp, out_dir: Path) -> dict:
    """One point of the sweep; job.json says which, so a report can group jobs without Hydra."""
    out_dir.mkdir(parents=True, exist_ok=True)
    workload, saturation = app.workload, None
    if app.load is not None or app.backend == "sim":
        cost = load_cost_model(app.calibration.profile, app.model)
    if app.load is not None:
        saturation = saturation_rate(cost, app.scheduler, app.workload, app.saturation_requests)
        workload = replace(app.workload, rate=app.load * saturation)
    if app.backend == "sim":
        metrics = write_outputs(run_workload(cost, app.scheduler, workload, SimOptions()), out_dir,
                                app.scheduler.max_num_seqs)
    else:
        from experiments.run import RunApp, run_real

        metrics = run_real(RunApp(app.model, app.scheduler, workload, warmup=app.warmup), out_dir)
    job = {"backend": app.backend, "model": app.model.name, "scheduler": app.scheduler.name,
           "max_num_seqs": app.scheduler.max_num_seqs, "arrival": workload.arrival,
           "rate": workload.rate, "load": app.load, "saturation_req_s": saturation,
           "num_requests": workload.num_requests, "scheduler_config": asdict(app.scheduler)}
    (out_dir / "job.json").write_text(json.dumps(job, indent=2) + "\n")
    return {**metrics, "rate": workload.rate}


@hydra.main(version_base="1.3", config_path="../conf", config_name="sweep")
def main(cfg) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        app: SweepApp = to_object(cfg, runs_model=cfg.backend == "real")
        m = run_job(app, out_dir)
    except ValueError as err:  # a bad value in one job's list, a missing profile: one line, no traceback
        hydra_cfg = HydraConfig.get()
        job = OmegaConf.select(hydra_cfg, "job.num", default=None)  # unset in a single run (no -m)
        where = f" in job {job} ({' '.join(hydra_cfg.overrides.task)})" if job is not None else ""
        print(f"error{where}: {err}", file=sys.stderr)
        sys.exit(2)
    load = f" load={app.load:g}" if app.load is not None else ""
    print(f"{app.backend} {app.scheduler.name} max_num_seqs={app.scheduler.max_num_seqs}{load} "
          f"rate={m['rate']:.3g}: {m['output_throughput_tok_s']:.1f} out tok/s, "
          f"TTFT p99 {m['ttft_s']['p99']:.3f} s, E2E p99 {m['e2el_s']['p99']:.3f} s")


if __name__ == "__main__":
    main()
