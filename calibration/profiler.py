"""Time the real ModelRunner on grid shapes, and the per-step time an Engine spends outside it.

How a shape with prior context is made real: a pool of requests first takes its KV slots through
one real forward (every request one token at context 0, as a prefill would), then every slot's
cache rows up to the longest context are filled with random values. A forward's cost depends on
shapes and on the memory it touches, not on the values, so the timed call — the runner's own
``execute`` of that plan, one packed forward over exactly those tokens and contexts — reads and
writes what a call after a real prefill would, without paying minutes of prefill to get there.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from tqdm import tqdm

from calibration.contention import Interval
from calibration.grid import Shape
from engine.core.config import ModelConfig, SchedulerConfig
from engine.llm_engine import Engine
from engine.model.runner import ModelRunner
from engine.core.plan import BatchPlan
from engine.core.request import Request
from engine.observe.workload import LengthDist, WorkloadConfig, generate, make_requests

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measurement:
    shape: Shape
    plan: BatchPlan
    times_s: tuple[float, ...]
    contended: tuple[bool, ...] = ()  # per time: still contended after its retries
    # per time: the weights' read rate around the call (geometric mean of the stamps just before and
    # just after it; Robustness.stamp_calls), or empty where calls were not stamped
    stamps_gb_s: tuple[float, ...] = ()
    raw_times_s: tuple[float, ...] = ()  # as timed, where ``times_s`` were put at the usual bandwidth

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def clean_times_s(self) -> tuple[float, ...]:
        """The times no other process disturbed, or all of them when none was undisturbed."""
        clean = tuple(t for t, c in zip(self.times_s, self.contended) if not c)
        return clean or self.times_s

    @property
    def typical_s(self) -> float:
        """The interquartile mean of the undisturbed repeats (the median for three or fewer):
        what the fit uses. A slow spell hits a few repeats of a shape, not all, so the tails and
        the calls others disturbed are left out."""
        return trimmed_mean(self.clean_times_s)

    @property
    def spread(self) -> float:
        """(max − min) / median of the repeats: how noisy this shape was."""
        return (max(self.times_s) - min(self.times_s)) / self.median_s


def trimmed_mean(values: Sequence[float], cut: float = 0.25) -> float:
    """Mean of what is left after dropping the lowest and highest ``cut`` share (at least the
    median is kept)."""
    xs = sorted(values)
    k = int(len(xs) * cut)
    if len(xs) - 2 * k < 1 or len(xs) <= 3:
        return statistics.median(xs)
    return statistics.fmean(xs[k:len(xs) - k])


class ShapePool:
    """A runner whose KV slots hold ``num_slots`` requests at any context below ``max_len``."""

    def __init__(self, runner: ModelRunner, num_slots: int, max_len: int, seed: int = 0) -> None:
        self.runner = runner
        g = torch.Generator().manual_seed(seed)
        prompt_len = max_len + 1
        self.request_ids = [f"calib-{i}" for i in range(num_slots)]
        self.requests = {rid: Request(rid, torch.randint(0, runner.vocab_size, (prompt_len,), generator=g).tolist(),
                                      1) for rid in self.request_ids}
        runner.execute(BatchPlan("calibration", tuple(self.request_ids), (1,) * num_slots, (0,) * num_slots,
                                 (False,) * num_slots, 0), self.requests)
        with torch.no_grad():
            for store in runner.cache.keys + runner.cache.values:
                part = store[:, :, 1:max_len + 1]  # drawn on the CPU (g is a CPU generator), copied to the device
                part.copy_(torch.randn(part.shape, generator=g, dtype=part.dtype))

    def execute(self, plan: BatchPlan) -> tuple[float, bool]:
        """The call's duration, and whether other processes used the CPU meanwhile."""
        with Interval() as iv:
            duration = self.runner.execute(plan, self.requests).duration_s
        return duration, iv.contended

    def release(self) -> None:
        self.runner.free(self.request_ids)


def make_runner(model_config: ModelConfig, num_slots: int, max_len: int) -> ModelRunner:
    return ModelRunner(model_config, SchedulerConfig(max_num_seqs=num_slots, max_model_len=max_len + 2))


