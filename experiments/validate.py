"""Validate the simulator against the real engine: same arrivals, same scheduler code, compare.

    python -m experiments.validate [model=tiny] [calibration.profile=P] [matrix.schedulers=[continuous]]
        [matrix.max_num_seqs=[4,8]] [matrix.arrivals=[poisson,gamma]] [matrix.load_levels=[0.3,0.6,0.9]]
        [matrix.seed_burst=true] [matrix.repeats=3] [bands.replicates=20]
        [workload=trace workload.path=FILE matrix.arrivals=[]] [hydra.run.dir=DIR]

Rows: the seed burst (matrix.seed_burst), and ``workload``'s lengths with each of
``matrix.arrivals`` at each load level (a fraction of the simulated saturation throughput of that
scheduler and cap); with ``matrix.arrivals=[]`` the workload runs as given (e.g. a trace).

The real side runs ``matrix.repeats`` times, each repeat in a fresh process that serves every row
(rows in a different order per repeat, so a slow spell of the machine lands on different rows). A
run that was contended (other processes used the CPU: calibration.contention, averaged over the
run; or its stamped read rate, its weights' where both it and the calibration have one, else a
fresh buffer's, is more than ``contention.memory_drift`` from the calibration's) is
flagged and run once more; only the last attempt of each repeat counts, and a re-run that was
contended again stays flagged (``contended_runs``). Every attempt is in real_runs.csv.

Per metric: the real median, min, max and coefficient of variation; the deterministic simulation's
error against the median; a row passes when |sim − median| ≤ max(tolerance, half the real spread
(max − min) / 2, relative to the median; occupancy's, a share that is 0 where a row never reaches
its cap, in points of that share: ABSOLUTE_KINDS). ``sim_moves``: how far the simulation moves when every
call is ``sensitivity`` (2%) slower or faster; a static batch that a request just makes or misses
can move a TTFT p50 by tens of percent for 2%, and a miss there says more about the metric than
the simulator (the table counts those that move past their tolerance as ill-conditioned).
With ``bands.replicates=N`` (100), N simulations with call times drawn from measured noise give
each metric's 5–95% band; coverage is the share of real runs inside it. Each replicate draws one memory bandwidth from the machine's history (the profile's,
or its calibration's stamps, and every other row's real runs as their calls saw it, never the
row's own) and a residual per call; validation.csv's ``band_source`` says which. Each timing metric also gets a leave-one-row-out band (sim.bands.conformal_band:
the row's simulation scaled by the 5–95% spread of real/simulated over every other row's real runs)
and its coverage: the band a user of this simulator on this machine can expect. ``sim_calls_noise``
(``bands.calls_noise`` replicates, 20): the median of replicates with the calls' own measured noise
and no run-wide draw, judged by the same rule (``ok_calls_noise``): a deterministic run has no
noise at all, so its tails sit at its medians (calibration.noise's ``call_lag1``). With three or
more repeats, ``repeat_ok``: how often one real run, held out, passes the same rule as the
prediction of the row's other runs, and ``sim_ok_held_out``: how often the simulation passes
against those same others. A repeat is what running the real thing once more gives: a reference,
not a bound (it is one noisy draw, the simulation a central estimate, which can pass more often);
a metric where the simulation passes less often than a repeat is where the simulator, not the
machine's noise, is short. Writes DIR/validation.csv, DIR/real_runs.csv (every attempt) and DIR/real_runs.json (also each
run's requests: ``real_runs=DIR/real_runs.json`` simulates against the same runs again) and prints the table.
Without a profile, a quick calibration runs first. ``use_run_bandwidth=true`` times each row's
simulation with the profile's physical model priced at the median bandwidth that row's real runs
saw: with ``run_bandwidth=weights`` (default) the calibration's, scaled by how fast each run's own
decode weights read against the calibration's (two stamps, independent of the calls); with
``run_bandwidth=calls``, or where a run or the profile has no weights stamp, the bandwidth its
calls saw (calibration.noise.calls_gb_s; the stamp around a run whose calls fit none); with
``run_bandwidth=machine`` that and the matmul rate its compute-bound calls saw
(calibration.noise.calls_machine), so a spell of the CPU in the prefills is not counted either.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import hydra
import numpy as np
import pandas as pd
from hydra.core.hydra_config import HydraConfig

from calibration import bandwidth_history
from calibration.contention import CONTENDED_SHARE, Interval
from calibration.cost_model import CostModel, other_kernels_warning, weights_read_gb_s
from calibration.noise import RunNoise, calibration_stamps, calls_gb_s, calls_machine
from calibration.physical import AnyCostModel, PhysicalCostModel, at_run_bandwidth
from calibration.roofline import MemoryStamp
from engine.core.config import ModelConfig, SchedulerConfig
from engine.core.engine_core import StepRecord
from engine.core.plan import BatchPlan
from engine.core.request import Request
from engine.observe.trace import parse_label, summarize_calls
from engine.observe.workload import PLACEHOLDER_STRIDE, WorkloadConfig, generate, make_requests
from experiments.fresh_process import in_fresh_process
from experiments.report_table import format_table
from experiments.schema import register, to_object
from sim.bands import BAND_METRICS, CALLS_ONLY, band, check_counts, conformal_band, inside, replicates, width
from sim.run import load_cost_model, saturation_rate
from sim.simulator import SimResult, simulate
from sim.executors import CostModelExecutor, physical_model

log = logging.getLogger(__name__)

SEED_BURST = WorkloadConfig()  # WorkloadConfig's defaults are the seed's burst


@dataclass
class Matrix:
    schedulers: list[str] = field(default_factory=lambda: ["static", "continuous"])
    max_num_seqs: list[int] = field(default_factory=lambda: [4, 8])
    seed_burst: bool = True
    arrivals: list[str] = field(default_factory=lambda: ["poisson", "gamma"])
    load_levels: list[float] = field(default_factory=lambda: [0.3, 0.6, 0.9])
    repeats: int = 3  # real runs per row, each repeat in a fresh process
    gamma_burstiness: float = 0.25  # the gamma shape of the gamma rows (1 would be Poisson)


@dataclass
class Contention:
    """When a real run does not count as this machine's own speed (it is flagged and run again once)."""

    others_cores: float = CONTENDED_SHARE  # other processes' mean CPU use over the run, in cores
    memory_drift: float = 0.20  # |run's read rate / calibration's − 1| (Stamps.judged_against: which stamps)


