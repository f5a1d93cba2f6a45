"""Simulated executors: how long a plan would take. The executor is the one place a simulated run
differs from a real one (engine.core.engine_core.Executor; the real one is ModelRunner).

A simulated executor answers two questions per step: when does the step that the engine is ready
to start at ``now`` really start (a replay of a real run may have started it later), and, given its
plan, when do its tokens come out and when can the next step begin. It never reads a plan's
request ids (a replay compares them), so the decodes a plan carries together stay counted.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from calibration.cost_model import FEATURES, CostModel, ProfileMismatchError
from calibration.noise import RunNoise
from calibration.physical import AnyCostModel, PhysicalCostModel, at_run_bandwidth
from engine.core.plan import BatchPlan, StepResult
from engine.core.request import Request


def cost_model_from(**terms: Any) -> CostModel:
    """A CostModel given by feature name (the rest zero), for tests and stand-ins: it stays valid
    when calibration adds features. Besides features: ``step_overhead_s``, ``kv_copy_s_per_token``
    and ``fingerprint``. (Keywords only: mypyc cannot compile defaults followed by ``**``.)"""
    step_overhead_s = float(terms.pop("step_overhead_s", 0.0))
    kv_copy_s_per_token = float(terms.pop("kv_copy_s_per_token", 0.0))
    fingerprint = terms.pop("fingerprint", None)
    unknown = set(terms) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown cost features {sorted(unknown)}; known: {list(FEATURES)}")
    return CostModel(tuple(float(terms.get(name, 0.0)) for name in FEATURES), step_overhead_s,
                     fingerprint=fingerprint, kv_copy_s_per_token=kv_copy_s_per_token)


class SimExecutor(Protocol):
    def start(self, now: float) -> float:
        """When the next step starts, given that the engine is free from ``now``."""

    def execute(self, plan: BatchPlan, requests: Mapping[str, Request], start_s: float) -> StepResult:
        """No tokens; the call's duration, when its tokens come out and when the next step may start."""

    def free(self, request_ids: Iterable[str]) -> None:
        """Nothing is held in simulation."""

    def rest(self, idle_s: float) -> None:
        """The engine has sat idle ``idle_s`` so far (nothing to run); the next step may start later
        and its call cost more. Told before ``start``."""

    def decode_costs(self, num_decodes: int) -> tuple[float, float, float, float] | None:
        """(seconds before the call, the call's seconds, its seconds per context token, seconds
        after it) of a step that decodes ``num_decodes`` requests together and nothing else, when
        that is linear in the context: the simulator then runs repeated such steps without a
        plan each (EngineCore.repeat_decodes), in the same arithmetic as ``execute``. None when
        this executor must see each plan."""


class CostModelExecutor:
    """A step spends ``before_call_s`` (scheduling, packing) before its model call, as the real
    loop does; the call takes ``predict(plan)`` (plus the profile's ``after_idle`` extra for as long as
    the engine sat idle before it) and its tokens come out at its end; the rest of
    ``step_overhead_s`` (sampling bookkeeping, the loop) passes before the next step can start.
    The first step after a rest starts ``after_idle.wake_s`` after the arrival that ends it (the
    real loop sleeps until then and wakes late; whoever arrives meanwhile joins the step) and
    spends ``after_idle.before_call_s`` before its call, where the profile measured them.
    ``time_scale`` stretches all of it (not how long a rest must be to cost the extra: arrivals
    set that): the same machine that much slower (or faster, below 1), for asking how much a
    prediction moves with a machine's speed (validate's sensitivity)."""

    def __init__(self, cost_model: AnyCostModel, time_scale: float = 1.0) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {time_scale!r}")
        self.cost_model = cost_model
        self.time_scale = time_scale
        self._predict = cost_model.predict
        self._before = cost_model.before_call_s * time_scale
        self._after = (cost_model.step_overhead_s - cost_model.before_call_s) * time_scale
        self._after_idle = after_idle = cost_model.after_idle
        self._wake = after_idle.wake_s * time_scale
        self._idle_before = (self._before if after_idle.before_call_s is None
                             else after_idle.before_call_s * time_scale)
        self._idle_s = 0.0
        self._decode_terms: dict[int, tuple[float, float]] = {}  # by count: (fixed, per context), scaled
        self._decode_costs: dict[int, tuple[float, float, float, float]] = {}  # by count: a run's costs

    def start(self, now: float) -> float:
        return now + self._wake if self._idle_s else now

    def free(self, request_ids: Iterable[str]) -> None:
        pass

    def rest(self, idle_s: float) -> None:
        self._idle_s = idle_s

    def call_s(self, plan: BatchPlan) -> float:
        """The model call's duration."""
        if plan.ids:
            return self._predict(plan) * self.time_scale
        fixed, per_context = self.decode_terms(plan.lane_size)  # decodes together, counted
        return fixed + per_context * plan.lane_context_sum

    def decode_terms(self, num_decodes: int) -> tuple[float, float]:
        """(fixed, per context token) of a decodes-only call, time-scaled: one pair for stepping
        and for runs of steps (decode_costs), so both give the same floats at any scale."""
        terms = self._decode_terms.get(num_decodes)
        if terms is None:
            fixed, per_context = self.cost_model.decode_cost_terms(num_decodes)
            terms = self._decode_terms[num_decodes] = (fixed * self.time_scale, per_context * self.time_scale)
        return terms

    def idle_extra_s(self, idle_s: float) -> float:
        """What the first call after ``idle_s`` of rest takes more (the profile's ``after_idle``)."""
        return self._after_idle.extra(idle_s) * self.time_scale

    def execute(self, plan: BatchPlan, requests: Mapping[str, Request], start_s: float) -> StepResult:
        duration = self.call_s(plan)
        before = self._before
        if self._idle_s:  # the first call after the engine sat idle (threads asleep, caches cold)
            duration += self.idle_extra_s(self._idle_s)
            before = self._idle_before
            self._idle_s = 0.0
        end = start_s + before + duration
        return StepResult(None, duration, end, end + self._after)

    def decode_costs(self, num_decodes: int) -> tuple[float, float, float, float] | None:
        costs = self._decode_costs.get(num_decodes)
        if costs is None:
            costs = self._decode_costs[num_decodes] = (self._before, *self.decode_terms(num_decodes), self._after)
        return costs


