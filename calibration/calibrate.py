"""One calibration: measure the grid on the real runner, fit, score, and build the profile."""

from __future__ import annotations

import datetime
import functools
import logging
import platform
import time
from collections.abc import Callable
from operator import attrgetter
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from calibration.cost_model import (FEATURES, SAMPLE_KNOTS, TOKEN_KNOTS, CostModel, pass_edges, plan_features,
                                   stamped_gb_s, unmeasured_edges)
from calibration.fit import Errors, fit_nnls_on_knots, knot_map, split_heldout, supported_knots
from calibration.physical import (PHYSICAL_FEATURES, ROW_KNOTS, Machine as PhysicalMachine, PhysicalCostModel, PhysicalShape,
                                  physical_features)
from calibration.budget import MeasurePlan, plan_measurement, price_calls
from calibration.grid import GRID_SPECS, GridSpec, Shape, build_grid, edge_prompts
from calibration.kv_copy import measure_kv_copy
from calibration.bandwidth_history import profile_history
from calibration.noise import calibration_stamps, noise_report
from calibration.profiler import (IDLE_SHAPES, IDLE_STEP_PROMPT, IDLE_STEPS, Measurement, Robustness, ShapePool,
                                  after_idle_sleep_s, at_bandwidth, execute_uncontended, idle_step_gap_s, make_runner,
                                  measure_after_idle, measure_engine_runs, measure_shapes, spread, threads_of)
from calibration.roofline import (Machine, MemoryStamp, ModelShape, call_work, measure_machine, placement_ratio,
                                  memory_read_gb_s, roofline_s, best_s, tensors_read_gb_s)