@dataclass
class ValidateBands:
    """Simulated replicates with the profile's measured call noise, for each metric's 5–95% band."""

    # 0: no bands. The band's ends are the order statistics holding a new draw with chance ≥ 90%
    # (sim.bands.prediction_ranks); more replicates make them less the luck of the draw
    replicates: int = 100
    seed: int = 0
    # the run-wide draw: "history" a memory bandwidth from the machine's stamps (the profile's
    # history or calibration stamps, and the other rows' real runs, never the row's own);
    # "rounds" a calibration round's factor (the band before the history)
    draw: str = "history"
    # what a real run adds to the history: "calls" the bandwidth its calls saw (through the
    # physical model, calibration.noise.calls_gb_s), "stamps" the probe stamped around it
    history: str = "calls"
    # beside the deterministic simulation, the median of this many replicates with the calls' own
    # measured noise and no run-wide draw (sim_calls_noise): the deterministic run has no noise, so
    # its tails (a TPOT p99) sit at its medians where a noisy machine's do not (0: none)
    calls_noise: int = 20

    def __post_init__(self) -> None:
        if self.draw not in ("history", "rounds"):
            raise ValueError(f"bands.draw must be history or rounds, got {self.draw!r}")
        if self.history not in ("calls", "stamps"):
            raise ValueError(f"bands.history must be calls or stamps, got {self.history!r}")
        check_counts(self)


@dataclass
class Tolerance:
    """Largest |sim − real| / real that passes, per kind of metric; occupancy's in absolute points of
    its share (ABSOLUTE_KINDS)."""

    throughput: float = 0.05
    p50: float = 0.05
    p99: float = 0.10
    calls: float = 0.05
    occupancy: float = 0.05


@dataclass
class ValidateCalibration:
    profile: str | None = None  # None: calibrate (grid below) into DIR/calibration first
    grid: str = "quick"


RUN_BANDWIDTHS = ("weights", "calls", "machine")  # what use_run_bandwidth prices a row at (row_cost)


@dataclass
class ValidateApp:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    calibration: ValidateCalibration = field(default_factory=ValidateCalibration)
    matrix: Matrix = field(default_factory=Matrix)
    tolerance: Tolerance = field(default_factory=Tolerance)
    contention: Contention = field(default_factory=Contention)
    bands: ValidateBands = field(default_factory=ValidateBands)
    real_runs: str | None = None  # a previous validation's real_runs.json: simulate against those runs again
    saturation_requests: int = 64  # burst size used to find each configuration's saturation rate
    # price the simulation of each row at the read bandwidth its real runs saw (the profile's
    # physical cost model; row_cost), so a slow spell of the host's memory, or a process whose
    # weights landed in slow memory, is not counted as error
    use_run_bandwidth: bool = False
    # what use_run_bandwidth prices a row at (run_gb_s): "weights", the calibration's bandwidth scaled
    # by the runs' own decode weights' read rate over the calibration's (placed_gb_s: stamps,
    # independent of the runs' calls; the calls' where either side has no such stamp), "calls"
    # (calls_gb_s: fitted to the runs' calls), or "machine": the calls' bandwidth and matmul rate
    # (calls_machine: fitted to the memory-bound calls' total and the compute-bound calls')
    run_bandwidth: str = "weights"
    # each row is also simulated with every call this much slower and faster (about a calibration's
    # held-out error plus a quiet host's drift between runs); validation.csv's sim_moves says how far
    # each metric moves. Where that is past the tolerance, a point prediction is luck (0: off)
    sensitivity: float = 0.02

    def __post_init__(self) -> None:
        if not 0 <= self.sensitivity < 1:
            raise ValueError(f"sensitivity must be in [0, 1), got {self.sensitivity!r}")
        if self.run_bandwidth not in RUN_BANDWIDTHS:
            raise ValueError(f"run_bandwidth must be one of {', '.join(RUN_BANDWIDTHS)}, got {self.run_bandwidth!r}")


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
# kinds judged by sim − real rather than relative to real: occupancy is a share of the busy time,
# 0 in a row that never reaches its cap, where any relative error is infinite (a sim of 0.056
# against a real 0 failed a 5% tolerance by "inf%")
ABSOLUTE_KINDS = frozenset({"occupancy"})


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
                    if arrival == "gamma":
                        wl = replace(wl, burstiness=app.matrix.gamma_burstiness)
                    rows.append(Row(f"{arrival}@{level:g}", scheduler, wl))
    return rows


def with_trace(metrics: dict, calls: list[tuple[str, float, float]], max_num_seqs: int) -> dict:
    trace = summarize_calls([parse_label(label, start, dur) for label, start, dur in calls], max_num_seqs)
    return {**metrics, "model_calls": trace.model_calls, "occupancy_at_max": trace.occupancy_at_max}


