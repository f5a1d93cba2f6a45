"""The real engine: the one step loop (engine.core.engine_core) with a ModelRunner, on the wall clock."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.config import ModelConfig, SchedulerConfig
from engine.core.engine_core import EngineCore, StepRecord
from engine.core.request import Request
from engine.core.scheduler import make_scheduler
from engine.model.runner import ModelRunner
from engine.observe.metrics import RequestRecord, summarize

log = logging.getLogger("miniserve.engine")

__all__ = ["Engine", "RunResult", "StepRecord"]


@dataclass
class RunResult:
    """A real run. ``records`` are in the order the requests were submitted, which is the order
    the engine admits requests that arrive at the same instant: a replay built from them (a
    simulation of the run's arrivals and lengths) keeps that order; finish order would not."""

    records: list[RequestRecord]
    steps: list[StepRecord]
    duration_s: float

    def metrics(self, **slo) -> dict:
        return summarize(self.records, self.duration_s, **slo)

    def trace_calls(self) -> list[tuple[str, float, float]]:
        """(label, start_s, dur_s) per model call, as SimResult.trace_calls gives for a simulation."""
        return [s.trace_call for s in self.steps]


class Engine:
    """An EngineCore and the ModelRunner that executes its plans."""

    def __init__(self, scheduler_config: SchedulerConfig, model_config: ModelConfig,
                 runner: ModelRunner | None = None) -> None:
        self.runner = runner or ModelRunner(model_config, scheduler_config)
        self.scheduler_config = self._within_runner(scheduler_config)
        self.core = EngineCore(self.scheduler_config)
        self._prepare_runner()

    def _within_runner(self, config: SchedulerConfig) -> SchedulerConfig:
        """``max_model_len`` no longer than the runner's KV slots (the model's positions, or the
        config it was built for): the core then refuses a request that could not run, where it
        would otherwise fail mid-run in the model and take the run's other requests with it."""
        within = config.within(self.runner.max_model_len)
        if within is not config:
            log.warning("scheduler.max_model_len=%d is longer than this runner's KV slots (the model's positions "
                        "or the config it was built with): requests are limited to %d tokens",
                        config.max_model_len, within.max_model_len)
        return within

    def _prepare_runner(self) -> None:
        """A runner shared between engines gets a prefix store when this one caches prefixes."""
        cfg = self.scheduler_config
        if cfg.enable_prefix_caching:
            self.runner.prepare_prefix_store(cfg.num_kv_blocks, cfg.block_size)

    @property
    def state(self):
        return self.core.state

    @property
    def scheduler(self):
        return self.core.scheduler

    def reset(self, scheduler_config: SchedulerConfig | None = None) -> None:
        """Fresh queues (and optionally another policy) on the same loaded model."""
        if self.core.has_unfinished:
            raise RuntimeError("cannot reset an engine with requests in flight")
        if scheduler_config is not None:
            self.scheduler_config = self._within_runner(scheduler_config)
        self.core.release(self.runner)
        self.core = EngineCore(self.scheduler_config, make_scheduler(self.scheduler_config))
        self._prepare_runner()

    def validate(self, request: Request) -> None:
        """Raise a clear ValueError for a request that could never be served. A request that
        heeds EOS (``ignore_eos=False``) without naming its token gets the model's."""
        if not request.ignore_eos and request.eos_token_id is None:
            request.eos_token_id = self.runner.eos_token_id
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise ValueError(f"request {request.request_id}: token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.runner.vocab_size})")
        self.core.state.validate(request)

    def add_request(self, request: Request) -> None:
        """Accept a request; it joins at the first step at or after its ``arrival_s``."""
        self.validate(request)
        self.core.add(request)

    def abort(self, request_id: str, now_s: float = 0.0) -> Request | None:
        """Cancel a request wherever it is (its client went away); its blocks are free for the next
        iteration, its KV slot is freed by the next plan. None if it is not in flight."""
        return self.core.abort(request_id, now_s)

    def step(self, now_s: float) -> tuple[StepRecord, list[Request]] | None:
        """One iteration at ``now_s`` (on the runner's clock), or None when nothing is runnable."""
        self.claim_runner()
        return self.core.step(now_s, self.runner)

    def claim_runner(self) -> None:
        """Make the runner's prefix store this engine's, where it caches prefixes. Engines may share
        a runner one after the other; each one's block pool numbers its blocks from 0, so another
        caching engine's run has overwritten whatever this one had cached there: its cache is
        dropped (its blocks were all idle: a shared runner's KV slots serve one engine's
        requests at a time)."""
        runner = self.runner
        if not self.scheduler_config.enable_prefix_caching or runner.prefix_owner is self.core:
            return
        if runner.prefix_owner is not None:
            self.core.state.kv.drop_cached()
        self._prepare_runner()
        runner.prefix_owner = self.core

    def run(self, requests: Iterable[Request], concurrency: int | None = None) -> RunResult:
        """Replay requests at their ``arrival_s`` (seconds from now) and serve them all; with
        ``concurrency`` (a closed-loop workload, engine.observe.workload.Workload.concurrency) that
        many clients instead: the first ``concurrency`` requests arrive at once and each finish
        issues the next at the finish's time, as the simulator's closed loop does (arrival times
        are ignored).

        Every request is checked before the clock starts, so a bad one fails the run up front.
        """
        requests = list(requests)
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids in one run must be unique")
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 (clients of a closed loop), got {concurrency}")
        for request in requests:
            self.validate(request)
        self.claim_runner()
        first, later = (requests, []) if concurrency is None else (requests[:concurrency], requests[concurrency:])
        if concurrency is not None:
            for request in first:  # the clients' first requests, at once
                request.arrival_s = 0.0
        for request in first:
            self.core.add(request)
        pending = iter(later)
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        self.runner.clock = clock
        core = self.core
        steps: list[StepRecord] = []
        finished: list[Request] = []
        try:
            while core.has_unfinished:
                done = core.step(clock(), self.runner)
                if done is not None:
                    steps.append(done[0])
                    finished += done[1]
                    for _ in done[1]:  # closed loop: each finish issues the next request, at its time
                        request = next(pending, None)
                        if request is not None:
                            request.arrival_s = done[0].end_s
                            core.add(request)
                    continue
                next_arrival = core.arrivals.next_arrival_s
                if next_arrival is None:
                    raise RuntimeError("requests are waiting but none can be scheduled and none will arrive")
                time.sleep(max(0.0, next_arrival - clock()))
        finally:
            self.runner.clock = time.perf_counter
        core.release(self.runner)  # the last step's finished requests
        submitted = {r.request_id: i for i, r in enumerate(requests)}
        finished.sort(key=lambda r: submitted[r.request_id])
        return RunResult([RequestRecord.from_request(r) for r in finished], steps, clock())

    def warmup(self, prompt_len: int = 16, max_tokens: int = 2) -> None:
        """Run a small batch through every path (prefill, decode) so first-call costs stay out."""
        n = self.scheduler_config.max_num_seqs
        self.run([Request(f"warmup-{i}", [i % self.runner.vocab_size] * prompt_len, max_tokens)
                  for i in range(n)])
        self.reset()
