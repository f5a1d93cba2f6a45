"""The real engine loop: arrivals → schedule → one packed model call → apply, on the wall clock."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.arrivals import ArrivalQueue
from engine.core.config import ModelConfig, SchedulerConfig
from engine.observe.metrics import RequestRecord, summarize
from engine.model.runner import ModelRunner
from engine.core.plan import BatchPlan
from engine.core.request import Request
from engine.core.scheduler import make_scheduler
from engine.core.state import ServingState


@dataclass(frozen=True)
class StepRecord:
    """One iteration: the plan, when it started (arrivals admitted up to then), when its tokens
    came out, and how much of that was the model call itself."""

    plan: BatchPlan
    start_s: float
    end_s: float
    model_s: float

    @property
    def trace_call(self) -> tuple[str, float, float]:
        """(label, start_s, dur_s) of the model call, for engine.observe.trace.write_chrome_trace."""
        return self.plan.label, self.end_s - self.model_s, self.model_s


@dataclass
class RunResult:
    records: list[RequestRecord]
    steps: list[StepRecord]
    duration_s: float

    def metrics(self, **slo) -> dict:
        return summarize(self.records, self.duration_s, **slo)

    def trace_calls(self) -> list[tuple[str, float, float]]:
        """(label, start_s, dur_s) per model call, as SimResult.trace_calls gives for a simulation."""
        return [s.trace_call for s in self.steps]


class Engine:
    def __init__(self, scheduler_config: SchedulerConfig, model_config: ModelConfig,
                 runner: ModelRunner | None = None) -> None:
        self.scheduler_config = scheduler_config
        self.runner = runner or ModelRunner(model_config, scheduler_config)
        self.scheduler = make_scheduler(scheduler_config)
        self.state = ServingState(scheduler_config)

    @property
    def core(self) -> Engine:
        """Where the serving state lives (``engine.core.state``) until the EngineCore split lands."""
        return self

    def reset(self, scheduler_config: SchedulerConfig | None = None) -> None:
        """Fresh queues (and optionally another policy) on the same loaded model."""
        if self.state.has_unfinished:
            raise RuntimeError("cannot reset an engine with requests in flight")
        if scheduler_config is not None:
            self.scheduler_config = scheduler_config
            self.scheduler = make_scheduler(scheduler_config)
        self.state = ServingState(self.scheduler_config)

    def validate(self, request: Request) -> None:
        """Raise a clear ValueError for a request that could never be served."""
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise ValueError(f"request {request.request_id}: token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.runner.vocab_size})")
        self.state.validate(request)

    def add_request(self, request: Request) -> None:
        self.validate(request)
        self.state.add(request)

    def abort(self, request_id: str, now_s: float = 0.0) -> Request | None:
        """Cancel a request wherever it is (its client went away) and return its KV slot now,
        so the next iteration can give the space to someone else. None if it is not in flight."""
        request = self.state.abort(request_id, now_s)
        self.runner.free([request_id])
        return request

    def step(self, start_s: float, clock) -> StepRecord | None:
        """One iteration, or None when nothing is runnable."""
        plan = self.scheduler.schedule(self.state)
        if plan is None:
            return None
        result = self.runner.execute(plan, self.state.requests)
        end_s = clock()
        finished = self.state.apply(plan, result.token_ids, start_s, end_s)
        self.runner.free(r.request_id for r in finished)
        return StepRecord(plan, start_s, end_s, result.duration_s)

    def run(self, requests: Iterable[Request]) -> RunResult:
        """Replay requests at their ``arrival_s`` (seconds from now) and serve them all.

        Every request is checked before the clock starts, so a bad one fails the run up front.
        """
        requests = list(requests)
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids in one run must be unique")
        for request in requests:
            self.validate(request)
        arrivals = ArrivalQueue(requests)
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        steps: list[StepRecord] = []
        first_finished = len(self.state.finished)
        while arrivals or self.state.has_unfinished:
            now = clock()
            for request in arrivals.pop_due(now):
                self.add_request(request)
            record = self.step(now, clock)
            if record is not None:
                steps.append(record)
                continue
            next_arrival = arrivals.next_arrival_s
            if next_arrival is None:
                raise RuntimeError("requests are waiting but none can be scheduled and none will arrive")
            time.sleep(max(0.0, next_arrival - clock()))
        finished = self.state.finished[first_finished:]
        return RunResult([RequestRecord.from_request(r) for r in finished], steps, clock())

    def warmup(self, prompt_len: int = 16, max_tokens: int = 2) -> None:
        """Run a small batch through every path (prefill, decode) so first-call costs stay out."""
        n = self.scheduler_config.max_num_seqs
        self.run([Request(f"warmup-{i}", [i % self.runner.vocab_size] * prompt_len, max_tokens)
                  for i in range(n)])
        self.reset()