@dataclass(frozen=True)
class Robustness:
    """How a calibration fights a noisy machine (calibration.calibrate.CalibrationConfig carries it)."""

    max_retries: int = 3  # a call timed while others used the CPU is measured again, up to this often
    wide_spread: float = 0.10  # shapes whose repeats spread wider than this get extra rounds ...
    extra_rounds: int = 3  # ... at most this many
    # a round whose memory stamp is this far from the usual (median) is measured again (where calls
    # are not stamped one by one: stamp_calls)
    memory_drift: float = 0.20
    stamp_rounds: bool = True  # stamp memory bandwidth between rounds (~0.1 s each)
    # read a sample of the weights before every timed call (measure_shapes' call_stamp), so each call
    # can be put at the calibration's usual bandwidth (calibration.calibrate.at_usual_bandwidth)
    # instead of a round that drifted being measured again
    stamp_calls: bool = True
    # past this (from the first timed call) no more retries, re-measured or extra rounds; a
    # calibration with a time budget (CalibrationConfig.time_budget_s) sets it to what that leaves
    budget_s: float = 200.0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.extra_rounds < 0:
            raise ValueError(f"calibration.robust.max_retries and extra_rounds must be >= 0, got {self.max_retries} "
                             f"and {self.extra_rounds}")
        for name in ("wide_spread", "memory_drift"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"calibration.robust.{name} must be a positive fraction, got {getattr(self, name)!r}")
        if not self.budget_s >= 0:  # 0: past the budget already, the base rounds only
            raise ValueError(f"calibration.robust.budget_s must be >= 0, got {self.budget_s!r}")


@dataclass
class MeasureLog:
    """What happened while measuring: order, retries, re-measured rounds, stamps (the profile
    keeps the round stamps with the others: ``memory_read_gb_s.rounds``, ``weights_read_gb_s.rounds``)."""

    order: list[int] = field(default_factory=list)  # shape index of every kept timed call, in time order
    retried: int = 0
    rounds_remeasured: int = 0
    extra_rounds: int = 0
    round_stamps_gb_s: list[float] = field(default_factory=list)
    round_weights_gb_s: list[float] = field(default_factory=list)  # the model's own weights' read rate, as often
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        return {"contended_retries": self.retried, "rounds_remeasured": self.rounds_remeasured,
                "extra_rounds": self.extra_rounds, "measure_wall_s": self.wall_s}


def execute_uncontended(pool: ShapePool, plan: BatchPlan, max_retries: int,
                        give_up: Callable[[], bool] = lambda: False,
                        before: Callable[[], object] = lambda: None) -> tuple[float, bool, int]:
    """Time ``plan``; while other processes used the CPU meanwhile, time it again, up to
    ``max_retries`` times or until ``give_up()``; ``before()`` runs before every attempt (a call
    stamp belongs to the attempt that is kept). Returns (seconds, still contended, retries)."""
    before()
    t, contended = pool.execute(plan)
    retries = 0
    while contended and retries < max_retries and not give_up():
        retries += 1
        before()
        t, contended = pool.execute(plan)
    return t, contended, retries


def round_order(num_shapes: int, rounds: int, seed: int) -> list[list[int]]:
    """A fresh random order of the shapes per round: the repeats of one shape are spread across
    the whole run, and a slow spell lands on many shapes once rather than on one shape thrice."""
    rng = np.random.default_rng(seed)
    return [[int(i) for i in rng.permutation(num_shapes)] for _ in range(rounds)]