def rel_error(real: float, sim: float) -> float:
    if real == 0:
        return 0.0 if sim == 0 else math.inf
    return (sim - real) / real


@dataclass(frozen=True)
class Stamps:
    """Read rates around a run or a calibration (calibration.roofline.MemoryStamp): a fresh buffer's,
    and the model's own decode weights' (None where not stamped: GPUs, older profiles)."""

    memory_gb_s: float
    weights_gb_s: float | None = None

    def judged_against(self, calibration: Stamps) -> tuple[str, float, float]:
        """(which, ours, the calibration's): the weights' read rates where both sides have one — they
        follow what the calls stream, where a fresh buffer's stamp can read 20% off from one process
        to the next while the calls do not move (docs/architecture.md) — else the fresh buffers'."""
        if self.weights_gb_s is not None and calibration.weights_gb_s:
            return "weights", self.weights_gb_s, calibration.weights_gb_s
        return "memory", self.memory_gb_s, calibration.memory_gb_s


def contended(others_cores: float, run: Stamps, calibration: Stamps, limits: Contention) -> str:
    """Why a real run is not this machine's own speed ('' when it is)."""
    reasons = []
    if others_cores > limits.others_cores:
        reasons.append(f"others used {others_cores:.2f} cores")
    which, ours, theirs = run.judged_against(calibration)
    if theirs == theirs and theirs > 0:  # not NaN (old profile)
        drift = ours / theirs - 1
        if abs(drift) > limits.memory_drift:
            reasons.append(f"{which} {ours:.0f} GB/s vs calibration {theirs:.0f} ({drift:+.0%})")
    return "; ".join(reasons)


def real_run(engine, row: Row, calibration: Stamps, limits: Contention) -> dict:
    """One real run of a row: its metrics, the memory bandwidth and others' CPU use around it,
    whether that makes it contended, and its requests (arrival, lengths) for the simulator."""
    engine.reset(row.scheduler)
    engine.warmup()
    requests = make_requests(generate(row.workload), vocab_size=engine.runner.vocab_size, seed=row.workload.seed)
    prompts = {r.request_id: list(r.prompt_token_ids) for r in requests}
    with MemoryStamp(engine.runner.device, engine.runner.decode_weights()) as memory, Interval() as others:
        real = engine.run(requests)
    metrics = with_trace(real.metrics(), real.trace_calls(), row.scheduler.max_num_seqs)
    reason = contended(others.others_cores, Stamps(memory.gb_s, memory.weights_gb_s), calibration, limits)
    return {"metrics": metrics, "memory_gb_s": memory.gb_s, "weights_gb_s": memory.weights_gb_s,
            "others_cores": others.others_cores, "kernels": engine.runner.kernels_used(),
            "device": engine.runner.device.type,
            "contended": bool(reason), "reason": reason,
            # the prompts' ids too: with prefix caching, which requests share blocks is the run
            "replay": [(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens, prompts[r.request_id])
                       for r in real.records],
            # for side-by-side traces: each step (label, start, end, model call) and each request's
            # (id, arrival, first scheduled, first token)
            "steps": [(st.plan.label, st.start_s, st.end_s, st.model_s, list(st.plan.num_tokens),
                       list(st.plan.context_lens), list(st.plan.samples), st.plan.num_decodes) for st in real.steps],
            "first_tokens": [(r.request_id, r.arrival_s, r.first_scheduled_s, r.token_times_s[0]) for r in real.records]}


def real_repeat(app: ValidateApp, rows: list[Row], calibration: Stamps, repeat: int) -> list[dict]:
    """One repeat: a fresh process's engine serves every row (in an order of its own); a
    contended run is run once more, and both attempts are returned."""
    from engine.llm_engine import Engine
    from engine.model.runner import ModelRunner

    widest = replace(app.scheduler, max_num_seqs=max(r.scheduler.max_num_seqs for r in rows))
    engine = Engine(widest, app.model, runner=ModelRunner(app.model, widest))
    order = list(range(len(rows)))
    random.Random(repeat).shuffle(order)
    out = []
    for i in order:
        for attempt in range(2):
            run = {**real_run(engine, rows[i], calibration, app.contention), "row": i, "repeat": repeat,
                   "attempt": attempt, "meta": {"workload": rows[i].name, "scheduler": asdict(rows[i].scheduler)}}
            out.append(run)
            print(f"  repeat {repeat} {rows[i].name:14s} {rows[i].scheduler.name:10s} cap={rows[i].scheduler.max_num_seqs}: "
                  f"{run['metrics']['output_throughput_tok_s']:.2f} out tok/s, memory {run['memory_gb_s']:.0f} GB/s"
                  + (f", weights {run['weights_gb_s']:.0f}" if run["weights_gb_s"] is not None else "")
                  + (f"  CONTENDED ({run['reason']})" + ("; re-run" if attempt == 0 else "") if run["contended"] else ""),
                  flush=True)
            if not run["contended"]:
                break
    return out


def counted(runs: list[dict]) -> list[dict]:
    """The run that counts for each repeat: its last attempt."""
    last: dict[int, dict] = {}
    for run in runs:
        if run["repeat"] not in last or run["attempt"] > last[run["repeat"]]["attempt"]:
            last[run["repeat"]] = run
    return [last[k] for k in sorted(last)]