# a correlation past this would hold a replicate in one spell for its whole length (the run-wide
# draw's business), not a few seconds
MAX_CALL_LAG1 = 0.95


class NoisyExecutor(CostModelExecutor):
    """The cost model with measured noise (calibration.noise), seeded: one run-wide draw and a
    residual of the profile's own calls per call. The residuals follow one another as the
    calibration's calls did (``call_lag1``, ρ): e = μ + ρ (e_prev − μ) + √(1 − ρ²) (draw − μ), μ
    the residuals' mean, so a call's residual keeps the profile's residuals' mean and variance (not
    their shape, which tends to a normal as ρ grows) and is as correlated with the call before as
    a timed call was (ρ = 0, or a profile without it: each drawn on its own, as before). The run-wide draw is, where ``run_noise`` has
    bandwidth stamps and the profile a physical model, one memory bandwidth from that history:
    each call is scaled by the physical model's time at that bandwidth over its time at the
    calibration's (calibration.physical.at_run_bandwidth, so only the memory-bound terms move);
    otherwise one calibration round's factor, as older profiles always had. Each step is drawn, so
    the simulator never runs repeated steps at once (``decode_costs`` is None).

    Where the drawn bandwidth is one a run's calls saw (calibration.noise.calls_gb_s:
    ``RunNoise.seen_by_calls``) the residuals are centred (each draw less log mean e^residual,
    so a call's factor averages 1, exactly for ρ = 0): at that bandwidth the model's calls add up
    to the run's measured total, so it already holds the calls' mean residual, and drawing
    residuals with their mean on top priced every call twice for it (e^mean = 1.05 on a Zen 4
    profile: the replicates' band sat that much slow, docs/architecture.md). A probe's stamp
    and the round factor (a median over shapes) hold no such mean: there the residuals keep it."""

    def __init__(self, cost_model: AnyCostModel, seed: int, run_noise: RunNoise | None = None) -> None:
        super().__init__(cost_model)
        noise = cost_model.info.get("noise") or {}
        self._calls = noise.get("call_log") or [0.0]
        lag1 = float(noise.get("call_lag1") or 0.0)
        self._lag1 = min(max(lag1, 0.0), MAX_CALL_LAG1) if math.isfinite(lag1) else 0.0
        self._residual: float | None = None  # the last call's
        self.run_noise = run_noise or RunNoise.of_profile(cost_model.info)
        self._rng = random.Random(seed)
        physical = physical_model(cost_model) if self.run_noise.memory_gb_s else None
        self.memory_gb_s: float | None = None
        if physical is None:  # the old draw, in the old order: seeded bands stay as they were
            self.run_factor = math.exp(self._rng.choice(self.run_noise.round_log))
            self._at_run = None
        else:
            self.run_factor = 1.0
            drawn = self._rng.randrange(len(self.run_noise.memory_gb_s))  # = choice(): the same draws as before
            self.memory_gb_s = self.run_noise.memory_gb_s[drawn]
            self._base, self._at_run = physical, at_run_bandwidth(physical, self.memory_gb_s)
            if self.run_noise.seen_by_calls(drawn):
                self._calls = centred(self._calls)
        self._mean = statistics.fmean(self._calls)

    def call_s(self, plan: BatchPlan) -> float:
        call = super().call_s(plan) * self.run_factor
        if self._at_run is not None:
            base = self._base.predict(plan)
            call *= self._at_run.predict(plan) / base if base > 0 else 1.0
        return call * math.exp(self._next_residual())

    def _next_residual(self) -> float:
        draw = self._rng.choice(self._calls)
        if self._lag1 and self._residual is not None:
            rho, mean = self._lag1, self._mean
            draw = mean + rho * (self._residual - mean) + math.sqrt(1 - rho * rho) * (draw - mean)
        self._residual = draw
        return draw

    def decode_costs(self, num_decodes: int) -> None:
        return None


