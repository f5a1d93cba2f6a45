"""The simulator: SimPy processes around the engine's own step loop (engine.core.engine_core).

Each replica is an EngineCore with a simulated executor: at the step's start ``now`` the core
delivers every request that has arrived, schedules and "executes" (the executor says when the
tokens come out), SimPy time passes while the call is in flight, and the core lands the step.
When nothing is runnable the process sleeps on an event that the next delivered request fires.
Arrivals come from an open-loop process (the workload's times) or from closed-loop clients that
issue a request whenever one finishes; a router picks the replica for each.
"""

from __future__ import annotations

import gc
from array import array
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any
from dataclasses import dataclass, field

import simpy
from simpy.events import URGENT, Event

from engine.core.config import SchedulerConfig
from engine.core.engine_core import EngineCore, StepRecord
from engine.core.request import Request
from engine.core.state import ServingState
from sim.records import RequestLog
from sim.router import make_router
from sim.executors import SimExecutor


TIMESERIES_COLUMNS = ("time_s", "replica", "queue", "active", "kv_blocks_used")  # TimeSeries.rows() order


@dataclass
class TimeSeries:
    """Sampled at every step start, after scheduling: what the step sees."""

    time_s: array = field(default_factory=lambda: array("d"))
    replica: array = field(default_factory=lambda: array("l"))
    queue: array = field(default_factory=lambda: array("l"))
    active: array = field(default_factory=lambda: array("l"))
    kv_blocks_used: array = field(default_factory=lambda: array("l"))

    def __len__(self) -> int:
        return len(self.time_s)

    def rows(self) -> Iterable[tuple]:
        return zip(self.time_s, self.replica, self.queue, self.active, self.kv_blocks_used)


class CallLog:
    """Each model call as a Chrome trace needs it, (label, start, duration, replica), in typed
    arrays with the labels interned: ~22 bytes a call, where a StepRecord keeping its plan takes
    ~600 (a serial replay of an hour-long trace makes 3.8 M calls: 3.4 GB of step records)."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self.names: list[str] = []
        self.label = array("l")
        self.start_s = array("d")
        self.dur_s = array("d")
        self.replica = array("l")

    def add(self, label: str, start_s: float, dur_s: float, replica: int) -> None:
        i = self._index.get(label)
        if i is None:
            i = self._index[label] = len(self.names)
            self.names.append(label)
        self.label.append(i)
        self.start_s.append(start_s)
        self.dur_s.append(dur_s)
        self.replica.append(replica)

    def __len__(self) -> int:
        return len(self.label)

    def every_call(self) -> Iterator[tuple[str, float, float]]:
        """(label, start_s, dur_s) of every call, replicas interleaved in the order they started."""
        names = self.names
        for i, start, dur in zip(self.label, self.start_s, self.dur_s):
            yield names[i], start, dur

    def of_replica(self, replica: int) -> Iterator[tuple[str, float, float]]:
        """(label, start_s, dur_s) of one replica's calls, in order (write_chrome_trace's input)."""
        names = self.names
        for i, start, dur, r in zip(self.label, self.start_s, self.dur_s, self.replica):
            if r == replica:
                yield names[i], start, dur


@dataclass
class SimResult:
    log: RequestLog
    steps: list[StepRecord]
    timeseries: TimeSeries | None
    duration_s: float
    num_steps: int
    num_replicas: int
    workload_clipped: dict | None = None  # a trace's lengths cut to the workload's max (sim.run)
    calls: CallLog | None = None  # keep_calls: every call as a trace needs it, compactly

    @property
    def records(self) -> list:
        """engine.observe.metrics.RequestRecord per finished request (``keep_token_times`` runs)."""
        if not self.log.keep_token_times:
            raise ValueError("this run kept compact records only (keep_token_times=False)")
        return self.log.records

    def metrics(self, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> dict:
        return self.log.summarize(self.duration_s, slo_ttft_s, slo_tpot_s)

    def trace_calls(self) -> list[tuple[str, float, float]]:
        """(label, start_s, dur_s) per model call, for engine.observe.trace.write_chrome_trace, from
        the call log or the steps, whichever was kept; a run that kept neither has none to give."""
        if self.calls is not None:
            return list(self.calls.every_call())
        if self.num_steps and not self.steps:
            raise ValueError("this simulation kept neither its steps nor its calls: run it with "
                             "keep_steps=True or keep_calls=True for its trace")
        return [s.trace_call for s in self.steps]

    def replica_calls(self, replica: int) -> Iterator[tuple[str, float, float]]:
        """One replica's (label, start_s, dur_s), from the call log or the steps, whichever was kept."""
        if self.calls is not None:
            return self.calls.of_replica(replica)
        return (s.trace_call for s in self.steps if s.replica == replica)