def row_passes(sim: float, real: list[float], tolerance: float, absolute: bool = False
               ) -> tuple[float, float, bool]:
    """(error against the real median, allowed error, pass): allowed is max(tolerance, half the
    real runs' min–max spread), both relative to the median (``absolute``: both as differences)."""
    median = statistics.median(real)
    half = (max(real) - min(real)) / 2
    if absolute:
        err = sim - median
    else:
        err, half = rel_error(median, sim), half / median if median else 0.0
    allowed = max(tolerance, half)
    return err, allowed, abs(err) <= allowed


def repeat_floor(sim: float, real: list[float], tolerance: float, absolute: bool = False
                 ) -> tuple[float, float] | None:
    """How often one real run, held out, passes as the prediction of the others, and how often the
    simulation passes against the same others (each by ``row_passes``, averaged over which run is
    held out). Judged on the same references, a repeat of the real run is the reference the
    simulation is measured against (not a bound: a repeat is one noisy draw, the simulation a
    central estimate). None under three runs."""
    if len(real) < 3:
        return None
    others = [real[:i] + real[i + 1:] for i in range(len(real))]
    repeat = sum(row_passes(v, rest, tolerance, absolute)[2] for v, rest in zip(real, others)) / len(real)
    simulated = sum(row_passes(sim, rest, tolerance, absolute)[2] for rest in others) / len(real)
    return repeat, simulated


def row_cost(cost: AnyCostModel, runs: list[dict], use_run_bandwidth: bool,
             source: str = "calls") -> AnyCostModel:
    """The cost model a row is simulated with: the profile's, or with ``use_run_bandwidth`` its
    physical model priced at the median over the row's real runs of the bandwidth each saw
    (``run_gb_s`` from ``source``), so a slow spell of the host's memory, or a process whose
    weights landed in slow memory, is not counted as simulator error. Where that is the calls'
    bandwidth (one number per run, fitted to its calls' total time) throughput under it is no
    independent test, but when and with whom each request is scheduled (TTFT, the batches) still
    is; the weights' stamps leave both. ``source`` "machine" also prices the compute-bound terms
    at the median matmul rate the runs' calls saw (``calls_gflops``): then the prefills' total is
    no test either, but each request's wait is. Where a run fitted no matmul rate, its bandwidth
    is its calls' over all of them (slow cores read as slow memory there), so the row is priced
    as ``calls`` then, not at one run's matmul rate over the others' bandwidths."""
    if not use_run_bandwidth:
        return cost
    used = counted(runs)
    if source == "machine" and any(r.get("calls_gflops") is None for r in used):
        source = "calls"
    priced = at_run_bandwidth(cost, runs_gb_s(runs, source))
    if source == "machine" and isinstance(priced, PhysicalCostModel):
        return priced.with_machine(matmul_gflops=statistics.median(r["calls_gflops"] for r in used))
    return priced


def run_gb_s(run: dict, source: str = "calls") -> float:
    """The read bandwidth a real run saw: with ``source`` "weights" as its weights' stamps place it
    (``placed_gb_s``) where both sides were stamped, with "machine" as its memory-bound calls'
    total does beside its compute-bound calls' (``machine_gb_s``, calls_machine); else its calls'
    (``calls_gb_s``), else the probe's stamp where no bandwidth fits its calls."""
    keys = {"weights": ("placed_gb_s", "calls_gb_s"), "calls": ("calls_gb_s",),
            "machine": ("machine_gb_s", "calls_gb_s")}
    for key in keys[source]:
        if run.get(key) is not None:
            return run[key]
    return run["memory_gb_s"]


def calibration_weights_gb_s(cost: AnyCostModel) -> float | None:
    """The calibration's own weights' read rate where a run's can be judged against it: None where
    the profile was calibrated in another dtype than this cost model runs (a transfer: a bf16 sum
    reads slower than an fp32 one, so the two rates would differ by the dtype alone)."""
    transfer = cost.info.get("transfer")
    if transfer and transfer.get("from_dtype") != transfer.get("to_dtype"):
        return None
    return weights_read_gb_s(cost.info)


def placed_gb_s(cost: AnyCostModel, run: dict) -> float | None:
    """The calibration's read bandwidth scaled by how fast this run's own decode weights read
    against the calibration's (calibration.roofline.MemoryStamp): a process whose weights landed in
    slower or faster memory than the calibration's, or a spell around the run, moves it, and the
    run's calls do not (unlike ``calls_gb_s``). None where either side has no weights stamp."""
    ours, theirs, memory = run.get("weights_gb_s"), calibration_weights_gb_s(cost), cost.memory_read_gb_s
    if ours is None or theirs is None or memory is None:
        return None
    return memory * ours / theirs


def runs_gb_s(runs: list[dict], source: str = "calls") -> float:
    """The read bandwidth a row's counted real runs saw: the median of ``run_gb_s``."""
    return statistics.median(run_gb_s(r, source) for r in counted(runs))


def run_call_limits(physical: PhysicalCostModel | None, run: dict
                    ) -> tuple[float | None, float | None, float | None]:
    """What a real run's calls saw, from its recorded steps (read once for both fits): the bandwidth
    alone (calibration.noise.calls_gb_s), and the bandwidth and matmul rate
    (calibration.noise.calls_machine); all None without a physical model."""
    if physical is None:
        return None, None, None
    calls = [(st.plan, st.model_s) for st in recorded_steps(run)]
    return (calls_gb_s(physical, calls), *calls_machine(physical, calls))


