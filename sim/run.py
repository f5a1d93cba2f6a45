"""Library side of ``python -m experiments.simulate``: load the cost model, run, write the files."""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from calibration.cost_model import CostModel, ProfileMismatchError, other_device_warning, slow_placement_warning
from calibration.physical import AnyCostModel, PhysicalCostModel, WhatIf, load_profile_for
from engine.core.config import ModelConfig, SchedulerConfig
from engine.core.model_shape import config_fingerprint, model_shape
from engine.observe.metrics import write_metrics_json
from engine.observe.results import Goodput
from engine.observe.trace import parse_calls, summarize_calls, write_chrome_trace
from engine.observe.workload import WorkloadConfig, generate
from sim import workload_requests
from sim.capacity import CapacityResult, search_capacity
from sim.simulator import TIMESERIES_COLUMNS, SimResult, TimeSeries, simulate
from sim.executors import CostModelExecutor


log = logging.getLogger("miniserve.sim")


class MissingProfileError(ValueError):
    """The simulator has no step costs without a calibration profile, and never invents them."""


def load_cost_model(profile: str | None, model: ModelConfig | None = None, run_on: dict | None = None,
                    what_if: WhatIf = WhatIf(), physical: bool = False) -> AnyCostModel:
    """The profile's cost model for ``model``. The profile's own model gets its preferred cost model
    (empirical or physical, whichever was more accurate on held-out calls); another model gets the
    profile's physical model with that model's shape — a transfer, logged and recorded in
    ``cost.info["cost_model_note"]`` — and a profile without one is refused. ``what_if`` prices the
    physical model at other hardware limits; ``physical`` asks for the physical model in any case. Warns (log and ``cost.info["device_warning"]``) when the
    profile was measured on another device than the run it is compared with: ``run_on``
    (engine.model.device.here, from apps that run the model too), else an explicit ``model.device``.
    ``model.dtype=auto`` takes the dtype the profile's own run chose. Warns too (log and
    ``cost.info["placement_warning"]``) when the profile's own weights read slow
    (calibration.cost_model.slow_placement). Torch-free: the simulator never loads the model."""
    if not profile:
        raise MissingProfileError(
            "no calibration profile: the simulator needs measured step costs. Run "
            "`python -m experiments.calibrate model=... hydra.run.dir=DIR` and pass "
            "calibration.profile=DIR/profile.json")
    if not Path(profile).is_file():
        raise MissingProfileError(f"calibration.profile={profile} does not exist (or is not a file)")
    try:
        cost = _load_cost_model(profile, model, run_on, what_if, physical)
        placement = slow_placement_warning(cost.info)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ZeroDivisionError) as exc:
        raise ProfileMismatchError(f"calibration.profile={profile} is not a calibration profile this version can "
                                   f"read ({type(exc).__name__}: {exc}); run python -m experiments.calibrate for a "
                                   f"new one") from exc
    if placement:
        log.warning(placement)
        cost.info["placement_warning"] = placement
    return cost


def _load_cost_model(profile: str, model: ModelConfig | None, run_on: dict | None, what_if: WhatIf,
                     physical: bool) -> AnyCostModel:
    if model is None:
        if what_if.active or physical:
            return PhysicalCostModel.from_profile(json.loads(Path(profile).read_text())).with_machine(
                what_if.memory_gb_s, what_if.matmul_gflops)
        return CostModel.load(profile)
    if model.dtype == "auto":
        model = replace(model, dtype=json.loads(Path(profile).read_text()).get("model", {}).get("dtype", "float32"))
    cost, note = load_profile_for(profile, model_shape(model), model.dtype, config_fingerprint(model), what_if,
                                  physical)
    if note:
        log.warning(note)
        cost.info["cost_model_note"] = note
    if run_on is None and model.device != "auto":
        run_on = {"device": model.device}
    warning = other_device_warning(cost.info.get("measured_on", {}), run_on) if run_on else None
    if warning:
        log.warning(warning)
        cost.info["device_warning"] = warning
    return cost