EARLY_DELIVERIES = 64  # requests handed to a load-blind router before they arrive


class _Delivery(Event):
    """A timeout at URGENT priority: an arrival at time t is delivered before any engine step
    that starts at t, as the real engine admits every request with ``arrival_s <= now``."""

    def __init__(self, env: simpy.Environment, delay: float) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, URGENT, delay)


class Replica:
    """One engine: an EngineCore and the executor that times its plans."""

    def __init__(self, index: int, env: simpy.Environment, config: SchedulerConfig, executor: SimExecutor,
                 sim: Simulation) -> None:
        self.index = index
        self.env = env
        self.executor = executor
        self.sim = sim
        self.core = EngineCore(config, keep_token_times=sim.log.keep_token_times)
        self.closed = False  # no more deliveries will come
        self._wakeup: Event | None = None
        self.num_steps = 0
        self.last_end_s = 0.0
        self.repeat = sim.repeat_decodes

    @property
    def state(self) -> ServingState:
        return self.core.state

    @property
    def outstanding(self) -> int:
        return len(self.core.arrivals) + len(self.core.state.requests)

    def deliver(self, request: Request) -> None:
        self.core.add(request)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.succeed()
            self._wakeup = None

    def run(self) -> Generator[Event, Any, None]:
        """The engine loop (a SimPy process). Times are carried exactly in ``now``/``end``;
        ``env.now`` only orders events. In open loop, a wait that no other event falls into
        (``env.peek()`` is later) is not yielded to SimPy: nothing could observe it."""
        env, core, executor, sim = self.env, self.core, self.executor, self.sim
        state, arrivals = core.state, core.arrivals  # (core's methods are called on it: compiled, natively)
        timeout, peek = env.timeout, env.peek
        steps, series, log, calls = sim.steps, sim.timeseries, sim.log, sim.calls
        kv, waiting, running, finished_list = state.kv, state.waiting, state.running, state.finished
        # compact records count the gaps of requests decoding together here, once per step
        itl = None if log.keep_token_times else log.itl
        # repeated decodes-only steps run at once (EngineCore.repeat_decodes) unless each step is kept
        repeat = steps is None and series is None and calls is None and self.repeat
        check = sim.check
        rest, decode_costs = executor.rest, executor.decode_costs
        idle_from: float | None = None  # since when nothing could run
        now = env.now
        while True:
            if idle_from is not None:  # first: a step after a rest may start late (CostModelExecutor.start)
                rest(now - idle_from)
            start = executor.start(now)
            if start > now:
                yield timeout(start - env.now)
                now = start
            launched = core.launch(now, executor)
            if launched is None:
                if idle_from is None:
                    idle_from = now
                if arrivals:  # delivered, not yet arrived (or a rounding hair ahead of now)
                    later = arrivals.next_s
                    yield timeout(later - env.now)
                    now = later
                elif self.closed:
                    return
                else:
                    self._wakeup = env.event()
                    yield self._wakeup
                    now = max(now, env.now)
                continue
            plan, result = launched
            idle_from = None
            end, ready = result.end_s, result.ready_s
            if steps is not None:
                steps.append(StepRecord(plan.materialize(), now, end, result.duration_s, self.index))
            if calls is not None:
                calls.add(plan.label, end - result.duration_s, result.duration_s, self.index)
            if series is not None:
                series.time_s.append(now)
                series.replica.append(self.index)
                series.queue.append(len(waiting))
                series.active.append(len(running))
                series.kv_blocks_used.append(kv.num_used)
            on_finish = sim.on_finish  # closed loop: a finish issues requests to any replica
            until_s = peek()
            unobserved = on_finish is None and until_s > ready  # no event before the next step
            if not unobserved:
                yield timeout(end - env.now)
            finished = core.land(plan, result, now)
            if check:
                state.check_invariants()
            if itl is not None:
                gap, count = state.last_uniform_gaps
                if count:
                    itl.add(gap, count)
            self.num_steps += 1
            self.last_end_s = end
            if finished:
                finished_list.clear()  # the log keeps what is needed; drop the Request objects
                for request in finished:
                    log.add(request)
                if on_finish is not None:
                    on_finish(len(finished), end)
            while unobserved and repeat and core.steady:  # the same step again and again: run them at once
                n, run_end, run_ready, finished = core.repeat_decodes(ready, decode_costs, until_s, itl)
                if not n:
                    break
                end, ready = run_end, run_ready
                if check:
                    state.check_invariants()
                self.num_steps += n
                self.last_end_s = end
                if not finished:
                    break  # an arrival, another event or blocks short is next
                finished_list.clear()
                for request in finished:
                    log.add(request)
            if ready > end and not unobserved:
                yield timeout(ready - env.now)
            now = ready