def recorded_steps(run: dict) -> list[StepRecord]:
    """A real run's steps as real_runs.json keeps them, with their plans' shapes (ids are placeholders)."""
    return [StepRecord(BatchPlan.of("replay", [f"q{j}" for j in range(len(tokens))], tokens, contexts, samples,
                                    decodes), start, end, model)
            for _, start, end, model, tokens, contexts, samples, decodes in run["steps"]]


def row_run_noise(cost: AnyCostModel, runs: list[dict], row: int, draw: str, history: str = "calls") -> RunNoise:
    """Where row ``row``'s replicates draw their run-wide component from. ``history``: the profile's
    bandwidth history (or, for a profile without one, the stamps its calibration took) plus the
    stamps of every other row's real runs, every attempt: what the machine gave over the
    validation. The row's own runs stay out, so its coverage is a prediction's, not a fit's.
    ``rounds``: the profile's calibration rounds, as before."""
    base = RunNoise.of_profile(cost.info)
    if draw == "rounds":
        return RunNoise((), base.round_log, base.source if not base.memory_gb_s else "calibration rounds")
    if not base.memory_gb_s:
        stamps = calibration_stamps(cost.info)
        base = RunNoise(tuple(stamps), base.round_log, f"{len(stamps)} calibration stamps")
    others = [r for r in runs if r["row"] != row]
    stamps = [run_gb_s(r) if history == "calls" else r["memory_gb_s"] for r in others]
    from_calls = [history == "calls" and r.get("calls_gb_s") is not None for r in others]
    called = sum(from_calls)
    how = "stamped" if not called else "as their calls saw it" if called == len(others) else \
        f"{called} as their calls saw it, the rest stamped"
    return base.with_stamps(stamps, f"{len(others)} of other rows' real runs, {how}", from_calls)


def replay_requests(replay: list[tuple], prefix_caching: bool = False) -> list[Request]:
    """Fresh requests with a real run's arrivals, lengths and prompt ids (real_runs.json's
    ``replay``). A replay kept before the ids were (four fields: lengths only) gets ids unique to
    each request, so no two share a cached block; with ``prefix_caching`` that would predict none
    of the real run's hits, so such a replay is refused."""
    if any(len(entry) < 5 for entry in replay):
        if prefix_caching:
            raise ValueError("these real runs kept only their prompts' lengths (real_runs.json from before "
                             "the prompts' ids were kept): with prefix caching the simulation needs their "
                             "content; run the real rows again")
        return [Request(rid, range(i * PLACEHOLDER_STRIDE, i * PLACEHOLDER_STRIDE + p), o, arrival_s=a)
                for i, (rid, a, p, o, *_) in enumerate(replay)]
    return [Request(rid, ids, o, arrival_s=a) for rid, a, p, o, ids in replay]


def replay_simulation(cost: AnyCostModel, row: Row, replay: list[tuple], time_scale: float = 1.0) -> SimResult:
    """The deterministic simulation of a real run's arrivals and lengths (real_runs.json's ``replay``)."""
    requests = replay_requests(replay, row.scheduler.enable_prefix_caching)
    return simulate(requests, row.scheduler, lambda: CostModelExecutor(cost, time_scale), keep_steps=True)


def simulate_replay(cost: AnyCostModel, row: Row, replay: list[tuple], time_scale: float = 1.0) -> dict:
    """The deterministic simulation of a row's replay: its metrics, with the trace's."""
    sim = replay_simulation(cost, row, replay, time_scale)
    return with_trace(sim.metrics(), sim.trace_calls(), row.scheduler.max_num_seqs)


def ttft_per_request_error(cost: AnyCostModel, row: Row, runs: list[dict], use_run_bandwidth: bool = False,
                           source: str = "calls") -> float:
    """How far the simulation puts each request's TTFT: every counted real run against a
    simulation of its own arrivals, request by request (sim / real − 1), the median over its
    requests, then over the runs. A row's TTFT p50 over two dozen requests can sit in a gap between
    two modes (an arrival that meets a step under way waits for it, one that does not goes straight
    in), where a few milliseconds move the order statistic by tens of percent; paired by request,
    the comparison does not depend on which side of the gap the median lands. With
    ``use_run_bandwidth`` each run is priced at its own machine (row_cost of that run alone), not
    the row's median. NaN for runs from before real_runs.json kept each request's first token."""
    per_run = []
    for run in counted(runs):
        if not run.get("first_tokens"):
            continue
        sim = replay_simulation(row_cost(cost, [run], use_run_bandwidth, source), row, run["replay"])
        simulated = {r.request_id: r.ttft_s for r in sim.records}
        errors = [simulated[rid] / (first - arrival) - 1 for rid, arrival, _, first in run["first_tokens"]
                  if first > arrival and math.isfinite(simulated.get(rid, math.nan))]
        if errors:
            per_run.append(statistics.median(errors))
    return statistics.median(per_run) if per_run else math.nan


def replicate_metrics(cost: AnyCostModel, row: Row, replay: list[tuple], n: int, seed: int,
                      run_noise: RunNoise | None = None) -> list[dict]:
    """The metrics of ``n`` noisy replicates of a row's replay (sim.bands.replicates)."""
    caching = row.scheduler.enable_prefix_caching
    reps = (replicates(lambda: replay_requests(replay, caching), row.scheduler, cost, n, seed, run_noise=run_noise,
                       keep_steps=True) if n else [])
    return [with_trace(r.metrics(), r.trace_calls(), row.scheduler.max_num_seqs) for r in reps]