def measure_shapes(pool: ShapePool, shapes: list[Shape], repeats: int | Sequence[int], warmup: int | Sequence[int] = 1,
                   seed: int = 0, progress: bool = True, robust: Robustness = Robustness(),
                   stamp: Callable[[], float] | None = None,
                   weights_stamp: Callable[[], float | None] | None = None,
                   call_stamp: Callable[[], float | None] | None = None,
                   memory_shares: Sequence[float] | None = None) -> tuple[list[Measurement], MeasureLog]:
    """Warm-up passes, then ``repeats`` rounds over all shapes, each in a fresh random order
    (round_order); then up to ``robust.extra_rounds`` more rounds over the shapes whose repeats
    still spread wider than ``robust.wide_spread``. ``repeats`` and ``warmup`` may be given per
    shape (calibration.budget.MeasurePlan): round ``r`` then times the shapes with more than
    ``r`` repeats, pass ``w`` warms those with more than ``w`` warm-ups.

    A call during which other processes used the CPU is measured again (up to
    ``robust.max_retries``); one still contended then is kept but flagged, and the shape's
    typical time leaves it out (Measurement.typical_s). With ``stamp``
    (calibration.roofline.memory_read_gb_s), the memory bandwidth is stamped after each round; a
    round stamped more than ``robust.memory_drift`` from the median of the stamps before it is
    measured once more and the spell's times are dropped; ``weights_stamp``
    (calibration.roofline.tensors_read_gb_s of the model's decode weights) is stamped beside it, so
    what real runs' weights are judged against is the median over the calibration, not one stamp
    before and one after (calibration.cost_model.stamped_gb_s). With ``call_stamp`` (a quicker read
    of a sample of the weights) and ``robust.stamp_calls``, every timed attempt is stamped just
    before it, and a call gets the geometric mean of its stamp and the next, taken just after it
    (Measurement.stamps_gb_s); a drifted round is then kept, its calls to be put at the usual
    bandwidth instead; with ``memory_shares`` too (per shape, the share of its time spent reading
    memory: calibration.calibrate.memory_share), the spread that earns a shape extra rounds is its
    repeats' at the usual bandwidth, as the fit will see them, not as timed: a shape wide only
    because the bandwidth moved under it gains nothing from more repeats that its stamps do not
    already give. Retries, re-measured and extra rounds stop once ``robust.budget_s`` has
    passed: the base rounds always finish, so a busy machine costs precision, not an unbounded wait.
    The progress bar shows on a terminal only; then one summary line is logged.
    """
    plans = [s.to_plan(pool.request_ids) for s in shapes]
    reps = [repeats] * len(shapes) if isinstance(repeats, int) else list(repeats)
    warms = [warmup] * len(shapes) if isinstance(warmup, int) else list(warmup)
    times: list[list[float]] = [[] for _ in shapes]
    flags: list[list[bool]] = [[] for _ in shapes]
    mlog = MeasureLog()
    start = time.perf_counter()
    bar = tqdm(total=sum(reps) + sum(warms), desc="calibrating", unit="call", disable=None if progress else True)

    def over_budget() -> bool:
        return time.perf_counter() - start > robust.budget_s

    per_call = robust.stamp_calls and call_stamp is not None
    wlog: list[float | None] = []  # every call stamp, in time order
    around: list[list[int]] = [[] for _ in shapes]  # per kept time: index in wlog of the stamp before it

    def stamp_call() -> None:
        wlog.append(call_stamp())

    def timed(i: int) -> tuple[float, bool, int]:
        t, contended, retries = execute_uncontended(pool, plans[i], robust.max_retries, over_budget,
                                                    stamp_call if per_call else lambda: None)
        mlog.retried += retries
        mlog.order.append(i)
        bar.update()
        return t, contended, len(wlog) - 1

    for w, order in enumerate(round_order(len(shapes), max(warms, default=0), seed + 1)):
        for i in order:
            if warms[i] > w:
                pool.execute(plans[i])
                bar.update()
    stamps = [stamp()] if stamp else []
    for r, order in enumerate(round_order(len(shapes), max(reps, default=0), seed)):
        order = [i for i in order if reps[i] > r]
        for attempt in range(2):
            got = {i: timed(i) for i in order}
            if per_call:
                stamp_call()  # the round's last call's after, before the round's own stamps
            drifted = False
            if stamp is not None and robust.stamp_rounds:
                gb_s = stamp()
                mlog.round_stamps_gb_s.append(gb_s)
                # against the usual; calls stamped one by one are put at the usual bandwidth instead
                drifted = abs(gb_s / statistics.median(stamps) - 1) > robust.memory_drift and not per_call
                stamps.append(gb_s)
                weights_gb_s = weights_stamp() if weights_stamp is not None else None
                if weights_gb_s is not None:
                    mlog.round_weights_gb_s.append(weights_gb_s)
            if not drifted or attempt == 1 or over_budget():
                break
            del mlog.order[-len(order):]  # its calls are measured again: the order keeps the kept ones
            mlog.rounds_remeasured += 1
            bar.total += len(order)
        for i, (t, c, w) in got.items():
            times[i].append(t)
            flags[i].append(c)
            around[i].append(w)
    shares = list(memory_shares) if per_call and memory_shares is not None else None

    def judged() -> list[list[float]]:
        """Each shape's kept times as its spread is judged: at the usual bandwidth (the median of
        the calls' stamps so far) where its calls were stamped and its memory share is known, else
        as timed."""
        stamped = [call_stamps(wlog, a) if shares is not None else () for a in around]
        every = [w for ws in stamped for w in ws]
        if not every:
            return times
        usual = statistics.median(every)
        return [list(at_bandwidth(t, w, usual, share)) if w else t
                for t, w, share in zip(times, stamped, shares, strict=True)]

    rng = np.random.default_rng(seed + 2)
    for _ in range(robust.extra_rounds):
        if over_budget():
            break
        wide = [i for i, t in enumerate(judged()) if spread(t) > robust.wide_spread]
        if not wide:
            break
        bar.total += len(wide)
        ran = 0
        # the shortest first (ties in a fresh random order): when the time runs out, what is left
        # undone is the long calls, whose few percent of spread a repeat buys least
        for i in sorted(rng.permutation(wide), key=lambda i: statistics.median(times[i])):
            if over_budget():  # a round of long calls can outlast what is left
                break
            t, c, w = timed(int(i))
            times[int(i)].append(t)
            flags[int(i)].append(c)
            around[int(i)].append(w)
            ran += 1
        if per_call:
            stamp_call()  # this round's last call's after: the next selection puts it at the usual
        if ran:
            mlog.extra_rounds += 1
    bar.close()
    mlog.wall_s = time.perf_counter() - start
    log.info(f"measured {len(shapes)} shapes, {sum(warms)} warm-up and {len(mlog.order)} timed calls in {mlog.wall_s:.1f} s, "
             f"{mlog.retried} calls measured again (CPU contended), {mlog.rounds_remeasured} rounds again "
             f"(memory stamp moved), {mlog.extra_rounds} extra rounds for wide shapes")
    stamped = [call_stamps(wlog, a) if per_call else () for a in around]
    return [Measurement(s, p, tuple(t), tuple(f), w)
            for s, p, t, f, w in zip(shapes, plans, times, flags, stamped)], mlog