class Simulation:
    """Wires replicas, a router and an arrival source into one SimPy environment."""

    def __init__(self, config: SchedulerConfig, make_executor: Callable[[], SimExecutor], num_replicas: int = 1,
                 router: str = "round_robin", keep_steps: bool = False, timeseries: bool = False,
                 keep_token_times: bool = True, repeat_decodes: bool = True, check: bool = False,
                 keep_calls: bool = False) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.env = simpy.Environment()
        self.router = make_router(router)
        self.steps: list[StepRecord] | None = [] if keep_steps else None
        self.calls: CallLog | None = CallLog() if keep_calls else None  # a trace without the steps
        self.timeseries = TimeSeries() if timeseries else None
        self.log = RequestLog(keep_token_times)
        self.on_finish: Callable[[int, float], None] | None = None
        self.repeat_decodes = repeat_decodes  # off: every step through launch and land (tests compare)
        self.check = check  # tests: the state's invariants after every step and every run of steps
        self.replicas = [Replica(i, self.env, config, make_executor(), self) for i in range(num_replicas)]

    def _dispatch(self, request: Request) -> None:
        self.replicas[self.router.pick(self.replicas)].deliver(request)

    def _close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def _open_loop(self, requests: Iterator[Request]) -> Generator[Event, Any, None]:
        """Deliver each request at its arrival time; or, when the router's pick does not depend on
        the replicas' load, in batches of EARLY_DELIVERIES ahead of time: a replica admits nothing
        before its arrival_s either way, and the engines run on without an event per arrival."""
        env = self.env
        early = not self.router.reads_load
        last = 0.0
        num_early = 0  # delivered ahead of their arrival, the latest at `last`
        for request in requests:
            arrival = request.arrival_s
            if arrival < last:
                raise ValueError(f"request {request.request_id} arrives at {arrival} s, before the "
                                 f"previous one ({last} s): a lazy request source must be in arrival order")
            if arrival > env.now:
                if not early:
                    yield _Delivery(env, arrival - env.now)
                elif num_early == EARLY_DELIVERIES:  # wait until the batch has arrived
                    yield _Delivery(env, last - env.now)
                    num_early = 0
                num_early += 1
            last = arrival
            self._dispatch(request)
        self._close()

    def _closed_loop(self, requests: Iterator[Request], concurrency: int) -> None:
        """``concurrency`` clients: each finish issues the next request at the finish time."""

        def issue(count: int, now: float) -> None:
            for _ in range(count):
                request = next(requests, None)
                if request is None:
                    self.on_finish = None
                    self._close()
                    return
                request.arrival_s = now
                self._dispatch(request)

        self.on_finish = issue
        issue(concurrency, 0.0)

    def run(self, requests: Iterable[Request], concurrency: int | None = None) -> SimResult:
        """Serve every request; ``concurrency`` set means closed loop (arrival times are ignored).

        A list is checked up front (unique ids, each servable) as Engine.run does; any other
        iterable is consumed lazily, in arrival order, and checked as each request arrives.
        """
        if isinstance(requests, Sequence):
            requests = list(requests)
            if len({r.request_id for r in requests}) != len(requests):
                raise ValueError("request ids in one run must be unique")
            for request in requests:
                self.replicas[0].state.validate(request)
            if concurrency is None:
                requests.sort(key=lambda r: r.arrival_s)
        source = iter(requests)
        del requests  # a lazy source's requests must not outlive their finish
        if concurrency is None:
            self.env.process(self._open_loop(source))
        else:
            self._closed_loop(source, concurrency)
        for replica in self.replicas:
            self.env.process(replica.run())
        collecting = gc.isenabled()
        gc.disable()  # millions of short-lived objects and no cycles among them: reference counts free
        try:          # them all, and the cyclic collector's scans of a long run's live heap find nothing
            self.env.run()
        finally:
            if collecting:
                gc.enable()
        stuck = [r for rep in self.replicas for r in (*rep.state.waiting, *rep.state.running, *rep.core.arrivals)]
        if stuck:
            raise RuntimeError(f"{len(stuck)} requests were never served (e.g. {stuck[0].request_id})")
        return SimResult(
            log=self.log,
            steps=self.steps if self.steps is not None else [],
            timeseries=self.timeseries,
            duration_s=max((rep.last_end_s for rep in self.replicas), default=0.0),
            num_steps=sum(rep.num_steps for rep in self.replicas),
            num_replicas=len(self.replicas),
            calls=self.calls,
        )


def simulate(requests: Iterable[Request], config: SchedulerConfig, make_executor: Callable[[], SimExecutor],
             concurrency: int | None = None, **options) -> SimResult:
    """One simulated run; ``options`` are Simulation's (num_replicas, router, keep_steps, ...)."""
    return Simulation(config, make_executor, **options).run(requests, concurrency)