def simulate_row(cost: AnyCostModel, row: Row, replay: list[tuple], keep: int, seed: int,
                 run_noise: RunNoise | None = None) -> tuple[dict, list[dict]]:
    """The deterministic simulation on the real run's arrivals and lengths, and ``keep`` noisy replicates."""
    return simulate_replay(cost, row, replay), replicate_metrics(cost, row, replay, keep, seed, run_noise)


def row_moves(cost: AnyCostModel, row: Row, replay: list[tuple], sim_m: dict, by: float) -> dict[str, float]:
    """How far each metric of the deterministic simulation ``sim_m`` moves when every call takes
    ``by`` longer or shorter (the larger of the two relative moves). Where a static batch that a
    request just makes or just misses decides a percentile, a machine 2% slower or faster can move
    it by tens of percent: a metric that moves past its tolerance so is ill-conditioned, and a
    prediction of it is only as good as the machine's speed is known."""
    moved = [simulate_replay(cost, row, replay, scale) for scale in (1 - by, 1 + by)]
    return {metric: max(abs(float(read(m)) - float(read(sim_m))) if kind in ABSOLUTE_KINDS
                        else abs(rel_error(float(read(sim_m)), float(read(m)))) for m in moved)
            for metric, read, kind in METRICS}


def compare_row(row: Row, runs: list[dict], sim_m: dict, replicate_m: list[dict], tolerance: dict,
                calibration_gb_s: float, band_source: str = "", moves: dict[str, float] | None = None,
                calibration_weights_gb_s: float = math.nan, source: str = "calls",
                calls_noise_m: Sequence[dict] = (), ttft_request_error: float = math.nan) -> list[dict]:
    """validation.csv's records of one row, one per metric; with ``calls_noise_m`` (replicates
    with the calls' own noise only), their median and whether it passes, beside the deterministic
    simulation's; ``ttft_request_error`` (ttft_per_request_error) on the row's TTFT p50 record."""
    used = counted(runs)
    seen_gb_s = runs_gb_s(runs, source)
    weights = [r["weights_gb_s"] for r in used if r.get("weights_gb_s") is not None]  # none in older real_runs
    gflops = [r["calls_gflops"] for r in used if r.get("calls_gflops") is not None]
    records = []
    for metric, read, kind in METRICS:
        real = [float(read(r["metrics"])) for r in used]
        sim = float(read(sim_m))
        absolute = kind in ABSOLUTE_KINDS
        err, allowed, ok = row_passes(sim, real, tolerance[kind], absolute)
        mean = float(np.mean(real))
        rec = {"workload": row.name, "scheduler": row.scheduler.name, "max_num_seqs": row.scheduler.max_num_seqs,
               "metric": metric, "real": statistics.median(real), "real_min": min(real), "real_max": max(real),
               "real_cv": float(np.std(real) / mean) if mean else 0.0, "real_runs": len(real),
               "contended_runs": sum(r["contended"] for r in used), "reruns": len(runs) - len(used),
               "sim": sim, "rel_error": err, "tolerance": tolerance[kind], "allowed": allowed, "ok": ok,
               "memory_gb_s": statistics.median(r["memory_gb_s"] for r in used), "runs_gb_s": seen_gb_s,
               # the matmul rate the runs' compute-bound calls saw (calls_machine; run_bandwidth=machine's)
               "runs_gflops": statistics.median(gflops) if gflops else math.nan,
               "calibration_memory_gb_s": calibration_gb_s,
               # the runs' and the calibration's own decode weights' read rates (MemoryStamp)
               "weights_gb_s": statistics.median(weights) if weights else math.nan,
               "calibration_weights_gb_s": calibration_weights_gb_s, "_real": real}
        if metric == "ttft_p50":
            rec["ttft_per_request_error"] = ttft_request_error
        floor = repeat_floor(sim, real, tolerance[kind], absolute)
        if floor is not None:
            rec["repeat_ok"], rec["sim_ok_held_out"] = floor
        if moves is not None:
            rec["sim_moves"] = moves[metric]
        if calls_noise_m:
            noisy = float(np.median([float(read(m)) for m in calls_noise_m]))
            _, _, rec["ok_calls_noise"] = row_passes(noisy, real, tolerance[kind], absolute)
            rec["sim_calls_noise"] = noisy
            noisy_floor = repeat_floor(noisy, real, tolerance[kind], absolute)
            if noisy_floor is not None:
                rec["calls_noise_ok_held_out"] = noisy_floor[1]
        if replicate_m:
            b = band([float(read(m)) for m in replicate_m])
            rec.update(band_p5=b["p5"], band_p50=b["p50"], band_p95=b["p95"], band_width=width(b),
                       band_hits=sum(inside(v, b) for v in real), band_source=band_source)
        records.append(rec)
    return records