def call_stamps(wlog: Sequence[float | None], before: Sequence[int]) -> tuple[float, ...]:
    """Each call's weights read rate: the geometric mean of the stamp just before it and the one
    just after it, ``wlog[k]`` and ``wlog[k + 1]`` for a call stamped at ``k`` (a spell on a shared
    host can be as short as a call, and the two together track it better than the one before;
    docs/architecture.md). Empty where a stamp is missing (weights not readable)."""
    out = []
    for k in before:
        if k < 0 or k + 1 >= len(wlog):
            return ()
        pair = (wlog[k], wlog[k + 1])
        if any(w is None or w <= 0 for w in pair):
            return ()
        out.append(math.sqrt(pair[0] * pair[1]))
    return tuple(out)


def at_bandwidth(times_s: Sequence[float], stamps_gb_s: Sequence[float], usual_gb_s: float,
                 memory_share: float) -> tuple[float, ...]:
    """Each time as it would have been with the memory read at ``usual_gb_s`` instead of its stamp:
    t × (w / usual) ** share. Only the share of the call spent reading memory stretches with the
    bandwidth (a decode's time is mostly reading weights, a long prefill's mostly arithmetic)."""
    return tuple(t * (w / usual_gb_s) ** memory_share for t, w in zip(times_s, stamps_gb_s))


def spread(times: Sequence[float]) -> float:
    """(max − min) / median."""
    return (max(times) - min(times)) / statistics.median(times)


def after_idle_sleep_s(num_shapes: int, levels: Sequence[tuple[float, int]]) -> float:
    """The seconds ``measure_after_idle`` sleeps: the calibration's time budget sets them aside."""
    return num_shapes * sum(idle * rounds for idle, rounds in levels)


