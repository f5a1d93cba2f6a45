"""Simulate a workload through a scheduler with a calibrated cost model (no model is run).

    python -m experiments.simulate calibration.profile=DIR/profile.json [model=...] [scheduler=continuous]
        [workload=poisson workload.rate=4] [replicas=2 router=least_outstanding] [hydra.run.dir=OUT]

Writes OUT/metrics.json and OUT/requests.csv with the same keys as real runs, results.json
(``vllm bench serve --save-result``'s keys; ``goodput='ttft:500 tpot:50'`` as vLLM's ``--goodput``),
trace.json (the engine's labels), timeseries.csv and sim.json; with ``capacity.enabled=true`` also
capacity.json; with ``bands.replicates=N`` metrics.json's ``bands``: each metric's 5th/50th/95th
percentile over N runs drawn from the profile's measured noise.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from calibration.noise import RunNoise
from calibration.physical import WhatIf
from engine.compiled import status as compiled_status
from engine.core.config import ModelConfig, SchedulerConfig
from engine.observe.results import Goodput, write_results_json
from engine.observe.workload import WorkloadConfig
from experiments.schema import register, to_object
from engine.observe.metrics import write_metrics_json
from sim import workload_requests
from sim.bands import CALLS_ONLY, bands, check_counts, replicates
from sim.capacity import check_search, check_settings
from sim.run import SimOptions, find_capacity, load_cost_model, run_workload, write_outputs

log = logging.getLogger(__name__)


@dataclass
class WhatIfHardware:
    """Other hardware limits for the physical cost model (unset: the calibration machine's)."""

    memory_gb_s: float | None = None
    matmul_gflops: float | None = None


@dataclass
class SimCalibration:
    """``profile``: a calibration profile.json (required). For its own model it times calls with the
    profile's preferred cost model; for another Qwen2/Qwen3 shape it transfers the physical model
    (and says so); ``what_if`` prices the physical model at other hardware limits."""

    profile: str | None = None
    what_if: WhatIfHardware = field(default_factory=WhatIfHardware)


@dataclass
class CapacitySearch:
    """Bisect workload.rate in [low, high] for the highest rate meeting the p99 SLOs."""

    enabled: bool = False
    low: float = 0.1
    high: float = 100.0
    rel_tol: float = 0.02
    slo_ttft_p99_s: float | None = None
    slo_tpot_p99_s: float | None = None

    def __post_init__(self) -> None:
        check_settings(self.low, self.high, self.rel_tol, self.slo_ttft_p99_s, self.slo_tpot_p99_s)

    def check(self, workload: WorkloadConfig) -> None:
        """Before any run, what the search will refuse."""
        if self.enabled:
            check_search(workload, self.slo_ttft_p99_s, self.slo_tpot_p99_s)


@dataclass
class Bands:
    """``replicates=N``: N more runs with call times drawn from the profile's measured noise
    (seeds ``seed``..``seed+N-1``); metrics.json gains ``bands``: each metric's 5th/50th/95th
    percentile over them. ``calls_noise=N``: N runs with the calls' own noise only (no run-wide
    draw, sim.bands.CALLS_ONLY); metrics.json gains ``calls_noise``, each metric's median over them:
    the deterministic run has no noise, so its tail percentiles sit at its medians where a noisy
    machine's do not (docs/architecture.md, "Tails on a noisy machine")."""

    replicates: int = 0
    seed: int = 0
    calls_noise: int = 0

    def __post_init__(self) -> None:
        check_counts(self)


@dataclass
class SimulateApp:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    calibration: SimCalibration = field(default_factory=SimCalibration)
    replicas: int = 1
    router: str = "round_robin"
    goodput: str | None = None  # vLLM's --goodput SLOs in ms, e.g. "ttft:500 tpot:50"
    keep_token_times: bool = True  # false: compact per-request records for million-request runs
    trace: bool = True
    timeseries: bool = True
    capacity: CapacitySearch = field(default_factory=CapacitySearch)
    bands: Bands = field(default_factory=lambda: Bands())


register("simulate_schema", SimulateApp)


def run_app(app: SimulateApp, out_dir: Path) -> dict:
    goodput = Goodput.parse(app.goodput)  # a typo fails here, not after the simulation
    app.capacity.check(app.workload)
    what_if = app.calibration.what_if
    cost = load_cost_model(app.calibration.profile, app.model,
                           what_if=WhatIf(what_if.memory_gb_s, what_if.matmul_gflops))
    if (app.bands.replicates or app.bands.calls_noise) and not (cost.info.get("noise") or {}).get("call_log"):
        raise ValueError(f"calibration.profile={app.calibration.profile} holds no measured noise (a profile from "
                         "before calibrations kept it): bands.replicates and bands.calls_noise would draw nothing "
                         "and give bands of zero width; calibrate again, or leave them at 0")
    options = SimOptions(app.replicas, app.router, app.keep_token_times, app.trace, app.timeseries)
    log.info("core: %s", compiled_status())
    result = run_workload(cost, app.scheduler, app.workload, options)
    metrics = write_outputs(result, out_dir, app.scheduler.max_num_seqs, goodput, cost)
    write_results_json(out_dir / "results.json", metrics, backend="miniserve-sim", label=app.scheduler.name,
                       model_id=app.model.path or app.model.name, workload=app.workload, goodput=goodput)
    def replicate_bands(n: int, run_noise: RunNoise | None = None) -> dict[str, dict[str, float]]:
        """Each metric's band over ``n`` noisy replicates of the workload (sim.bands)."""
        runs = replicates(lambda: workload_requests(app.workload)[0], app.scheduler, cost, n, app.bands.seed,
                          concurrency=workload_requests(app.workload)[1], run_noise=run_noise,
                          num_replicas=app.replicas, router=app.router)
        return bands([r.log.summarize(r.duration_s, **goodput.seconds()) for r in runs])

    if app.bands.replicates > 0:
        drawn_from = RunNoise.of_profile(cost.info).describe()
        log.info("bands: %d replicates, each a residual per call and a %s", app.bands.replicates, drawn_from)
        metrics = {**metrics, "bands": {"replicates": app.bands.replicates, "seed": app.bands.seed,
                                        "drawn_from": drawn_from, **replicate_bands(app.bands.replicates)}}
        write_metrics_json(metrics, out_dir / "metrics.json")
    if app.bands.calls_noise > 0:
        medians = replicate_bands(app.bands.calls_noise, CALLS_ONLY)
        metrics = {**metrics, "calls_noise": {"replicates": app.bands.calls_noise, "seed": app.bands.seed,
                                              **{name: b["p50"] for name, b in medians.items()}}}
        write_metrics_json(metrics, out_dir / "metrics.json")
    if app.capacity.enabled:
        cap = app.capacity
        found = find_capacity(cost, app.scheduler, app.workload, cap.low, cap.high, cap.slo_ttft_p99_s,
                              cap.slo_tpot_p99_s, cap.rel_tol, options)
        (out_dir / "capacity.json").write_text(json.dumps(found.to_dict(), indent=2) + "\n")
        metrics = {**metrics, "capacity_req_s": found.rate}
    return metrics


@hydra.main(version_base="1.3", config_path="../conf", config_name="simulate")
def main(cfg) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        app: SimulateApp = to_object(cfg)  # a value no config takes (num_requests=0): the same one-line error
        metrics = run_app(app, out_dir)
    except ValueError as err:  # a missing or mismatched profile, an impossible request: say so, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if "cost_model" in metrics:
        print(f"cost model: {metrics['cost_model']['note']}")
    print(f"completed {metrics['completed']} requests, {metrics['output_throughput_tok_s']:.1f} out tok/s, "
          f"TTFT p99 {metrics['ttft_s']['p99']:.4f} s, TPOT p99 {metrics['tpot_s']['p99']:.4f} s")
    if metrics["num_preemptions"]:  # as vLLM warns: the KV cache, not the cap, bounds this run
        cap = app.scheduler.kv_capacity_tokens
        print(f"warning: {metrics['num_preemptions']} preemptions (recomputed): KV capacity "
              f"({app.scheduler.num_kv_blocks} blocks x {app.scheduler.block_size} = {cap} tokens) bounds this run; "
              "scheduler.num_kv_blocks sets it", file=sys.stderr)
    if "capacity_req_s" in metrics:
        print(f"capacity: {metrics['capacity_req_s']:.4g} req/s within the SLOs" if metrics["capacity_req_s"] is not None
              else "capacity: no rate searched meets the SLOs (capacity_req_s null)")
    for name, b in metrics.get("bands", {}).items():
        if isinstance(b, dict):
            print(f"  {name:18s} band p5 {b['p5']:.4g}  p50 {b['p50']:.4g}  p95 {b['p95']:.4g}")
    noisy = metrics.get("calls_noise")
    if noisy:
        print(f"with the calls' own noise (median of {noisy['replicates']} runs): TTFT p99 {noisy['ttft_p99']:.4f} s, "
              f"TPOT p99 {noisy['tpot_p99']:.4f} s, E2E p99 {noisy['e2e_p99']:.4f} s")
    else:  # the point prediction stays deterministic: reproducible, and its p50s score as well or better
        print("(p99s from a run without call noise, so near its p50s on a noisy machine; bands.calls_noise=20 "
              "gives them with the calls' measured noise)")
    print(f"wrote {out_dir / 'metrics.json'}")


if __name__ == "__main__":
    main()