def run_validation(app: ValidateApp, out_dir: Path) -> pd.DataFrame:
    out_dir.mkdir(parents=True, exist_ok=True)
    profile = app.calibration.profile
    if profile is None:
        from calibration.calibrate import CalibrationConfig
        from experiments.calibrate import CalibrateApp, calibrate

        profile = str(calibrate(CalibrateApp(app.model, CalibrationConfig(grid=app.calibration.grid)),
                                out_dir / "calibration"))
    cost = load_cost_model(profile, app.model, physical=app.use_run_bandwidth)
    tolerance = vars(app.tolerance)
    calibration_gb_s = math.nan if cost.memory_read_gb_s is None else cost.memory_read_gb_s  # older profiles
    rows = matrix_rows(app, cost)
    runs: list[dict] = []
    if app.real_runs:  # the same real runs against another profile or simulator
        runs = json.loads(Path(app.real_runs).read_text())
        if {r["row"] for r in runs} != set(range(len(rows))):
            raise ValueError(f"{app.real_runs} holds other rows than this matrix")
    stamps = Stamps(calibration_gb_s, calibration_weights_gb_s(cost))  # what each run is judged against
    for repeat in range(0 if app.real_runs else app.matrix.repeats):
        runs += in_fresh_process(real_repeat, app, rows, stamps, repeat)  # a fresh process per repeat
    warn_other_kernels(cost, runs)
    physical = physical_model(cost)
    for r in runs:
        r["calls_gb_s"], r["machine_gb_s"], r["calls_gflops"] = run_call_limits(physical, r)
        r["placed_gb_s"] = placed_gb_s(cost, r)
    if not app.real_runs:  # fresh runs join this machine's history, for later calibrations' profiles
        from engine.model.loader import config_fingerprint  # here: this process runs no model itself

        threads = app.model.num_threads or cost.info.get("measured_on", {}).get("threads") or os.cpu_count()
        fingerprint = config_fingerprint(app.model)
        bandwidth_history.record(threads, fingerprint, [r["calls_gb_s"] for r in runs if r["calls_gb_s"] is not None],
                                 bandwidth_history.CALLS_SOURCES[0])
        bandwidth_history.record(threads, fingerprint, [r["memory_gb_s"] for r in runs if r["calls_gb_s"] is None],
                                 "validate run stamp")
    (out_dir / "real_runs.json").write_text(json.dumps(runs))
    pd.DataFrame.from_records([{"row": r["row"], "workload": rows[r["row"]].name,
                                "scheduler": rows[r["row"]].scheduler.name,
                                "max_num_seqs": rows[r["row"]].scheduler.max_num_seqs, "repeat": r["repeat"],
                                "attempt": r["attempt"], "contended": r["contended"], "reason": r["reason"],
                                "memory_gb_s": r["memory_gb_s"], "weights_gb_s": r.get("weights_gb_s"),
                                "calls_gb_s": r["calls_gb_s"], "placed_gb_s": r["placed_gb_s"],
                                "machine_gb_s": r["machine_gb_s"], "calls_gflops": r["calls_gflops"],
                                "others_cores": r["others_cores"],
                                **{m: float(read(r["metrics"])) for m, read, _ in METRICS}} for r in runs]
                              ).to_csv(out_dir / "real_runs.csv", index=False)
    records = []
    for i, row in enumerate(rows):
        mine = [r for r in runs if r["row"] == i]
        noise = row_run_noise(cost, runs, i, app.bands.draw, app.bands.history)
        if i == 0 and app.bands.replicates:
            print(f"  bands: {app.bands.replicates} replicates, each a residual per call and a {noise.describe()}"
                  + (" (this row's own runs left out)" if noise.memory_gb_s else ""), flush=True)
        cost_row = row_cost(cost, mine, app.use_run_bandwidth, app.run_bandwidth)
        sim_m, rep_m = simulate_row(cost_row, row, mine[0]["replay"], app.bands.replicates, app.bands.seed, noise)
        calls_m = replicate_metrics(cost_row, row, mine[0]["replay"], app.bands.calls_noise, app.bands.seed, CALLS_ONLY)
        moves = row_moves(cost_row, row, mine[0]["replay"], sim_m, app.sensitivity) if app.sensitivity else None
        records += compare_row(row, mine, sim_m, rep_m, tolerance, calibration_gb_s, noise.describe(), moves,
                               weights_read_gb_s(cost.info) or math.nan, app.run_bandwidth, calls_m,
                               ttft_per_request_error(cost, row, mine, app.use_run_bandwidth, app.run_bandwidth))
        used = counted(mine)
        print(f"  {row.name:14s} {row.scheduler.name:10s} cap={row.scheduler.max_num_seqs}: real "
              f"{statistics.median(r['metrics']['output_throughput_tok_s'] for r in used):.2f} (median of {len(used)}) "
              f"vs sim {sim_m['output_throughput_tok_s']:.2f} out tok/s; contended {sum(r['contended'] for r in used)}, "
              f"re-run {len(mine) - len(used)}", flush=True)
    add_conformal_bands(records)
    df = pd.DataFrame.from_records([{k: v for k, v in rec.items() if k != "_real"} for rec in records])
    df.to_csv(out_dir / "validation.csv", index=False)
    return df


def warn_other_kernels(cost: AnyCostModel, runs: list[dict]) -> None:
    """Log once per kernel set where the real runs' calls took other kernels than the profile's
    (calibration.cost_model.other_kernels_warning); runs from before they were kept say nothing."""
    seen = {json.dumps([r["kernels"], r.get("device")], sort_keys=True) for r in runs if r.get("kernels")}
    for kernels, device in (json.loads(s) for s in sorted(seen)):
        warning = other_kernels_warning(cost.info.get("measured_on", {}), kernels, device)
        if warning:
            log.warning(warning)


def add_conformal_bands(records: list[dict], level: float = 0.90) -> None:
    """Each timing metric's leave-one-row-out band (sim.bands.conformal_band: the row's simulation
    scaled by how far every other row's real runs fell from theirs) and how many of the row's
    real runs it holds. Needs the real runs of two other rows."""
    for rec in records:
        if rec["metric"] not in BAND_METRICS or not rec["sim"] > 0:
            continue
        ratios = [v / other["sim"] for other in records
                  if other is not rec and other["metric"] == rec["metric"] and other["sim"] > 0
                  for v in other["_real"] if v > 0]
        if len(ratios) < 2:
            continue
        b = conformal_band(rec["sim"], ratios, level)
        rec.update(conformal_p5=b["p5"], conformal_p95=b["p95"], conformal_width=width(b),
                   conformal_hits=sum(inside(v, b) for v in rec["_real"]))


