"""The engine loop in its own thread, beside an asyncio HTTP layer.

Only this thread touches the Engine. Requests and cancellations reach it through a thread-safe
inbox that is drained between iterations, so a request joins at the next step boundary; tokens
go back to each request's asyncio queue with ``loop.call_soon_threadsafe``. Admission is bounded:
past ``max_waiting`` queued requests ``submit`` raises ``QueueFull`` instead of letting the
queue grow without limit.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.llm_engine import Engine, StepRecord
from engine.core.request import Request, RequestStatus

log = logging.getLogger("miniserve.engine")

clock = time.perf_counter  # CLOCK_MONOTONIC on Linux: comparable across processes on one host

FINISH_REASONS = {RequestStatus.FINISHED_LENGTH: "length", RequestStatus.FINISHED_STOPPED: "stop",
                  RequestStatus.FINISHED_ABORTED: "abort"}

# Step times run from sub-millisecond (tiny model) to seconds (a long prefill on a CPU): millisecond buckets.
STEP_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
# vLLM's buckets for the request-level latencies, so its dashboards read these unchanged
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                 240.0, 480.0, 960.0, 1920.0, 7680.0)


class QueueFull(Exception):
    """The waiting queue is at its bound; the caller should answer 429."""


class EngineClosed(Exception):
    """The engine loop has ended (shut down, or failed): nothing would serve a request; answer 503."""


@dataclass(frozen=True)
class TokenEvent:
    """Tokens one iteration produced for one request; ``finish_reason`` set on its last event.
    ``error`` set instead when the engine refused or failed the request."""

    token_ids: tuple[int, ...] = ()
    token_times_s: tuple[float, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    first_scheduled_s: float | None = None
    logprobs: tuple = ()  # one (logprob, top alternatives) per token, when the request asked


class RequestSink:
    """Where the engine thread delivers one request's events: an asyncio queue on the HTTP loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    def put(self, event: TokenEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the HTTP loop is closed: nobody is listening any more
            pass


@dataclass
class Histogram:
    """A cumulative Prometheus histogram (only the engine thread observes)."""

    buckets: tuple[float, ...] = STEP_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.count += 1
        self.total += value
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1


@dataclass
class EngineStats:
    """Counters and gauges for /metrics; written by the engine thread, read by the HTTP layer."""

    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_slots_used: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up at admission (engine.core.state), and found cached
    prefix_cache_hits: int = 0
    prefix_hit_requests: int = 0
    steps_by_phase: dict[str, int] = field(default_factory=dict)
    step_s: Histogram = field(default_factory=Histogram)
    model_s: Histogram = field(default_factory=Histogram)
    ttft_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    tpot_s: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS_S))
    e2e_s: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))

    def observe_request(self, request: Request, end_s: float) -> None:
        """A request left the engine with its tokens delivered: its latencies, vLLM-style."""
        times = request.token_times_s
        self.preemptions += request.num_preemptions
        if times:
            self.ttft_s.observe(times[0] - request.arrival_s)
            if len(times) > 1:
                self.tpot_s.observe((times[-1] - times[0]) / (len(times) - 1))
        self.e2e_s.observe(end_s - request.arrival_s)


@dataclass
class _Live:
    request: Request
    sink: RequestSink
    sent: int = 0


_STOP = object()


@dataclass(frozen=True)
class _Abort:
    request_id: str
    stopped: bool  # the HTTP layer hit a stop string: a finished request, not a cancelled one


@dataclass(frozen=True)
class _CancelAll:
    reason: str