from engine.core.config import ModelConfig
from engine.core.model_shape import model_shape
from engine.model.device import describe, device_has_bf16 as bf16_native, resolve
from engine.model.loader import config_fingerprint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationConfig:
    grid: str = "full"
    heldout_fraction: float = 0.25
    repeats: int | None = None  # None: the grid's own
    warmup: int = 1
    overhead_runs: int = 3  # engine runs timed for the step overhead; their calls join the fit, a shape's runs as its repeats
    seed: int = 0
    progress: bool = True
    robust: Robustness = field(default_factory=Robustness)
    # the whole calibration's wall time it aims at, model build to fit (calibration.budget: on a slow
    # machine the grid is thinned to fit); None: the grid as written, however long it takes
    time_budget_s: float | None = 300.0

    def __post_init__(self) -> None:
        if self.grid not in GRID_SPECS:
            raise ValueError(f"calibration.grid must be one of {tuple(GRID_SPECS)}, got {self.grid!r}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"calibration.time_budget_s must be positive or null, got {self.time_budget_s!r}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError("calibration.heldout_fraction must be in (0, 1)")
        if self.repeats is not None and self.repeats < 1:
            raise ValueError(f"calibration.repeats must be >= 1 or null (the grid's own), got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"calibration.warmup must be >= 0, got {self.warmup}")
        if self.overhead_runs < 1:  # the step overhead and the engine calls come from these runs
            raise ValueError(f"calibration.overhead_runs must be >= 1, got {self.overhead_runs}")


@dataclass
class Calibration:
    """Everything a calibration produced; ``cost_model`` is what the simulator loads."""

    cost_model: CostModel
    measurements: list[Measurement]
    heldout: np.ndarray
    predicted_s: np.ndarray
    roofline_s: np.ndarray
    wall_s: float


def pinned(xs, knots: tuple[int, ...], free: frozenset[int]) -> list[bool]:
    """The knots the calls ``xs`` pin down (calibration.fit.supported_knots) but those left ``free``
    (cost_model.unmeasured_edges): those follow their neighbours."""
    return [s and k not in free for k, s in zip(knots, supported_knots(xs, knots))]


def fit_cost_model(measurements: list[Measurement], heldout: np.ndarray,
                   free: frozenset[int] = frozenset()) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients fitted on the rows not held out, and every row's prediction; the token knots in
    ``free`` follow their neighbours (``pinned``)."""
    X = np.asarray([plan_features(m.plan) for m in measurements])
    y = np.asarray([m.typical_s for m in measurements])
    train = [m.plan for m, held in zip(measurements, heldout) if not held]
    tokens = knot_map(TOKEN_KNOTS, pinned([p.total_tokens for p in train], TOKEN_KNOTS, free), proportional=True)
    samples = knot_map(SAMPLE_KNOTS, supported_knots((p.num_samples for p in train if p.num_samples), SAMPLE_KNOTS),
                       proportional=True)
    coef = fit_nnls_on_knots(X[~heldout], y[~heldout], [(FEATURES.index(f"tokens@{TOKEN_KNOTS[0]}"), tokens),
                                                        (FEATURES.index(f"samples@{SAMPLE_KNOTS[0]}"), samples)])
    return coef, X @ coef


def fit_physical(measurements: list, heldout: np.ndarray, shape: PhysicalShape,
                 machine: PhysicalMachine, free: frozenset[int] = frozenset()) -> tuple[np.ndarray, np.ndarray]:
    """The physical model's inefficiencies fitted on the rows not held out (NNLS on relative error,
    as the empirical model), and every row's prediction. The efficiency curve's knots are pinned by
    the calls' total rows only: a mixed call's sampled rows run just the lm_head, a few percent of
    its time, and one such call at 5 sampled rows, on a grid with no 5-row call, set the curve to
    7.7x there to absorb its own noise (a 5-decode step then cost 820 ms, measured 150)."""
    X = np.asarray([physical_features(m.plan, shape, machine) for m in measurements])
    y = np.asarray([m.median_s for m in measurements])
    train = [m.plan for m, held in zip(measurements, heldout) if not held]
    curve = knot_map(ROW_KNOTS, pinned([p.total_tokens for p in train], ROW_KNOTS, free), proportional=False)
    coef = fit_nnls_on_knots(X[~heldout], y[~heldout], [(PHYSICAL_FEATURES.index(f"rows@{ROW_KNOTS[0]}"), curve)])
    return coef, X @ coef


def physical_block(measurements: list, heldout: np.ndarray, shape: PhysicalShape, machine: PhysicalMachine,
                   step_overhead_s: float, free: frozenset[int] = frozenset()
                   ) -> tuple[PhysicalCostModel, np.ndarray, dict]:
    """Fit the physical model; its model, predictions and error table (the same table as the
    empirical model's)."""
    coef, predicted = fit_physical(measurements, heldout, shape, machine, free)
    cost = PhysicalCostModel(tuple(float(c) for c in coef), shape, machine, step_overhead_s)
    y = np.asarray([m.median_s for m in measurements])
    kinds = np.asarray([m.shape.kind for m in measurements])
    fit = {"train": Errors.of(predicted[~heldout], y[~heldout]).to_dict(),
           "heldout": Errors.of(predicted[heldout], y[heldout]).to_dict(), "by_kind_heldout": {}}
    for kind in np.unique(kinds):
        sel = heldout & (kinds == kind)
        if sel.any():
            fit["by_kind_heldout"][str(kind)] = Errors.of(predicted[sel], y[sel]).to_dict()
    return cost, predicted, fit


def preferred_model(empirical_fit: dict, physical_fit: dict) -> str:
    """The model the profile's own model simulates with: the one with the lower held-out MAPE
    (a transfer or a what-if always uses the physical one)."""
    return "physical" if physical_fit["heldout"]["mape"] < empirical_fit["heldout"]["mape"] else "empirical"


def add_physical(profile: dict, shape: PhysicalShape, machine: PhysicalMachine | None = None) -> dict:
    """Fit the physical model on a saved profile's measurements (their plan records and held-out
    split) and return the profile with its ``physical`` block and ``preferred`` model: a profile
    from before the physical model gains one without re-measuring."""
    from calibration.grid import Shape
    from calibration.profiler import Measurement

    if machine is None:
        machine = PhysicalMachine(stamped_gb_s(profile["memory_read_gb_s"]),
                                  profile["roofline"]["machine"]["matmul_flops_s"] / 1e9)
    rows = profile["measurements"]
    ms = [Measurement(Shape(r["kind"]), plan_from_record(r["plan"]), tuple(r["times_s"])) for r in rows]
    heldout = np.asarray([r["heldout"] for r in rows])
    free = unmeasured_edges(profile.get("grid", {}).get("spec", {}).get("edge_chunks", ()))
    cost, _, fit = physical_block(ms, heldout, shape, machine, profile.get("step_overhead_s", 0.0), free)
    return {**profile, "physical": {**cost.to_dict(), "fit": fit},
            "preferred": preferred_model(profile["fit"], fit)}


def plan_from_record(record: dict):
    """The BatchPlan a profile's ``plan`` record describes (plan_record's inverse)."""
    from engine.core.plan import BatchPlan

    n = len(record["num_tokens"])
    return BatchPlan.of("calibration", [f"r{i}" for i in range(n)], record["num_tokens"], record["context_lens"],
                        record["samples"], record["num_decodes"])


def error_table(measurements: list[Measurement], predicted: np.ndarray, baseline: np.ndarray,
                heldout: np.ndarray) -> dict:
    y = np.asarray([m.typical_s for m in measurements])
    kinds = np.asarray([m.shape.kind for m in measurements])
    out = {"train": Errors.of(predicted[~heldout], y[~heldout]).to_dict(),
           "heldout": Errors.of(predicted[heldout], y[heldout]).to_dict(),
           "roofline_heldout": Errors.of(baseline[heldout], y[heldout]).to_dict(),
           "by_kind_heldout": {}}
    for kind in np.unique(kinds):
        sel = heldout & (kinds == kind)
        if sel.any():
            out["by_kind_heldout"][str(kind)] = Errors.of(predicted[sel], y[sel]).to_dict()
    out["heldout_mape"] = out["heldout"]["mape"]
    out["heldout_max_error"] = out["heldout"]["max_error"]
    out["heldout_r2"] = out["heldout"]["r2"]
    return out


def as_timed(m: Measurement) -> Measurement:
    """The measurement with its times as timed (``at_usual_bandwidth`` undone)."""
    return replace(m, times_s=m.raw_times_s, raw_times_s=()) if m.raw_times_s else m


def memory_share(plan, shape: ModelShape, machine: Machine) -> float:
    """The share of a call's roofline time spent reading memory: how much of it stretches when
    the bandwidth moves (calibration.profiler.at_bandwidth)."""
    nbytes, flops = call_work(plan, shape)
    memory_s, compute_s = nbytes / machine.bandwidth_bytes_s, flops / machine.matmul_flops_s
    return memory_s / (memory_s + compute_s)


def at_usual_bandwidth(measurements: list[Measurement], shape: ModelShape, machine: Machine
                       ) -> tuple[list[Measurement], dict]:
    """Each stamped call's time as it would have been at the calibration's usual bandwidth (the
    median of the grid calls' weights stamps): at_bandwidth with the call's memory_share. On a
    shared host the bandwidth can move within a call's length, and a shape's few repeats fall in
    whatever spells they fall in (docs/architecture.md). The engine calls, stamped per serving run
    (measure_engine_runs), are put at the grid's usual too; unstamped calls stay as timed. Returns
    the measurements (as timed in ``raw_times_s``) and what the profile says of it (``{}`` where
    no call was stamped)."""
    stamps = [w for m in measurements for w in m.stamps_gb_s]
    if not stamps:
        return measurements, {}
    grid = [w for m in measurements if m.shape.kind != "engine" for w in m.stamps_gb_s]
    usual = float(np.median(grid or stamps))
    out = []
    for m in measurements:
        if not m.stamps_gb_s:
            out.append(m)
            continue
        at_usual = at_bandwidth(m.times_s, m.stamps_gb_s, usual, memory_share(m.plan, shape, machine))
        out.append(replace(m, times_s=at_usual, raw_times_s=m.times_s))
    # over the undisturbed repeats, as the profile's noise.shape_spread
    spreads = [(spread(as_timed(m).clean_times_s), spread(m.clean_times_s)) for m in out
               if len(m.clean_times_s) > 1 and m.shape.kind != "engine"]
    return out, {"usual_weights_gb_s": usual, "call_stamps": len(grid),
                 "engine_calls_stamped": len(stamps) - len(grid),
                 "call_stamps_p10_p90": [float(x) for x in np.percentile(grid or stamps, [10, 90])],
                 "shape_spread_median_as_timed": float(np.median([a for a, _ in spreads])) if spreads else 0.0,
                 "shape_spread_median_at_usual": float(np.median([b for _, b in spreads])) if spreads else 0.0}


def run_calibration(model_config: ModelConfig, cfg: CalibrationConfig) -> Calibration:
    t0 = time.perf_counter()
    model_config = resolve(threads_of(model_config))  # the profile records the concrete device and dtype
    spec = GRID_SPECS[cfg.grid]
    shapes = build_grid(spec)
    max_len = max(s.max_len for s in shapes)
    slots = max(spec.max_seqs, max(s.num_requests for s in shapes))
    runner = make_runner(model_config, slots, max_len)
    spec = with_pass_edges(spec, runner.pass_rows)
    shapes = build_grid(spec)
    log.info("prompts at %s rows: both sides of each step of %s", ", ".join(map(str, spec.edge_chunks)),
             f"the gemv's {runner.pass_rows}-row passes" if runner.pass_rows else "6- and 8-row passes (no gemv here)")
    pool = ShapePool(runner, slots, max_len, seed=cfg.seed)
    idle_shapes = [s for s in IDLE_SHAPES if s.max_len <= max_len and s.num_requests <= slots]
    idle_levels = idle_levels_in_budget(spec.idle_levels, len(idle_shapes), cfg.time_budget_s)
    stamp = functools.partial(memory_read_gb_s, device=runner.device)  # fresh memory where the weights sit
    weights = runner.decode_weights()
    weights_stamp = functools.partial(tensors_read_gb_s, weights, device=runner.device) if weights else None
    call_stamp = functools.partial(tensors_read_gb_s, weights, max_bytes=CALL_STAMP_BYTES, repeats=1,
                                   device=runner.device) if weights and cfg.robust.stamp_calls else None
    # the machine's limit first: each shape's memory share (what a moved bandwidth stretches) is
    # known while measuring, so extra rounds go to shapes wide at the usual bandwidth
    machine = measure_machine(runner.model.dtype, device=runner.device)
    mshape = ModelShape.of(runner.model)
    sleeps_s = after_idle_sleep_s(len(idle_shapes), idle_levels)
    plan = plan_to_budget(pool, shapes, cfg, spec.repeats, t0, sleeps_s, call_stamp, idle_steps=IDLE_STEPS)
    shares = [memory_share(s.to_plan(pool.request_ids), mshape, machine) for s in plan.shapes]
    # with a time budget, what it leaves for measuring bounds the retries and extra rounds too
    robust = cfg.robust if plan.budget_s is None else replace(cfg.robust, budget_s=plan.budget_s)
    with MemoryStamp(runner.device, weights) as memory:
        measurements, mlog = measure_shapes(pool, plan.shapes, plan.repeats, plan.warmups, cfg.seed,
                                            cfg.progress, robust, stamp, weights_stamp, call_stamp, shares)
        after_idle = measure_after_idle(pool, idle_shapes, idle_levels)
        log.info("a call after idle costs more by " + ", ".join(
            f"{1e3 * level['extra_s']:.1f} ms after {level['idle_s']:g} s" for level in after_idle["levels"]))
        pool.release()
        overhead, engine_calls = measure_engine_runs(runner, min(8, slots), cfg.overhead_runs, call_stamp)
        copy = measure_kv_copy(runner)
    placement = placement_ratio(weights, runner.device)  # the weights over a fresh buffer, back to back
    measurements, usual = at_usual_bandwidth(measurements + engine_calls, mshape, machine)

    heldout = split_heldout([m.shape.kind for m in measurements], cfg.heldout_fraction, cfg.seed)
    # a pass edge's prompt is its knot's one shape: held out, the fit would draw a line across the step
    edges = set(edge_prompts(spec))
    heldout &= ~np.asarray([m.shape in edges for m in measurements])
    free = unmeasured_edges(spec.edge_chunks)  # the other block's edge knots follow their neighbours
    coef, predicted = fit_cost_model(measurements, heldout, free)
    baseline = np.asarray([roofline_s(m.plan, mshape, machine) for m in measurements])
    fit = error_table(measurements, predicted, baseline, heldout)
    y = np.asarray([m.typical_s for m in measurements])
    fit["measured_over_roofline_median"] = float(np.median(y / baseline))
    pshape = PhysicalShape.of(model_shape(model_config), model_config.dtype)
    memory_stamps = {"before": memory.before, "after": memory.after, "rounds": mlog.round_stamps_gb_s}
    pmachine = PhysicalMachine(stamped_gb_s(memory_stamps), machine.matmul_flops_s / 1e9)
    physical, physical_predicted, physical_fit = physical_block(measurements, heldout, pshape, pmachine,
                                                                overhead.median_s, free)
    timed = [as_timed(m) for m in measurements]  # the calls as they were timed (the noise block's too)
    if usual:  # the held-out calls as timed, beside the same put at the usual bandwidth; each model
        # scored by the statistic it is fitted on
        fit["heldout_as_timed"] = Errors.of(predicted[heldout], np.asarray([m.typical_s for m in timed])[heldout]
                                            ).to_dict()
        physical_fit["heldout_as_timed"] = Errors.of(
            physical_predicted[heldout], np.asarray([m.median_s for m in timed])[heldout]).to_dict()
    wall = time.perf_counter() - t0

    fingerprint = config_fingerprint(model_config)
    info = {
        "model": {"name": model_config.name, "path": model_config.path, "dtype": model_config.dtype,
                  "attention": model_config.attention, "shape": mshape.to_dict()},
        # device kind and name, driver/runtime, torch, CPU model and the (masked) features it offered,
        # then which of miniserve's kernels the calls ran
        "measured_on": {**describe(runner.device), "kernels": runner.kernels_used(),
                        "bf16_native": bf16_native(runner.device), "threads": model_config.num_threads,
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "host": platform.node(), "engine_code": engine_code_version()},
        "fit": fit,
        "physical": {**physical.to_dict(), "fit": physical_fit},
        "preferred": preferred_model(fit, physical_fit),  # what this model's own simulations use
        "step_overhead": overhead.to_dict(),
        "kv_copy": copy.to_dict(),
        "after_idle": after_idle,  # CostModel.after_idle
        "roofline": {"machine": machine.to_dict(), "heldout": fit["roofline_heldout"]},
        "memory_read_gb_s": memory_stamps,  # CostModel.memory_read_gb_s: their median
        # this process's own weights (cost_model.weights_read_gb_s) and a fresh buffer of their dtype read
        # the same way: the weights read slower where they landed in slow memory, this profile's decode
        # calls with them (calibration.report warns); what real runs' weights are judged against is the
        # median of these stamps (cost_model.weights_read_gb_s)
        "weights_read_gb_s": {"before": memory.weights_before, "after": memory.weights_after,
                              "rounds": mlog.round_weights_gb_s, "fresh": placement[1] if placement else None,
                              "placement": placement[0] if placement else None},
        "grid": {"name": cfg.grid, "spec": asdict(spec), "calls": len(plan.shapes), "budget": plan.to_dict(),
                 "engine_calls": sum(len(m.times_s) for m in engine_calls), "engine_shapes": len(engine_calls),
                 "repeats": cfg.repeats or spec.repeats, "warmup": cfg.warmup, "wall_s": wall,
                 "robust": asdict(robust), **mlog.to_dict(), "at_usual_bandwidth": usual},
        # as timed: a real run's calls feel the bandwidth's moves within it, and the bands should too
        "noise": {**noise_report([m.times_s for m in timed], [m.typical_s for m in timed], predicted,
                                 [m.shape.kind for m in measurements],
                                 plan.repeats + [0] * len(engine_calls), [m.contended for m in measurements],
                                 mlog.order),
                  # the slow component a replicate draws (calibration.noise.RunNoise)
                  **profile_history(model_config.num_threads, fingerprint, calibration_stamps({"memory_read_gb_s": memory_stamps}))},
        "measurements": [{"shape": m.shape.name, "kind": m.shape.kind, "tokens": m.plan.total_tokens,
                          "requests": m.plan.num_requests, "samples": m.plan.num_samples,
                          "plan": plan_record(m.plan),
                          "median_s": m.median_s, "typical_s": m.typical_s, "spread": m.spread, "times_s": list(m.times_s),
                          "contended": list(m.contended),
                          **({"raw_times_s": list(m.raw_times_s), "stamps_gb_s": list(m.stamps_gb_s)}
                             if m.raw_times_s else {}),
                          "predicted_s": float(p), "physical_s": float(q), "roofline_s": float(b),
                          "heldout": bool(h)}
                         for m, p, q, b, h in zip(measurements, predicted, physical_predicted, baseline, heldout)],
    }
    model = CostModel(tuple(float(c) for c in coef), overhead.median_s, FEATURES,
                      fingerprint, info, copy.s_per_token)
    return Calibration(model, measurements, heldout, predicted, baseline, wall)


# the share of the time budget the grid's measuring may take (the machine's probes, the engine runs,
# the after-idle pairs' calls and the fit take the rest, the after-idle sleeps come off it); of the measuring, the base
# rounds are planned to leave EXTRA_SHARE for the extra rounds of the shapes that spread wide
MEASURE_SHARE = 0.8
EXTRA_SHARE = 0.15
# each timed call's stamp reads this much of the weights (one timed read after an untimed one): a
# quick read beside the calls, not a limit (the stamps around the calibration read 512 MiB, best of three)
CALL_STAMP_BYTES = 128 << 20
# the most of the time budget the after-idle sleeps may take: past it the longest idle lengths go
IDLE_SHARE = 0.15


def with_pass_edges(spec: GridSpec, pass_rows: int | None) -> GridSpec:
    """The grid with prompts at the edges of this machine's gemv passes only (``pass_rows``, the
    engine's: ModelRunner.pass_rows), as many shapes fewer as the other block has; where the engine
    runs no gemv (None) both blocks' edges stay, the data then says where the steps are."""
    if pass_rows is None:
        return spec
    return replace(spec, edge_chunks=tuple(n for n in spec.edge_chunks if n in pass_edges((pass_rows,))))


def idle_levels_in_budget(levels: tuple[tuple[float, int], ...], num_shapes: int,
                          time_budget_s: float | None) -> tuple[tuple[float, int], ...]:
    """The grid's after-idle lengths whose sleeps fit IDLE_SHARE of the time budget, dropping the
    longest first (the shortest is always kept: a serving loop's most common rest)."""
    kept = sorted(levels)
    while (time_budget_s is not None and len(kept) > 1
           and after_idle_sleep_s(num_shapes, kept) > IDLE_SHARE * time_budget_s):
        dropped = kept.pop()
        log.info(f"after-idle: {dropped[0]:g} s left out to fit the time budget of {time_budget_s:g} s")
    return tuple(kept)


def plan_to_budget(pool: ShapePool, shapes: list, cfg: CalibrationConfig, grid_repeats: int,
                   started_at: float, set_aside_s: float = 0.0,
                   call_stamp: Callable[[], object] | None = None, idle_steps: int = 0) -> MeasurePlan:
    """Price the grid's calls with two pilot calls and thin it to what ``cfg.time_budget_s`` leaves
    for measuring since ``started_at`` (``time.perf_counter()``; calibration.budget) less
    ``set_aside_s`` (the after-idle sleeps) and ``idle_steps`` rests of the engine between one-step
    requests (calibration.profiler.measure_idle_steps, each as long as idle_step_gap_s of a
    16-token call at the pilot's price); the plan's cuts are logged. A pilot call timed while
    others used the CPU is timed again. Each call is priced with the ``call_stamp`` taken before it."""
    repeats = cfg.repeats or grid_repeats
    if cfg.time_budget_s is None:
        return plan_measurement(shapes, [0.0] * len(shapes), repeats, cfg.warmup, None)
    by_tokens = attrgetter("num_tokens")
    pilot = []
    for shape in (min(shapes, key=by_tokens), max(shapes, key=by_tokens)):
        plan = shape.to_plan(pool.request_ids)
        pool.execute(plan)  # warm-up
        pilot.append((shape.num_tokens, execute_uncontended(pool, plan, cfg.robust.max_retries)[0]))
    stamp_s = 0.0 if call_stamp is None else best_s(call_stamp, 1, pool.runner.device)  # after one untimed
    idle_step_s = price_calls([Shape("prefill", chunks=((IDLE_STEP_PROMPT, 0, True),))], pilot[0], pilot[1])[0]
    set_aside_s += idle_steps * idle_step_gap_s(idle_step_s)
    budget = max(0.0, MEASURE_SHARE * cfg.time_budget_s - (time.perf_counter() - started_at) - set_aside_s)
    prices = [s + stamp_s for s in price_calls(shapes, pilot[0], pilot[1])]
    plan = plan_measurement(shapes, prices, repeats, cfg.warmup, (1 - EXTRA_SHARE) * budget)
    plan = replace(plan, budget_s=budget)
    log.info(f"time budget {cfg.time_budget_s:.0f} s: {budget:.0f} s left to measure; a {pilot[0][0]}-token call "
             f"{pilot[0][1]:.3f} s, a {pilot[1][0]}-token call {pilot[1][1]:.3f} s; the grid as planned "
             f"{plan.predicted_s:.0f} s" + (f" after cutting {'; '.join(plan.cuts)}" if plan.cuts else "")
             + (" (still over: the base rounds always finish)" if plan.predicted_s > budget else ""))
    return plan


def engine_code_version() -> str:
    """The git commit of the engine (``+dirty`` when engine/ has local changes): kernels change
    costs without changing the model fingerprint, so a profile says which code it timed."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "engine"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def plan_record(plan) -> dict:
    """Enough of a plan to rebuild it (refits and checks read profiles without re-measuring)."""
    return {"num_tokens": list(plan.num_tokens), "context_lens": list(plan.context_lens),
            "samples": list(plan.samples), "num_decodes": plan.num_decodes}