def describe_cost_model(cost: AnyCostModel) -> dict:
    """What a run's metrics.json says about the cost model that timed it: its kind, and whether it
    was transferred from another model or priced at what-if hardware."""
    out: dict = {"kind": "physical" if isinstance(cost, PhysicalCostModel) else "empirical",
                 "profile_model": cost.info.get("model", {}).get("name"),
                 "transfer": cost.info.get("transfer") is not None}
    if isinstance(cost, PhysicalCostModel):
        out["machine"] = cost.machine.to_dict()
    for key in ("transfer", "what_if"):
        if cost.info.get(key):
            out[key + "_from" if key == "transfer" else key] = cost.info[key]
    if cost.info.get("cost_model_note"):
        out["note"] = cost.info["cost_model_note"]
    return out


@dataclass(frozen=True)
class SimOptions:
    replicas: int = 1
    router: str = "round_robin"
    keep_token_times: bool = True
    trace: bool = True
    timeseries: bool = True


def run_workload(cost: AnyCostModel, scheduler: SchedulerConfig, workload: WorkloadConfig,
                 options: SimOptions = SimOptions()) -> SimResult:
    generated = generate(workload)
    requests, concurrency = workload_requests(generated, lazy=not options.keep_token_times)
    result = simulate(requests, scheduler, lambda: CostModelExecutor(cost), concurrency=concurrency,
                      num_replicas=options.replicas, router=options.router, keep_calls=options.trace,
                      timeseries=options.timeseries, keep_token_times=options.keep_token_times)
    result.workload_clipped = generated.clipped
    return result


def saturation_rate(cost: AnyCostModel, scheduler: SchedulerConfig, workload: WorkloadConfig, n: int = 64) -> float:
    """Requests/s the configuration sustains when it never waits for work: a simulated burst of
    ``n`` requests with the workload's lengths. Sweeps and validation state load as a fraction of it."""
    burst = replace(workload, arrival="burst", num_requests=n)
    return run_workload(cost, scheduler, burst, SimOptions(trace=False, timeseries=False)).metrics()[
        "request_throughput_req_s"]


def write_timeseries_csv(series: TimeSeries, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(TIMESERIES_COLUMNS)
        w.writerows(series.rows())


def write_outputs(result: SimResult, out_dir: Path, max_num_seqs: int, goodput: Goodput = Goodput(),
                  cost: AnyCostModel | None = None) -> dict:
    """metrics.json and requests.csv (real runs' keys), trace JSON per replica, timeseries.csv, and
    sim.json (what only a simulation knows: steps, replicas, each trace's summary, the cost model).
    A run timed by a transferred or what-if cost model is no like-for-like prediction, so its
    metrics.json says so too (``cost_model``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = result.log.summarize(result.duration_s, **goodput.seconds())
    if result.workload_clipped is not None and result.workload_clipped["requests"]:
        metrics["workload_clipped"] = result.workload_clipped  # a trace replayed with shorter lengths
    about = describe_cost_model(cost) if cost is not None else None
    if about and (about["transfer"] or "what_if" in about):
        metrics["cost_model"] = about
    write_metrics_json(metrics, out_dir / "metrics.json")
    result.log.write_csv(out_dir / "requests.csv")
    info: dict = {"num_steps": result.num_steps, "num_replicas": result.num_replicas, "cost_model": about,
                  "traces": {}}
    if result.steps or result.calls:
        for i in range(result.num_replicas):
            name = "trace.json" if result.num_replicas == 1 else f"trace_replica{i}.json"
            write_chrome_trace(result.replica_calls(i), out_dir / name, process_name=f"miniserve-sim-{i}")
            # the same calls as the file holds, not read back from it (a 557 MB file took 21 s)
            info["traces"][name] = summarize_calls(parse_calls(result.replica_calls(i)), max_num_seqs).to_dict()
    if result.timeseries is not None:
        write_timeseries_csv(result.timeseries, out_dir / "timeseries.csv")
    (out_dir / "sim.json").write_text(json.dumps(info, indent=2) + "\n")
    return metrics


def find_capacity(cost: AnyCostModel, scheduler: SchedulerConfig, workload: WorkloadConfig, low: float,
                  high: float, slo_ttft_p99_s: float | None, slo_tpot_p99_s: float | None,
                  rel_tol: float = 0.02, options: SimOptions = SimOptions()) -> CapacityResult:
    quick = replace(options, keep_token_times=False, trace=False, timeseries=False)
    return search_capacity(lambda wl: run_workload(cost, scheduler, wl, quick).metrics(), workload, low, high,
                           slo_ttft_p99_s, slo_tpot_p99_s, rel_tol)