def centred(residuals: Sequence[float]) -> list[float]:
    """Log residuals shifted so that their factors average 1 (mean e^r = 1): spread without a bias."""
    shift = math.log(statistics.fmean(math.exp(r) for r in residuals))
    return [r - shift for r in residuals]


def physical_model(cost_model: AnyCostModel) -> PhysicalCostModel | None:
    """The physical model behind a cost model (itself, or the one its profile carries), priced at
    the calibration's bandwidth; None for a profile without one."""
    if isinstance(cost_model, PhysicalCostModel):
        return cost_model
    if not cost_model.info.get("physical"):
        return None
    try:
        return PhysicalCostModel.from_profile({**cost_model.info, "step_overhead_s": cost_model.step_overhead_s,
                                               "kv_copy_s_per_token": cost_model.kv_copy_s_per_token})
    except ProfileMismatchError:
        return None


class ReplayDivergedError(Exception):
    """The simulation scheduled something the replayed real run did not."""


class ReplayExecutor:
    """Replays a real run's measured steps: step i starts at the recorded ``start_s`` (or when the
    engine is free, if later) and its tokens come out at the recorded ``end_s``. With the same
    arrivals this reproduces the run's plans and token timestamps exactly; ``expect_plans``
    makes any divergence an error at the step where it happens."""

    def __init__(self, steps: Sequence, expect_plans: bool = True) -> None:
        self.steps = list(steps)  # engine.core.engine_core.StepRecord or anything with plan/start_s/end_s
        self.expect_plans = expect_plans
        self.index = 0

    def free(self, request_ids: Iterable[str]) -> None:
        pass

    def rest(self, idle_s: float) -> None:
        pass  # the recorded durations have it already

    def start(self, now: float) -> float:
        if self.index >= len(self.steps):  # the run is over (or about to diverge, which execute() reports)
            return now
        return max(now, self.steps[self.index].start_s)

    def execute(self, plan: BatchPlan, requests: Mapping[str, Request], start_s: float) -> StepResult:
        if self.index >= len(self.steps):
            raise ReplayDivergedError(f"the simulation needs more than the {len(self.steps)} recorded steps")
        record = self.steps[self.index]
        if self.expect_plans and plan != record.plan:
            raise ReplayDivergedError(f"step {self.index}: simulated plan {plan} != recorded {record.plan}")
        self.index += 1
        return StepResult(None, getattr(record, "model_s", record.end_s - start_s), record.end_s, record.end_s)

    def decode_costs(self, num_decodes: int) -> None:
        return None  # every step is checked against the recorded plan


class MeasuredCallsExecutor(CostModelExecutor):
    """The cost model's step with each call as a real run measured it: while the simulation makes
    the run's plans (same shapes, step for step) a call takes the recorded ``model_s`` (the first
    call after a rest included: the record has its extra), and the rest of the step, the wake
    after a rest and the overhead, is the cost model's. What the simulator predicts where the
    cost model is exact for that run, so a gap left between it and the real run is the loop's
    (scheduling, admission, the step's overhead), not the calls' (benchmarks/ttft_side_by_side.py).
    From the first step whose plan differs (``diverged_at``) every call is the cost model's."""

    def __init__(self, cost_model: AnyCostModel, steps: Sequence) -> None:
        super().__init__(cost_model)
        self.steps = list(steps)  # StepRecord, or anything with plan and model_s
        self.index = 0
        self.diverged_at: int | None = None

    def call_s(self, plan: BatchPlan) -> float:
        """The next recorded call's duration while the plans match, else the cost model's."""
        i, self.index = self.index, self.index + 1
        if self.diverged_at is None and (i >= len(self.steps) or _shape(plan) != _shape(self.steps[i].plan)):
            self.diverged_at = i
        return super().call_s(plan) if self.diverged_at is not None else self.steps[i].model_s

    def idle_extra_s(self, idle_s: float) -> float:
        # a matched call's record has its extra after a rest already
        return super().idle_extra_s(idle_s) if self.diverged_at is not None else 0.0

    def decode_costs(self, num_decodes: int) -> None:
        return None  # every step is matched against the record


def _shape(plan: BatchPlan) -> tuple:
    """A plan as a call's cost sees it: each entry's tokens, context and sampling, not the ids."""
    return plan.num_tokens, plan.context_lens, plan.samples, plan.num_decodes


class ConstantExecutor:
    """Every model call takes ``call_s``, plus ``overhead_s`` between steps: hand-computable runs."""

    def __init__(self, call_s: float, overhead_s: float = 0.0) -> None:
        self.call_s = call_s
        self.overhead_s = overhead_s

    def start(self, now: float) -> float:
        return now

    def free(self, request_ids: Iterable[str]) -> None:
        pass

    def rest(self, idle_s: float) -> None:
        pass

    def execute(self, plan: BatchPlan, requests: Mapping[str, Request], start_s: float) -> StepResult:
        end = start_s + self.call_s
        return StepResult(None, self.call_s, end, end + self.overhead_s)

    def decode_costs(self, num_decodes: int) -> tuple[float, float, float, float]:
        return 0.0, self.call_s, 0.0, self.overhead_s