class EngineThread:
    """Builds the engine (and warms it up) in a daemon thread, then serves its inbox forever."""

    def __init__(self, build: Callable[[], Engine], max_waiting: int, keep_steps: bool = False) -> None:
        if max_waiting < 1:
            raise ValueError(f"server.max_waiting must be >= 1, got {max_waiting}")
        self._build = build
        self.max_waiting = max_waiting
        self.keep_steps = keep_steps
        self.steps: list[StepRecord] = []  # only with keep_steps (the seed's trace), else unbounded
        self.engine: Engine | None = None
        self.ready = threading.Event()
        self.error: str | None = None
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet drained into the engine
        self._live: dict[str, _Live] = {}
        self._refusing: str | None = None  # set once shutdown has cancelled everything
        self._closed: str | None = None  # why the loop ended; submit() refuses from then on
        self._thread = threading.Thread(target=self._main, name="miniserve-engine", daemon=True)
        self.stop_requested = False  # stop() was called (it waits a bounded time: a model still loading)

    # --- called from the HTTP side -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.ready.is_set() and self.error is None and self._thread.is_alive()

    def submit(self, request: Request, sink: RequestSink) -> None:
        """Queue a validated request, or raise QueueFull past the bound."""
        with self._lock:
            if self._closed is not None:  # the inbox has been drained for the last time
                raise EngineClosed(self._closed)
            if self._queued + self.stats.num_waiting >= self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests)")
            self._queued += 1
            self._inbox.put((request, sink))

    def abort(self, request_id: str, stopped: bool = False) -> None:
        """Cancel at the next iteration boundary (no-op if it already finished); ``stopped``
        when the client's answer is complete (a stop string) rather than abandoned."""
        self._inbox.put(_Abort(request_id, stopped))

    def cancel_in_flight(self, reason: str) -> None:
        """End every accepted request now with ``reason`` (the shutdown grace period is over);
        the loop keeps running, so clients get their error while the server still answers."""
        self._inbox.put(_CancelAll(reason))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel whatever is still in flight and end the thread; again, or before start, nothing."""
        if self._thread.ident is None or not self._thread.is_alive():
            return
        self.stop_requested = True
        self._inbox.put(_STOP)
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        """Whether the thread still runs (stop() waits a bounded time: a model still loading runs on)."""
        return self._thread.is_alive()

    # --- the engine thread ---------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.engine = self._build()
        except Exception as exc:  # noqa: BLE001 - reported through /health and the log
            log.exception("engine failed to start")
            self.error = f"engine failed to start: {exc}"
            return
        cfg = self.engine.scheduler_config
        self.stats.kv_blocks_total = cfg.num_kv_blocks
        self.ready.set()
        log.info("engine ready: scheduler=%s max_num_seqs=%d", cfg.name, cfg.max_num_seqs)
        try:
            while self._drain(block=not self._has_work()):
                self._step()  # also with nothing to run: the step hands the runner what was released
        except Exception as exc:  # noqa: BLE001 - a bug in the loop must not hang clients
            log.exception("engine loop failed")
            self.error = f"engine loop failed: {exc}"
        self._cancel_all("server shutting down" if self.error is None else self.error)

    def _has_work(self) -> bool:
        core = self.engine.core
        return core.has_unfinished or bool(core.state.released)

    def _drain(self, block: bool) -> bool:
        """Apply every pending arrival and cancellation; False once asked to stop."""
        drained = 0
        keep_going = True
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is _STOP:
                    keep_going = False
                elif isinstance(item, _Abort):
                    self._abort(item.request_id, item.stopped)
                elif isinstance(item, _CancelAll):
                    self._refusing = item.reason
                    self._cancel_live(item.reason)
                else:
                    drained += 1
                    self._add(*item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            self._queued -= drained
            self._publish_gauges()
        return keep_going

    def _add(self, request: Request, sink: RequestSink) -> None:
        if self._refusing is not None:
            sink.put(TokenEvent(finish_reason="abort", error=self._refusing))
            self.stats.aborted += 1
            return
        try:
            self.engine.add_request(request)
        except ValueError as exc:  # the HTTP layer validated already; this is the last word
            sink.put(TokenEvent(finish_reason="error", error=str(exc)))
            self.stats.failed += 1
            return
        except Exception as exc:  # a bug: the loop fails (and says so), but this client is told too
            sink.put(TokenEvent(finish_reason="error", error=f"engine failed to accept the request: {exc}"))
            self.stats.failed += 1
            raise
        self._live[request.request_id] = _Live(request, sink)
        self.stats.prompt_tokens += request.num_prompt_tokens

    def _abort(self, request_id: str, stopped: bool = False) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        now = clock()
        self.engine.abort(request_id, now)
        if stopped:
            self.stats.finished += 1
            self.stats.observe_request(live.request, now)
        else:
            self.stats.aborted += 1
            self.stats.preemptions += live.request.num_preemptions
        live.sink.put(TokenEvent(finish_reason="abort"))

    def _step(self) -> None:
        engine = self.engine
        done = engine.step(clock())
        if done is None:  # nothing runnable; wait for the inbox
            if self.engine.core.has_unfinished:
                time.sleep(0.001)
            with self._lock:
                self._publish_gauges()
            return
        record = done[0]
        stats = self.stats
        stats.step_s.observe(record.end_s - record.start_s)
        stats.model_s.observe(record.model_s)
        stats.steps_by_phase[record.plan.phase] = stats.steps_by_phase.get(record.plan.phase, 0) + 1
        if self.keep_steps:
            self.steps.append(record)
        for request_id, sampled in zip(record.plan.request_ids, record.plan.samples):
            live = self._live.get(request_id) if sampled else None
            if live is not None:
                self._deliver(live)
        engine.core.state.finished.clear()  # the server keeps no history: records live with clients
        with self._lock:
            self._publish_gauges()

    def _deliver(self, live: _Live) -> None:
        request = live.request
        new = tuple(request.output_token_ids[live.sent:])
        times = tuple(request.token_times_s[live.sent:])
        logprobs = tuple(request.output_logprobs[live.sent:])
        live.sent = request.num_output_tokens
        self.stats.generation_tokens += len(new)
        finish = FINISH_REASONS.get(request.status) if request.status.is_finished else None
        first = request.first_scheduled_s if live.sent == len(new) else None
        if finish is not None:  # counted before the client can see the end of its request
            del self._live[request.request_id]
            self.stats.finished += 1
            self.stats.observe_request(request, request.finished_s or clock())
        live.sink.put(TokenEvent(new, times, finish, first_scheduled_s=first, logprobs=logprobs))

    def _publish_gauges(self) -> None:
        engine, stats = self.engine, self.stats
        # drained requests sit in the core's arrivals until the next step delivers them: they are
        # waiting too, or submit() would accept max_waiting more during that step
        stats.num_waiting = len(engine.core.state.waiting) + len(engine.core.arrivals)
        stats.num_running = len(engine.core.state.running)
        stats.kv_blocks_used = engine.core.state.kv.num_used
        stats.kv_slots_used = engine.runner.num_slots_used
        state = engine.core.state
        stats.prefix_cache_queries, stats.prefix_cache_hits = state.prefix_queries, state.prefix_hits
        stats.prefix_hit_requests = state.prefix_hit_requests

    def _cancel_all(self, reason: str) -> None:
        with self._lock:  # submit() checks this under the same lock: nothing enters after the drain below
            self._closed = reason
        self._cancel_live(reason)
        # anything still in the inbox was accepted but never started: tell its client
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, tuple):
                with self._lock:
                    self._queued -= 1
                item[1].put(TokenEvent(finish_reason="abort", error=reason))

    def _cancel_live(self, reason: str) -> None:
        for request_id in list(self._live):
            live = self._live.pop(request_id)
            if self.engine is not None and self.error is None:
                self.engine.abort(request_id, clock())
            self.stats.aborted += 1
            self.stats.preemptions += live.request.num_preemptions
            live.sink.put(TokenEvent(finish_reason="abort", error=reason))
