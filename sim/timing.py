"""How long a step takes in simulation: the one place a simulated run differs from a real one.

A timer answers two questions per step: when does the step that the engine is ready to start at
``now`` really start (a replay of a real run may have started it later), and, given its plan,
when do its tokens come out and when can the next step begin.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from calibration.cost_model import FEATURES, CostModel
from engine.core.plan import BatchPlan


def cost_model_from(step_overhead_s: float = 0.0, fingerprint: str | None = None, **coefficients: float) -> CostModel:
    """A CostModel given by feature name (the rest zero), for tests and stand-ins: it stays valid
    when calibration adds features."""
    unknown = set(coefficients) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown cost features {sorted(unknown)}; known: {list(FEATURES)}")
    return CostModel(tuple(float(coefficients.get(name, 0.0)) for name in FEATURES), step_overhead_s,
                     fingerprint=fingerprint)


class StepTimer(Protocol):
    def start(self, now: float) -> float:
        """When the next step starts, given that the engine is free from ``now``."""

    def run(self, plan: BatchPlan, start_s: float) -> tuple[float, float]:
        """``(end_s, ready_s)``: tokens come out at ``end_s``; the next step may start at ``ready_s``."""


class DecodeStepTimer(StepTimer, Protocol):
    """A timer that can also time a step that only decodes, from its size alone: the simulator
    then runs such steps without building their plans (a replay, which checks plans, cannot)."""

    def run_decodes(self, num_decodes: int, context_sum: int, start_s: float) -> tuple[float, float]:
        """``run`` of the plan that decodes ``num_decodes`` requests whose contexts sum to ``context_sum``."""


class CostModelTimer:
    """The model call takes ``predict(plan)``; then ``step_overhead_s`` passes outside the call
    (sampling, bookkeeping, scheduling the next step) before the next step can start."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self._predict = cost_model.predict
        self._predict_decodes = cost_model.predict_decodes
        self._overhead = cost_model.step_overhead_s

    def start(self, now: float) -> float:
        return now

    def run(self, plan: BatchPlan, start_s: float) -> tuple[float, float]:
        end = start_s + self._predict(plan)
        return end, end + self._overhead

    def run_decodes(self, num_decodes: int, context_sum: int, start_s: float) -> tuple[float, float]:
        end = start_s + self._predict_decodes(num_decodes, context_sum)
        return end, end + self._overhead


class ReplayDivergedError(RuntimeError):
    """The simulation scheduled something the replayed real run did not."""


class ReplayTimer:
    """Replays a real run's measured steps: step i starts at the recorded ``start_s`` (or when the
    engine is free, if later) and its tokens come out at the recorded ``end_s``. With the same
    arrivals this reproduces the run's plans and token timestamps exactly; ``expect_plans``
    makes any divergence an error at the step where it happens."""

    def __init__(self, steps: Sequence, expect_plans: bool = True) -> None:
        self.steps = list(steps)  # engine.llm_engine.StepRecord or anything with plan/start_s/end_s
        self.expect_plans = expect_plans
        self.index = 0

    def _next(self):
        if self.index >= len(self.steps):
            raise ReplayDivergedError(f"the simulation needs more than the {len(self.steps)} recorded steps")
        return self.steps[self.index]

    def start(self, now: float) -> float:
        if self.index >= len(self.steps):  # the run is over (or about to diverge, which run() reports)
            return now
        return max(now, self.steps[self.index].start_s)

    def run(self, plan: BatchPlan, start_s: float) -> tuple[float, float]:
        record = self._next()
        if self.expect_plans and plan != record.plan:
            raise ReplayDivergedError(f"step {self.index}: simulated plan {plan} != recorded {record.plan}")
        self.index += 1
        return record.end_s, record.end_s


class ConstantTimer:
    """Every model call takes ``call_s``, plus ``overhead_s`` between steps: hand-computable runs."""

    def __init__(self, call_s: float, overhead_s: float = 0.0) -> None:
        self.call_s = call_s
        self.overhead_s = overhead_s

    def start(self, now: float) -> float:
        return now

    def run(self, plan: BatchPlan, start_s: float) -> tuple[float, float]:
        end = start_s + self.call_s
        return end, end + self.overhead_s

    def run_decodes(self, num_decodes: int, context_sum: int, start_s: float) -> tuple[float, float]:
        end = start_s + self.call_s
        return end, end + self.overhead_s