def measure_after_idle(pool: ShapePool, shapes: list[Shape], levels: Sequence[tuple[float, int]],
                       sleep: Callable[[float], None] = time.sleep) -> dict:
    """What a model call costs more right after the engine sat idle than the same call back to
    back, at each of ``levels`` (idle seconds, rounds: calibration.grid.GridSpec.idle_levels): the
    median over ``shapes`` × rounds of (after idle − back to back), each pair timed one after the
    other, the idle lengths taken in turn within a round so a spell of the machine falls on all.
    The grid times calls back to back, so without this the first call after idle is predicted too
    fast (calibration.cost_model.AfterIdle)."""
    plans = [s.to_plan(pool.request_ids) for s in shapes]
    extra: dict[float, list[float]] = {idle: [] for idle, _ in levels}
    ratio: dict[float, list[float]] = {idle: [] for idle, _ in levels}
    for r in range(max((rounds for _, rounds in levels), default=0)):
        for idle, rounds in levels:
            if r >= rounds:
                continue
            for plan in plans:
                busy = pool.execute(plan)[0]
                sleep(idle)
                cold = pool.execute(plan)[0]
                extra[idle].append(cold - busy)
                ratio[idle].append(cold / busy)
    return {"levels": [{"idle_s": idle, "extra_s": max(0.0, float(np.median(extra[idle]))),
                        "ratio_median": float(np.median(ratio[idle])), "pairs": len(extra[idle])}
                       for idle, _ in levels if extra[idle]]}


IDLE_SHAPES = (Shape("decode", decode_contexts=(64,)), Shape("prefill", chunks=((16, 0, True),)),
               Shape("prefill", chunks=((32, 0, True),)), Shape("prefill", chunks=((12, 0, True),) * 4))


@dataclass(frozen=True)
class OverheadSummary:
    """Per-step wall time outside the model call: scheduling, packing, sampling, bookkeeping."""

    median_s: float
    mean_s: float
    p90_s: float
    steps: int
    share_of_busy: float  # Σ overhead / Σ model time
    before_call_median_s: float = 0.0  # the part spent between a step's start and its model call
    samples_s: tuple[float, ...] = ()  # every step's overhead (prediction bands draw from them)
    # the first step after the engine sat idle (measure_idle_steps): from the arrival that ends the
    # rest to the step's start (the loop's sleep overshooting), then to its model call
    idle_wake_median_s: float = 0.0
    idle_before_call_median_s: float | None = None  # None: none measured (a busy step's then)

    def to_dict(self) -> dict:
        return {**self.__dict__, "samples_s": list(self.samples_s)}


def step_overheads(steps) -> list[float]:
    """``end − start − model`` of each step plus the gap to the next step's start."""
    out = []
    for i, s in enumerate(steps):
        gap = steps[i + 1].start_s - s.end_s if i + 1 < len(steps) else 0.0
        out.append(s.end_s - s.start_s - s.model_s + gap)
    return out