# repeat_floor's pass rates, as format_validation heads them
HELD_OUT = {"sim_ok_held_out": "sim", "calls_noise_ok_held_out": "calls noise", "repeat_ok": "repeat"}


def format_validation(df: pd.DataFrame) -> str:
    """Per metric: median and worst |error| against the real median, how many rows pass
    max(tolerance, half the spread), the real runs' median CV, how often the simulation and a
    held-out real run pass against a row's other runs (repeat_floor), how far the simulation moves with
    the machine's speed (median; and in how many rows past the tolerance), band coverage and
    median width."""
    rows = []
    for metric, _, kind in METRICS:
        sel = df[df.metric == metric]
        errs = sel.rel_error.abs()
        line = [metric + (" (points)" if kind in ABSOLUTE_KINDS else ""), f"{errs.median():.1%}", f"{errs.max():.1%}", f"{sel.tolerance.iloc[0]:.0%}",
                f"{int(sel.ok.sum())}/{len(sel)}", f"{sel.real_cv.median():.1%}"]
        if "repeat_ok" in sel:
            line += [" / ".join(f"{sel[c].sum():.1f}" for c in HELD_OUT if c in sel)]
        if "sim_moves" in sel:
            line += [f"{sel.sim_moves.median():.1%}", f"{ill_conditioned(sel)}"]
        for kind in ("band", "conformal"):
            if f"{kind}_hits" in sel:
                has = sel[sel[f"{kind}_hits"].notna()]
                line += ([f"{has[f'{kind}_hits'].sum() / has.real_runs.sum():.0%}", f"{has[f'{kind}_width'].median():.1%}"]
                         if len(has) else ["", ""])
        rows.append(line)
    head = ["metric", "median |err|", "worst |err|", "tolerance", "pass", "real CV"]
    if "repeat_ok" in df:
        head += ["held out: " + " / ".join(name for c, name in HELD_OUT.items() if c in df)]
    if "sim_moves" in df:
        head += ["sim moves", "ill-conditioned"]
    if "band_hits" in df:
        head += ["in 90% band", "band width"]
    if "conformal_hits" in df:
        head += ["in LORO band", "LORO width"]
    return format_table(head, rows)


def coverage(df: pd.DataFrame, kind: str = "band") -> float:
    """Share of real runs' metrics inside the ``kind`` band: ``band`` (the replicates' 5–95%) or
    ``conformal`` (leave-one-row-out); over the metrics that have one."""
    has = df[df[f"{kind}_hits"].notna()]
    return float(has[f"{kind}_hits"].sum() / has.real_runs.sum())


def per_request_summary(df: pd.DataFrame, within: float = 0.05) -> str:
    """The summary's clause on ttft_per_request_error ("" where no row has one)."""
    if "ttft_per_request_error" not in df:
        return ""
    errs = df[df.metric == "ttft_p50"].ttft_per_request_error.dropna().abs()
    if errs.empty:
        return ""
    return (f"; TTFT request by request (each real run against a simulation of its own arrivals): "
            f"median |error| {errs.median():.1%}, {int((errs <= within).sum())}/{len(errs)} rows within "
            f"{within:.0%} (ttft_per_request_error)")


def ill_conditioned(df: pd.DataFrame) -> int:
    """Comparisons whose simulation moves past their metric's tolerance with a small change of the
    machine's speed (``sim_moves``): a miss there says more about the metric than the simulator."""
    return int((df.sim_moves > df.tolerance).sum())


@hydra.main(version_base="1.3", config_path="../conf", config_name="validate")
def main(cfg) -> None:
    app: ValidateApp = to_object(cfg, runs_model=True)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    df = run_validation(app, out_dir)
    print(format_validation(df))
    flagged = int((df[df.metric == METRICS[0][0]].contended_runs > 0).sum())
    print(f"\n{int(df.ok.sum())}/{len(df)} comparisons within max(tolerance, half the real spread); "
          f"{flagged} rows kept a contended run (flagged)"
          + (f"; band coverage {coverage(df):.0%} (replicates)" if "band_hits" in df else "")
          + (f", {coverage(df, 'conformal'):.0%} (leave-one-row-out)" if "conformal_hits" in df else "")
          + (f"; against a row's other real runs (each held out in turn) the simulation passes "
             f"{df.sim_ok_held_out.sum():.1f}"
             + (f" (calls-noise median {df.calls_noise_ok_held_out.sum():.1f})" if "calls_noise_ok_held_out" in df else "")
             + f", the held-out real run itself {df.repeat_ok.sum():.1f} (repeat_ok), of the "
             f"{int(df.repeat_ok.notna().sum())} comparisons with three runs or more"
             if "repeat_ok" in df and df.repeat_ok.notna().any() else "")
          + (f"; the median of {app.bands.calls_noise} replicates with the calls' own noise (sim_calls_noise): "
             f"{int(df.ok_calls_noise.sum())}/{len(df)}" if "ok_calls_noise" in df else "")
          + (f"; {ill_conditioned(df)} comparisons move past their tolerance when every call is "
             f"{app.sensitivity:.0%} slower or faster (sim_moves), {ill_conditioned(df[~df.ok])} of those that miss"
             if "sim_moves" in df else "")
          + per_request_summary(df)
          + f"; wrote {out_dir / 'validation.csv'}")


if __name__ == "__main__":
    main()
