"""The one step loop: deliver arrivals → schedule → execute → apply (and free what is released).

The wall-clock engine (engine/llm_engine.py), the HTTP engine thread (engine/serving) and every
simulated replica (sim/simulator.py) drive this class; they differ only in the executor they
pass and in the clock that says ``now``. KV is freed in one place: each launch hands the executor
the requests that finished, were aborted or preempted since the last one (vLLM's SchedulerOutput
carries the same ids). The executor is the one seam between real and
simulated runs: ``ModelRunner`` runs the plan on the model, a simulated executor says how long it
would have taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from engine.core.arrivals import INF, ArrivalQueue
from engine.core.config import SchedulerConfig
from engine.core.plan import BatchPlan, StepResult
from engine.core.request import Request
from engine.core.scheduler import Scheduler, make_scheduler
from engine.core.state import GapSink, ServingState


class Executor(Protocol):
    def execute(self, plan: BatchPlan, requests: Mapping[str, Request], start_s: float) -> StepResult:
        """Run ``plan``: its sampled tokens (None in simulation), the call's duration, when its
        tokens came out and when the next step may start."""

    def free(self, request_ids: Iterable[str]) -> None:
        """Forget the KV of requests that finished, were aborted or preempted."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One iteration as traces and replays keep it: the plan, when it started (arrivals admitted
    up to then), when its tokens came out, how much of that was the model call, which replica."""

    plan: BatchPlan
    start_s: float
    end_s: float
    model_s: float
    replica: int = 0

    @property
    def trace_call(self) -> tuple[str, float, float]:
        """(label, start_s, dur_s) of the model call, for engine.observe.trace.write_chrome_trace."""
        return self.plan.label, self.end_s - self.model_s, self.model_s


class EngineCore:
    """A scheduler and its serving state, stepped by whoever owns the clock.

    ``launch`` and ``land`` are the two halves of ``step``: a simulator lets simulated time pass
    between them (the call is in flight); everyone else calls ``step``.
    """

    def __init__(self, config: SchedulerConfig, scheduler: Scheduler | None = None,
                 repeat_decode_steps: bool = True, keep_token_times: bool = True) -> None:
        self.config = config
        self.scheduler = scheduler or make_scheduler(config)
        self.state = ServingState(config, keep_token_times)  # False: a simulator's compact records
        self.arrivals = ArrivalQueue(())
        # repeat a decodes-only step without scheduling while nothing changed (Scheduler.decode_steps_repeat)
        self.repeat_decode_steps = repeat_decode_steps and self.scheduler.decode_steps_repeat
        self._steady = False  # the last plan only decoded together and nothing has changed since

    # --- requests ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Accept a request (it joins the state at the first step at or after its ``arrival_s``);
        one that could never run here is refused with a ValueError and nothing changes."""
        if self.arrivals.holds(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self.state.validate(request)
        self.arrivals.push(request)

    def abort(self, request_id: str, now_s: float) -> Request | None:
        """Cancel a request wherever it is; its KV is released to the next plan. None if unknown."""
        request = self.arrivals.remove(request_id)
        if request is not None:
            return request
        self._steady = False
        return self.state.abort(request_id, now_s)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.arrivals) or self.state.has_unfinished

    # --- one iteration -------------------------------------------------------------------------
    def launch(self, now_s: float, executor: Executor) -> tuple[BatchPlan, StepResult] | None:
        """Deliver what has arrived by ``now_s``, schedule and execute; None when nothing can run."""
        state = self.state
        if self.arrivals.next_s <= now_s:
            if not state.waiting:  # behind a waiting head, an arrival changes no plan (FCFS)
                self._steady = False
            for request in self.arrivals.pop_due(now_s):
                state.enqueue(request)  # validated by add()
        if self._steady:  # the last step again, one token further (Scheduler.decode_steps_repeat) ...
            part = state.decode_together()
            plan = (BatchPlan(self.scheduler.name, (), (), (), (), 0, (), *part) if part is not None
                    else self.scheduler.schedule(state))  # ... unless blocks ran short: the policy decides
        else:
            plan = self.scheduler.schedule(state)
        self.release(executor)  # since the last launch, and preempted by this plan
        if plan is None:
            return None
        return plan, executor.execute(plan, state.requests, now_s)

    def release(self, executor: Executor) -> None:
        """Hand the executor the KV of requests that finished, were aborted or preempted since it
        was last told. Every launch does; a driver that stops launching (the end of a run) does
        once more, so nothing stays held."""
        if self.state.released:
            executor.free(self.state.take_released())

    def land(self, plan: BatchPlan, result: StepResult, start_s: float) -> list[Request]:
        """The call's tokens, at its end: advance the requests; returns those that finished."""
        state = self.state
        finished = state.apply(plan, result.token_ids, start_s, result.end_s)
        if self.repeat_decode_steps:  # see Scheduler.decode_steps_repeat
            waiting = state.waiting
            # a finish frees a seat and blocks, which only matters to a request waiting for them
            self._steady = ((not plan.ids and (not finished or not waiting))
                            or (not waiting and 0 < state.num_decoding == len(state.running)
                                and state.num_decoding <= self.config.max_num_batched_tokens))
        return finished

    @property
    def steady(self) -> bool:
        """The next step repeats the last one (decodes together, nothing else), unless a request
        arrives first or blocks run short."""
        return self._steady

    def repeat_decodes(self, start_s: float, decode_costs: Callable[[int], tuple[float, float, float, float] | None],
                       until_s: float, gaps: GapSink | None = None
                       ) -> tuple[int, float, float, list[Request]]:
        """While ``steady``: the repeated steps from ``start_s`` run at once, without a plan each
        — a simulator's shortcut when a decodes-only step of ``n`` requests costs
        ``decode_costs(n) = (seconds before the call, the call's seconds, its seconds per context
        token, seconds after it)`` (None: each step must be planned). Stops before a step that
        starts at or after the next arrival, ends after ``until_s`` (another event) or lacks
        blocks, and after one in which requests finish (still ``steady`` then if nothing waits:
        call again for the rest). Returns (steps, last end, last ready, finished). Token times
        and blocks are those of running each step through ``launch`` and ``land``."""
        state = self.state
        arrival_s = self.arrivals.next_s if not state.waiting else INF  # (see launch)
        if not self._steady or start_s >= arrival_s:
            return 0, start_s, start_s, []
        costs = decode_costs(state.num_decoding)
        if costs is None:
            return 0, start_s, start_s, []
        before_s, step_s, per_context_s, overhead_s = costs  # named: a compiled build then calls natively
        steps, end, ready, finished = state.repeat_decodes(start_s, before_s, step_s, per_context_s, overhead_s,
                                                           arrival_s, until_s, gaps)
        if finished:
            self._steady = not state.waiting  # as land() after a step in which requests finish
        return steps, end, ready, finished

    def step(self, now_s: float, executor: Executor) -> tuple[StepRecord, list[Request]] | None:
        """One iteration at ``now_s``: its record and the requests it finished, or None."""
        launched = self.launch(now_s, executor)
        if launched is None:
            return None
        plan, result = launched
        finished = self.land(plan, result, now_s)
        return StepRecord(plan, now_s, result.end_s, result.duration_s), finished