def measure_engine_runs(runner: ModelRunner, max_num_seqs: int, runs: int = 3,
                        call_stamp: Callable[[], float | None] | None = None
                        ) -> tuple[OverheadSummary, list[Measurement]]:
    """Serve a small burst (mixed prompt lengths, not the seed's) through the continuous Engine on
    this runner: the time outside the model call, from its StepRecords, and its model calls as
    measurements of kind "engine". Calls inside a serving loop run some percent slower than the
    same shapes timed back to back on the grid (caches, allocator, the Python between calls), so
    the fit learns from them too and the error table scores them. Every run serves the same
    lengths, so it makes the same plans: a shape's calls from all runs are one measurement, its
    repeats, and the fit takes their typical time (one run in a slow spell had made single calls
    20% off, the worst held-out error of a calibration). With ``call_stamp`` (measure_shapes'),
    the weights' read rate is stamped just before and just after each run, and each
    of its calls gets the geometric mean of the two (Measurement.stamps_gb_s), so the calls can be
    put at the calibration's usual bandwidth as the grid's are (a run is a second or two, so the
    pair places it, not each call)."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, long_prefill_token_threshold=32,
                             max_model_len=runner.max_model_len)
    engine = Engine(config, runner.model_config, runner=runner)
    workload = WorkloadConfig(num_requests=2 * max_num_seqs, prompt=LengthDist("uniform", low=4, high=40),
                              output=LengthDist("uniform", low=2, high=10), seed=7)
    overheads: list[float] = []
    before: list[float] = []
    times: dict[Shape, list[float]] = {}
    stamps: dict[Shape, list[float | None]] = {}
    plans: dict[Shape, BatchPlan] = {}
    busy = 0.0
    for k in range(runs + 1):  # the first run is a warm-up
        requests = make_requests(generate(workload), vocab_size=runner.vocab_size, seed=k, prefix=f"ovh{k}")
        w0 = call_stamp() if call_stamp is not None and k else None
        result = engine.run(requests)
        w1 = call_stamp() if call_stamp is not None and k else None
        engine.reset()
        if k:
            overheads += step_overheads(result.steps)
            before += [st.end_s - st.start_s - st.model_s for st in result.steps]
            busy += sum(s.model_s for s in result.steps)
            w = (call_stamps([w0, w1], [0]) or (None,))[0]
            for st in result.steps:
                shape = Shape.of_plan(st.plan, "engine")
                plans.setdefault(shape, st.plan)
                times.setdefault(shape, []).append(st.model_s)
                stamps.setdefault(shape, []).append(w)
    calls = [Measurement(shape, plans[shape], tuple(ts),
                         stamps_gb_s=() if None in stamps[shape] else tuple(stamps[shape]))
             for shape, ts in times.items()]
    arr = np.asarray(overheads)
    wake, idle_before = measure_idle_steps(engine)
    summary = OverheadSummary(float(np.median(arr)), float(arr.mean()), float(np.percentile(arr, 90)), len(arr),
                              float(arr.sum() / busy), float(np.median(before)), tuple(float(x) for x in arr),
                              float(np.median(wake)) if wake else 0.0,
                              float(np.median(idle_before)) if idle_before else None)
    return summary, calls


IDLE_STEPS = 8  # one-step requests, each arriving after the engine has sat idle ...
IDLE_STEP_GAP_S = 0.2  # ... this long at least, and twice their step (idle_step_gap_s)
IDLE_STEP_PROMPT = 16  # their prompt's tokens (one output token: one prefill step each)


def idle_step_gap_s(step_s: float) -> float:
    """How far apart the idle steps' requests arrive, given one such step's time: the rest between
    them must outlast the step, or the engine never sits idle (a 16-token prefill of the 1.5B shape
    in fp32 takes longer than the floor). The calibration's time budget sets ``IDLE_STEPS`` of
    these aside, priced from its pilot calls (calibration.calibrate.plan_to_budget)."""
    return max(IDLE_STEP_GAP_S, 2 * step_s)


def measure_idle_steps(engine: Engine, steps: int = IDLE_STEPS, gap_s: float | None = None
                       ) -> tuple[list[float], list[float]]:
    """What the first step after idle spends outside its model call, per step: (the arrival to the
    step's start: the loop sleeps until the next arrival and wakes late, and whoever arrives
    meanwhile joins the step; the step's start to its model call: scheduling and packing in cold
    caches, several times a busy step's on a small model). Requests of a 16-token prompt and one
    output token arrive ``gap_s`` apart (None: ``idle_step_gap_s`` of one such request's step,
    served first); the steps taken are those that follow a rest (a prompt the engine's token
    budget cuts into chunks takes its later ones busy). The call itself is AfterIdle's
    (measure_after_idle)."""
    vocab = engine.runner.vocab_size

    def prompt(i: int) -> list[int]:
        return [(7 * i + j) % vocab for j in range(IDLE_STEP_PROMPT)]

    if gap_s is None:
        pilot = engine.run([Request("idle-pilot", prompt(steps + 1), 1)])
        engine.reset()
        gap_s = idle_step_gap_s(max(s.end_s - s.start_s for s in pilot.steps))
    requests = [Request(f"idle-{i}", prompt(i), 1, arrival_s=i * gap_s) for i in range(steps + 1)]
    arrival = {r.request_id: r.arrival_s for r in requests}
    result = engine.run(requests)
    engine.reset()
    wake, before = [], []
    for prev, st in zip(result.steps, result.steps[1:]):  # the first starts the run: no rest before it
        woke_at = max(arrival[rid] for rid in st.plan.ids)
        if woke_at > prev.end_s:  # the engine slept until this arrival
            wake.append(max(0.0, st.start_s - woke_at))
            before.append(st.end_s - st.start_s - st.model_s)
    return wake, before


def threads_of(model_config: ModelConfig) -> ModelConfig:
    """Timings are only comparable at a known thread count: make it explicit."""
    if model_config.num_threads is None:
        return replace(model_config, num_threads=torch.get_num_threads())
    return model_config
