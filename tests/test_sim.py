"""The simulator on its own: seed call counts, exact hand-computed metrics, conservation at any
rate, replicas and routers, closed loop, compact records, capacity search."""

import gc
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.config import SchedulerConfig
from engine.core.request import Request
from engine.observe.trace import summarize_trace, write_chrome_trace
from engine.observe.workload import LengthDist, WorkloadConfig, generate, make_requests
from sim import ConstantExecutor, CostModelExecutor, Simulation, simulate, workload_requests
from sim.executors import cost_model_from
from sim.capacity import search_capacity
from tests.helpers import create_requests, drain

COST = cost_model_from(step_overhead_s=1e-4, const=1e-3, prefill_tokens=1e-5, decode_tokens=1e-4,
                       decode_context=1e-7, prefill_attention=1e-8, num_requests=1e-5)
SEED_CALLS = {"serial": (160, 16, 144), "static": (32, 2, 30), "continuous": (28, None, None)}


@pytest.mark.parametrize("name", ["serial", "static", "continuous"])
def test_seed_burst_call_counts_match_the_engine_through_the_trace(tmp_path, name):
    config = SchedulerConfig(name=name, max_num_seqs=8)
    sim = simulate(create_requests(16), config, lambda: ConstantExecutor(0.01), keep_steps=True)
    plans, _ = drain(config, create_requests(16))  # the pure policy the engine's loop is tested against
    assert [s.plan for s in sim.steps] == plans
    write_chrome_trace(sim.trace_calls(), tmp_path / "trace.json")
    summary = summarize_trace(tmp_path / "trace.json", max_num_seqs=8)
    calls, prefills, decodes = SEED_CALLS[name]
    assert summary.model_calls == calls == sim.num_steps
    if prefills is not None:
        assert (summary.prefill_calls, summary.decode_calls) == (prefills, decodes)
    assert sim.metrics()["total_output_tokens"] == 160
    assert set(summary.calls_by_label) == {p.label for p in plans}


def one_request(arrival_s: float = 0.0) -> list[Request]:
    return [Request("only", range(10), 5, arrival_s=arrival_s)]


def test_one_request_constant_cost_gives_exact_metrics():
    sim = simulate(one_request(), SchedulerConfig(name="serial"), lambda: ConstantExecutor(0.1))
    (rec,) = sim.records
    assert rec.token_times_s == pytest.approx((0.1, 0.2, 0.3, 0.4, 0.5), abs=1e-12)
    m = sim.metrics()
    assert m["completed"] == 1 and m["failed"] == 0
    assert m["duration_s"] == pytest.approx(0.5)
    assert m["ttft_s"]["p50"] == pytest.approx(0.1) and m["ttft_s"]["p99"] == pytest.approx(0.1)
    assert m["tpot_s"]["mean"] == pytest.approx(0.1) and m["itl_s"]["p99"] == pytest.approx(0.1)
    assert m["e2el_s"]["mean"] == pytest.approx(0.5)
    assert m["output_throughput_tok_s"] == pytest.approx(10.0)
    assert m["total_token_throughput_tok_s"] == pytest.approx(30.0)
    assert m["queue_s"]["mean"] == 0.0


def test_idle_engine_waits_for_the_arrival_and_cost_model_adds_overhead_between_calls():
    # call = const 0.1 s + 0.01 s per prefill token; then 0.05 s outside the call before the next step
    cost = cost_model_from(step_overhead_s=0.05, const=0.1, prefill_tokens=0.01)
    sim = simulate(one_request(arrival_s=2.0), SchedulerConfig(name="continuous"), lambda: CostModelExecutor(cost))
    (rec,) = sim.records
    # prefill 10 tokens: 0.2 s; then 4 decodes of 0.1 s, each after 0.05 s of overhead
    assert rec.first_scheduled_s == 2.0
    assert rec.token_times_s == pytest.approx((2.2, 2.35, 2.5, 2.65, 2.8), abs=1e-12)
    m = sim.metrics()
    assert m["ttft_s"]["mean"] == pytest.approx(0.2)
    assert m["tpot_s"]["mean"] == pytest.approx(0.15)
    assert m["e2el_s"]["mean"] == pytest.approx(0.8)



def test_the_overhead_before_the_call_delays_the_tokens_as_in_the_real_loop():
    # of the 0.05 s outside the call, 0.02 s is spent before it (scheduling, packing): the real
    # loop stamps a step's start before scheduling and its tokens after the call
    cost = cost_model_from(step_overhead_s=0.05, const=0.1, prefill_tokens=0.01)
    cost = replace(cost, info={"step_overhead": {"before_call_median_s": 0.02}})
    assert cost.before_call_s == 0.02
    sim = simulate(one_request(arrival_s=2.0), SchedulerConfig(name="continuous"), lambda: CostModelExecutor(cost))
    (rec,) = sim.records
    # each step: 0.02 before, the call, 0.03 after; step to step still 0.05 + call
    assert rec.token_times_s == pytest.approx((2.22, 2.37, 2.52, 2.67, 2.82), abs=1e-12)
    assert sim.metrics()["ttft_s"]["mean"] == pytest.approx(0.22)



def test_a_time_scale_stretches_every_call_and_the_time_around_it():
    # one request on a machine 1.5x slower: 0.03 before each call and 0.045 after it, calls 1.5x,
    # the repeated-decode runs too (decode_costs), so every token time is 1.5x the base run's
    cost = cost_model_from(step_overhead_s=0.05, const=0.1, prefill_tokens=0.01, decode_context=0.001)
    cost = replace(cost, info={"step_overhead": {"before_call_median_s": 0.02}})
    base = simulate(one_request(arrival_s=0.0), SchedulerConfig(name="continuous"), lambda: CostModelExecutor(cost))
    slow = simulate(one_request(arrival_s=0.0), SchedulerConfig(name="continuous"),
                    lambda: CostModelExecutor(cost, 1.5))
    assert slow.records[0].token_times_s == pytest.approx([1.5 * t for t in base.records[0].token_times_s], abs=1e-12)
    assert CostModelExecutor(cost, 1.5).decode_costs(3) == pytest.approx(
        tuple(1.5 * x for x in CostModelExecutor(cost).decode_costs(3)))
    with pytest.raises(ValueError, match="time_scale"):
        CostModelExecutor(cost, 0.0)


def test_the_first_call_after_the_engine_sat_idle_costs_the_profiles_extra():
    # a call after >= 0.1 s of idle takes 0.03 s more (calibration.profiler.measure_after_idle)
    cost = cost_model_from(const=0.1)
    cost = replace(cost, info={"after_idle": {"idle_s": 0.1, "extra_s": 0.03}})
    requests = [Request("a", range(4), 2, arrival_s=1.0), Request("b", range(4), 2, arrival_s=1.25),
                Request("c", range(4), 2, arrival_s=1.40)]
    sim = simulate(requests, SchedulerConfig(name="serial"), lambda: CostModelExecutor(cost))
    a, b, c = sim.records
    assert a.token_times_s == pytest.approx((1.13, 1.23))  # idle 1 s before: 0.13, then 0.1 back to back
    assert b.token_times_s == pytest.approx((1.35, 1.45))  # idle 0.02 s (1.23 → 1.25): no extra
    assert c.token_times_s == pytest.approx((1.55, 1.65))  # arrived while b ran: never idle


def test_the_first_step_after_a_rest_starts_late_and_spends_the_profiles_time_before_its_call():
    """The real loop sleeps until the next arrival and wakes late (whoever arrives meanwhile joins
    the step), then schedules and packs in cold caches (calibration.profiler.measure_idle_steps)."""
    cost = replace(cost_model_from(step_overhead_s=0.003, const=0.1),
                   info={"step_overhead": {"before_call_median_s": 0.002, "idle_wake_median_s": 0.004,
                                           "idle_before_call_median_s": 0.01}})
    def requests():
        return [Request("a", range(4), 1, arrival_s=0.0), Request("b", range(4), 1, arrival_s=1.0),
                Request("c", range(4), 1, arrival_s=1.003), Request("d", range(4), 1, arrival_s=1.2)]
    sim = simulate(requests(), SchedulerConfig(name="static", max_num_seqs=4), lambda: CostModelExecutor(cost),
                   keep_steps=True)
    a, b, c, d = sim.records
    assert a.first_scheduled_s == 0.0 and a.token_times_s[0] == pytest.approx(0.102)  # no rest before the run's first
    assert b.first_scheduled_s == c.first_scheduled_s == pytest.approx(1.004)  # c arrived while the loop woke
    assert b.token_times_s[0] == c.token_times_s[0] == pytest.approx(1.004 + 0.01 + 0.1)
    assert d.first_scheduled_s == pytest.approx(1.204) and d.token_times_s[0] == pytest.approx(1.314)
    assert [s.model_s for s in sim.steps] == pytest.approx([0.1] * 3)
    old = replace(cost, info={"step_overhead": {"before_call_median_s": 0.002}})  # profiles from before: as busy
    b_old = simulate(requests()[:2], SchedulerConfig(name="serial"), lambda: CostModelExecutor(old)).records[1]
    assert b_old.first_scheduled_s == 1.0 and b_old.token_times_s[0] == pytest.approx(1.102)


def test_the_first_call_after_idle_costs_more_the_longer_the_engine_sat():
    # measured at 0.1, 1 and 10 s of idle: 0, 0.02 and 0.05 s more (calibration.profiler.measure_after_idle)
    levels = [{"idle_s": 0.1, "extra_s": 0.0}, {"idle_s": 1.0, "extra_s": 0.02}, {"idle_s": 10.0, "extra_s": 0.05}]
    cost = replace(cost_model_from(const=0.1), info={"after_idle": {"levels": levels}})
    requests = [Request("a", range(4), 1, arrival_s=2.0), Request("b", range(4), 1, arrival_s=30.0),
                Request("c", range(4), 1, arrival_s=30.15 + 10 ** 0.5)]
    sim = simulate(requests, SchedulerConfig(name="serial"), lambda: CostModelExecutor(cost))
    a, b, c = sim.records
    assert a.token_times_s[0] == pytest.approx(2.0 + 0.1 + 0.02 + 0.03 * math.log10(2))  # 2 s idle: log-linear
    assert b.token_times_s[0] == pytest.approx(30.0 + 0.1 + 0.05)  # ~28 s: the longest measured idle's extra
    assert c.token_times_s[0] == pytest.approx(c.arrival_s + 0.1 + 0.035)  # √10 s: halfway from 1 to 10 s
    # a machine 1.5× slower takes 1.5× the extra too, after the same rest
    slow = simulate([Request("a", range(4), 1, arrival_s=2.0)], SchedulerConfig(name="serial"),
                    lambda: CostModelExecutor(cost, 1.5))
    assert slow.records[0].token_times_s[0] == pytest.approx(2.0 + 1.5 * (0.1 + 0.02 + 0.03 * math.log10(2)))


def test_after_idle_reads_old_and_new_profiles_and_never_costs_less_after_a_longer_idle():
    from calibration.cost_model import AfterIdle

    assert AfterIdle.of({}).extra(100.0) == 0.0  # profiles from before it was measured
    one = AfterIdle.of({"after_idle": {"idle_s": 0.1, "extra_s": 0.03, "pairs": 20}})
    assert (one.extra(0.09), one.extra(0.1), one.extra(50.0)) == (0.0, 0.03, 0.03)
    noisy = AfterIdle.of({"after_idle": {"levels": [{"idle_s": 4.0, "extra_s": 0.01}, {"idle_s": 0.1, "extra_s": -0.002},
                                                    {"idle_s": 1.0, "extra_s": 0.02}]}})
    assert noisy.idle_s == (0.1, 1.0, 4.0) and noisy.extra_s == (0.0, 0.02, 0.02)  # sorted, ≥ 0, never falling
    xs = [0.05 * 1.2 ** i for i in range(40)]
    assert all(noisy.extra(x) <= noisy.extra(y) for x, y in zip(xs, xs[1:]))
    # no idle length measured (no idle shape fit the grid), or a length of 0: no extra, no error
    assert AfterIdle.of({"after_idle": {"levels": []}}).extra(10.0) == 0.0
    zero = AfterIdle.of({"after_idle": {"levels": [{"idle_s": 0.0, "extra_s": 0.01}, {"idle_s": 1.0, "extra_s": 0.02}]}})
    assert (zero.idle_s, zero.extra(0.5), zero.extra(2.0)) == ((1.0,), 0.0, 0.02)

SCHEDULERS = st.sampled_from([
    SchedulerConfig(name="serial", max_num_seqs=4),
    SchedulerConfig(name="static", max_num_seqs=4),
    SchedulerConfig(name="continuous", max_num_seqs=4, max_num_batched_tokens=32, long_prefill_token_threshold=8),
    SchedulerConfig(name="continuous", max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=16,
                    num_kv_blocks=12, block_size=8, max_model_len=96),  # preempts
    SchedulerConfig(name="continuous", max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=16,
                    num_kv_blocks=12, block_size=8, max_model_len=96, enable_prefix_caching=True),  # and re-admits
    # from the cache: a whole-block prompt with one output comes back as a 1-token prefill chunk
])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=SCHEDULERS, rate=st.floats(0.01, 1e5), n=st.integers(1, 40), seed=st.integers(0, 1000),
       arrival=st.sampled_from(["poisson", "gamma", "burst", "closed_loop"]), replicas=st.integers(1, 3),
       router=st.sampled_from(["round_robin", "least_outstanding"]), compact=st.booleans())
def test_nothing_is_lost_at_any_rate(config, rate, n, seed, arrival, replicas, router, compact):
    workload = WorkloadConfig(arrival=arrival, num_requests=n, rate=rate, burstiness=0.3, concurrency=3, seed=seed,
                              prompt=LengthDist(kind="uniform", low=1, high=40),
                              output=LengthDist(kind="uniform", low=1, high=24))
    requests, concurrency = workload_requests(workload)
    wanted = {r.request_id: r.max_tokens for r in requests}
    sim = simulate(requests, config, lambda: CostModelExecutor(COST),
                   concurrency=concurrency, num_replicas=replicas, router=router, keep_token_times=not compact,
                   timeseries=True, keep_steps=True)
    m = sim.metrics()
    assert m["completed"] == n and m["failed"] == 0
    assert m["total_output_tokens"] == sum(wanted.values())
    # the prefill its calls ran, recomputes included (was: tokens looked up, a preempted request's whole)
    assert m["prefill_tokens_computed"] == sum(n for s in sim.steps for n, _ in s.plan.prefill_chunks)
    cols = sim.log.columns()
    assert (cols["ttft_s"] > 0).all() and (cols["queue_s"] >= 0).all()
    assert (cols["finish_s"] >= cols["first_token_s"]).all()
    if not compact:
        assert {r.request_id: r.output_tokens for r in sim.records} == wanted
        for r in sim.records:
            assert list(r.token_times_s) == sorted(r.token_times_s)
    ts = sim.timeseries
    assert len(ts) == sim.num_steps
    assert max(ts.active) <= config.max_num_seqs and max(ts.kv_blocks_used) <= config.num_kv_blocks
    if concurrency is not None:  # never more than `concurrency` requests outstanding
        assert max(q + a for q, a in zip(ts.queue, ts.active)) <= concurrency


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=SCHEDULERS, rate=st.floats(0.5, 500), n=st.integers(1, 40), seed=st.integers(0, 1000),
       arrival=st.sampled_from(["poisson", "burst", "closed_loop"]), replicas=st.integers(1, 3),
       router=st.sampled_from(["round_robin", "least_outstanding"]))
def test_steps_without_plans_change_nothing(config, rate, n, seed, arrival, replicas, router):
    """Keeping plans turns off the decode-only steps that build no plan: the run must be the
    same to the last token time, step count and time-series row."""
    workload = WorkloadConfig(arrival=arrival, num_requests=n, rate=rate, concurrency=3, seed=seed,
                              prompt=LengthDist(kind="uniform", low=1, high=40),
                              output=LengthDist(kind="uniform", low=1, high=24))
    runs = []
    for keep_steps in (True, False):
        requests, concurrency = workload_requests(workload)
        sim = simulate(requests, config, lambda: CostModelExecutor(COST), concurrency=concurrency,
                       num_replicas=replicas, router=router, keep_steps=keep_steps, timeseries=True)
        runs.append((sorted(sim.records, key=lambda r: r.request_id), sim.num_steps, sim.duration_s,
                     sorted(sim.timeseries.rows())))
    assert runs[0] == runs[1]


def test_compact_records_give_the_same_metrics():
    workload = WorkloadConfig(arrival="poisson", num_requests=300, rate=30.0, seed=2,
                              prompt=LengthDist(kind="lognormal", value=64, sigma=0.5, max=512),
                              output=LengthDist(kind="lognormal", value=32, sigma=0.5, max=128))
    config = SchedulerConfig(name="continuous", max_num_seqs=16)
    cost = COST
    full = simulate(make_requests(generate(workload)), config, lambda: CostModelExecutor(cost)).metrics(0.5, 0.01)
    compact = simulate(make_requests(generate(workload)), config, lambda: CostModelExecutor(cost),
                       keep_token_times=False).metrics(0.5, 0.01)
    assert full.keys() == compact.keys()
    for key, value in full.items():
        if key == "itl_s":  # streamed: exact mean/std, percentiles within a log bin
            assert compact[key]["mean"] == pytest.approx(value["mean"], rel=1e-9)
            assert compact[key]["std"] == pytest.approx(value["std"], rel=1e-6)
            for p in ("p50", "p90", "p99"):
                assert compact[key][p] == pytest.approx(value[p], rel=3e-3)
        else:
            assert compact[key] == pytest.approx(value, rel=1e-9), key


def test_round_robin_alternates_and_least_outstanding_avoids_the_busy_replica():
    config = SchedulerConfig(name="serial")
    burst = [Request(f"r{i}", range(4), 3) for i in range(6)]
    rr = simulate(burst, config, lambda: ConstantExecutor(0.1), num_replicas=2, keep_steps=True)
    served_by = {s.plan.request_ids[0]: s.replica for s in rr.steps}
    assert served_by == {f"r{i}": i % 2 for i in range(6)}
    assert rr.duration_s == pytest.approx(0.9)  # 3 requests × 3 calls per replica, in parallel
    # one long request lands on replica 0; the next ones, while it runs, all go to replica 1
    # under least_outstanding but alternate under round robin
    reqs = lambda: [Request("long", range(4), 50)] + [Request(f"s{i}", range(4), 1, arrival_s=0.5 + i) for i in range(4)]  # noqa: E731
    lo = simulate(reqs(), config, lambda: ConstantExecutor(0.1), num_replicas=2, router="least_outstanding",
                  keep_steps=True)
    assert {s.plan.request_ids[0]: s.replica for s in lo.steps} == {"long": 0, **{f"s{i}": 1 for i in range(4)}}
    rr2 = simulate(reqs(), config, lambda: ConstantExecutor(0.1), num_replicas=2, keep_steps=True)
    assert {s.plan.request_ids[0]: s.replica for s in rr2.steps}["s0"] == 1
    assert {s.plan.request_ids[0]: s.replica for s in rr2.steps}["s1"] == 0
    assert lo.metrics()["ttft_s"]["p99"] < rr2.metrics()["ttft_s"]["p99"]


def test_closed_loop_issues_the_next_request_when_one_finishes():
    workload = WorkloadConfig(arrival="closed_loop", num_requests=6, concurrency=2,
                              prompt=LengthDist(value=4), output=LengthDist(kind="fixed", value=3))
    requests, concurrency = workload_requests(workload)
    assert concurrency == 2
    sim = simulate(requests, SchedulerConfig(name="serial"), lambda: ConstantExecutor(0.1), concurrency=concurrency)
    by_id = {r.request_id: r for r in sim.records}
    # serial: two clients, one engine, each request 3 calls; requests 2.. arrive as earlier ones finish
    assert [by_id[f"req-{i}"].arrival_s for i in range(6)] == pytest.approx([0, 0, 0.3, 0.6, 0.9, 1.2])
    assert [by_id[f"req-{i}"].finish_s for i in range(6)] == pytest.approx([0.3, 0.6, 0.9, 1.2, 1.5, 1.8])


def serial_capacity_run(wl: WorkloadConfig) -> dict:
    requests, _ = workload_requests(wl)
    return simulate(requests, SchedulerConfig(name="serial"), lambda: ConstantExecutor(0.01),
                    keep_token_times=False).metrics()


def test_capacity_search_brackets_the_highest_rate_meeting_the_slo():
    # serial, 10 calls of 10 ms per request: saturates at 10 req/s; a 0.3 s p99 TTFT holds well below
    workload = WorkloadConfig(arrival="poisson", num_requests=400, seed=5, prompt=LengthDist(value=8),
                              output=LengthDist(kind="fixed", value=10))
    found = search_capacity(serial_capacity_run, workload, low=0.5, high=50.0, slo_ttft_p99_s=0.3, rel_tol=0.01)
    assert 2.0 < found.rate < 10.0
    assert serial_capacity_run(workload.__class__(**{**workload.__dict__, "rate": found.rate}))["ttft_s"]["p99"] <= 0.3
    failing = [p.rate for p in found.probes if not p.ok]
    assert min(failing) <= found.rate * 1.011  # a failing probe just above: the answer is tight
    assert all(p.ok == (p.ttft_p99_s <= 0.3) for p in found.probes)


def test_capacity_search_edges_and_bad_arguments():
    workload = WorkloadConfig(arrival="poisson", num_requests=50, prompt=LengthDist(value=8),
                              output=LengthDist(kind="fixed", value=10))
    assert search_capacity(serial_capacity_run, workload, 200.0, 400.0, slo_ttft_p99_s=0.05).rate is None
    assert search_capacity(serial_capacity_run, workload, 0.1, 0.2, slo_ttft_p99_s=10.0).rate == 0.2
    with pytest.raises(ValueError, match="at least one SLO"):
        search_capacity(serial_capacity_run, workload, 0.1, 1.0)
    with pytest.raises(ValueError, match="poisson/gamma"):
        search_capacity(serial_capacity_run, WorkloadConfig(), 0.1, 1.0, slo_ttft_p99_s=1.0)


def test_impossible_request_fails_up_front():
    with pytest.raises(ValueError, match="max_model_len"):
        simulate([Request("huge", range(3000), 10)], SchedulerConfig(), lambda: ConstantExecutor(0.1))
    assert math.isnan(simulate([Request("x", range(3), 1)], SchedulerConfig(),
                               lambda: ConstantExecutor(0.1)).metrics()["tpot_s"]["p50"])


def test_lazy_source_frees_finished_requests_and_matches_the_list_run():
    import gc

    workload = WorkloadConfig(arrival="poisson", num_requests=200, rate=50.0, seed=4,
                              prompt=LengthDist(kind="uniform", low=8, high=64),
                              output=LengthDist(kind="uniform", low=2, high=30))
    config = SchedulerConfig(name="continuous", max_num_seqs=16)
    cost = COST
    ids = set()

    def source():
        for request in workload_requests(workload, lazy=True)[0]:
            ids.add(request.request_id)
            yield request

    def alive() -> int:  # Request objects of this run still somewhere (the compiled class takes no weakrefs)
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is Request and o.request_id in ids)

    lazy = simulate(source(), config, lambda: CostModelExecutor(cost), keep_token_times=False)
    assert len(ids) == 200 and alive() == 0  # nothing per-token survives a request
    listed = simulate(make_requests(generate(workload)), config, lambda: CostModelExecutor(cost), keep_token_times=False)
    assert lazy.metrics() == listed.metrics()


def test_lazy_source_out_of_arrival_order_is_an_error():
    late_then_early = iter([Request("a", range(4), 2, arrival_s=1.0), Request("b", range(4), 2, arrival_s=0.5)])
    with pytest.raises(ValueError, match="arrival order"):
        simulate(late_then_early, SchedulerConfig(), lambda: ConstantExecutor(0.1))
    assert gc.isenabled()  # the run pauses the cyclic collector, and gives it back even when it fails


def test_a_run_leaves_the_cyclic_collector_as_it_found_it():
    requests = lambda: create_requests(3, 4, (2,))  # noqa: E731
    simulate(requests(), SchedulerConfig(), lambda: ConstantExecutor(0.1))
    assert gc.isenabled()
    gc.disable()
    try:
        simulate(requests(), SchedulerConfig(), lambda: ConstantExecutor(0.1))
        assert not gc.isenabled()
    finally:
        gc.enable()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["serial", "static", "continuous"]), seqs=st.integers(1, 8),
       blocks=st.integers(12, 60), rate=st.floats(5.0, 2000.0), seed=st.integers(0, 1000),
       keep=st.booleans(), scale=st.sampled_from([1.0, 0.98, 1.5]))
def test_running_repeated_decode_steps_at_once_changes_no_token_time(name, seqs, blocks, rate, seed, keep, scale):
    """EngineCore.repeat_decodes is a shortcut: the same token times, step count and metrics as
    launching and landing every step (plans identical too: the decode steps it skips are the
    repeat of the plan before, which the step loop's own test holds), at any time scale."""
    config = SchedulerConfig(name=name, max_num_seqs=seqs, max_num_batched_tokens=32, long_prefill_token_threshold=16,
                             num_kv_blocks=blocks, block_size=4)
    wl = WorkloadConfig(arrival="poisson", num_requests=40, rate=rate, seed=seed,
                        prompt=LengthDist(kind="uniform", value=2, max=20), output=LengthDist(kind="uniform", value=1, max=40))
    runs = []
    for repeat in (True, False):
        sim = Simulation(config, lambda: CostModelExecutor(COST, scale), keep_token_times=keep,
                         repeat_decodes=repeat, check=True)
        result = sim.run(make_requests(generate(wl)))
        times = ({r.request_id: r.token_times_s for r in result.records} if keep else None)
        metrics = result.metrics()
        # compact records take a run of steps' gaps as a series from the cost terms: the ITL mean
        # and std are the same sums in another order (equal to rounding), the rest exactly (ITL
        # percentiles are log bins 0.23% wide: a gap within rounding of a bin edge could move one)
        itl = {k: metrics["itl_s"].pop(k) for k in ("mean", "std")}
        runs.append((result.num_steps, times, metrics, itl))
        kv = sim.replicas[0].state.kv  # every block granted along a run of steps is given back
        assert kv.num_free == config.num_kv_blocks and not kv.held
    assert runs[0][:3] == runs[1][:3]
    assert runs[0][3] == pytest.approx(runs[1][3], rel=1e-12, abs=1e-15)


def _decoding(request_id: str, seq: int, t0: float) -> Request:
    """A request whose prompt is computed and first token out at ``t0``: ready to join a lane."""
    request = Request(request_id, range(4), 10**6)
    request.admit_seq, request.num_computed_tokens = seq, 4
    request.append_output(None, t0)
    return request


def _script_a_lane(keep_times: bool, rounds: int):
    """Drive a lane by hand: single advances and runs advanced at once; one member from the start
    to two thirds, another from a third to the end. Returns the lane, both members (left), every
    advance's end (by clock) and the young member's join clock."""
    from engine.core.lane import DecodeLane
    from engine.core.block_pool import KVBlockPool
    lane = DecodeLane(block_size=10**9, keep_times=keep_times)  # blocks never fill
    pool = KVBlockPool(4, 10**9)
    old, young = _decoding("old", 1, 0.0), _decoding("young", 2, 0.0)
    lane.join(old, 1)
    ends: list[float] = []
    t = 0.0
    joined = left = 0
    for i in range(rounds):
        t += 1.0
        lane.advance(t)
        ends.append(t)
        if i % 3 == 2:  # a run of three steps (until_s cuts it), each a little longer
            n, context = len(lane.members), lane.context_sum()
            steps, finished, _ = lane.advance_run(t + 0.5, 0.01, 0.2, 1e-7, 0.03, math.inf, t + 1.3, pool)
            assert not finished
            start = t + 0.5
            for j in range(steps):  # the run's own arithmetic
                end = start + 0.01 + (0.2 + 1e-7 * (context + j * n))
                ends.append(end)
                start = end + 0.03
            assert steps == 3 and lane.last_end == ends[-1]
            t = ends[-1]
        if i == rounds // 3:
            joined = lane.clock
            young._times[:] = [t]
            lane.join(young, 1)
        if i == 2 * rounds // 3:
            left = lane.clock
            lane.leave(old)
    lane.leave(young)
    return lane, old, young, ends, joined, left


@pytest.mark.parametrize("rounds", [30, 7_500])  # the second crosses lane.COMPACT_EVERY stored times
def test_a_lane_keeps_runs_of_steps_not_their_times_and_gives_back_each_token_time(rounds):
    lane, old, young, ends, joined, left = _script_a_lane(True, rounds)
    assert old.token_times_s == pytest.approx([0.0] + ends[:left], rel=1e-15)
    assert young.token_times_s == pytest.approx([ends[joined - 1]] + ends[joined:], rel=1e-15)
    assert old.num_output_tokens == 1 + left and young.num_output_tokens == 1 + len(ends) - joined
    if rounds > 30:  # compacted once the old member left: what only it had read is gone
        assert 0 < lane._runs[0].clock <= joined
        assert lane._stored == sum(len(run.ends) if run.ends is not None else 1 for run in lane._runs)
    # compact records: each stay writes back its first and last time; the gaps outside lane steps are the same
    _, c_old, c_young, _, _, _ = _script_a_lane(False, rounds)
    assert c_old.token_times_s == pytest.approx([0.0, ends[0], ends[left - 1]], rel=1e-15)
    assert c_young.token_times_s == pytest.approx([ends[joined - 1], ends[joined], ends[-1]], rel=1e-15)
    for full, compact in ((old, c_old), (young, c_young)):
        assert compact.num_output_tokens == full.num_output_tokens
        assert compact.gaps_outside_lane_steps() == pytest.approx(full.gaps_outside_lane_steps(), rel=1e-12)


@pytest.mark.parametrize("free", [0, 3, 7, 40])
def test_a_run_grants_blocks_as_stepping_does_and_stops_where_the_pool_runs_short(free):
    """advance_run walks the block calendar in clock order: the same grants, the same filing and
    the same step at which the pool runs short as needing_block/add_block_each/got_block per step
    (members due at the same clock, and a refiled need landing on another member's)."""
    from engine.core.block_pool import KVBlockPool
    from engine.core.lane import DecodeLane

    def lane_and_pool() -> tuple[DecodeLane, KVBlockPool]:
        pool, lane = KVBlockPool(64, 4), DecodeLane(block_size=4)
        # (computed tokens, blocks held beyond what they need): due at 1, 3, 4, 4 and 5
        for i, (computed, spare) in enumerate([(3, 0), (5, 0), (8, 0), (4, 0), (7, 1)]):
            request = Request(f"r{i}", range(computed), 10**6)
            request.admit_seq, request.num_computed_tokens = i + 1, computed
            request.append_output(None, 0.0)
            assert pool.grow(request.request_id, computed + 1 + 4 * spare)
            lane.join(request, pool.held[request.request_id])
        assert pool.grow("others", 4 * (pool.num_free - free))  # leaves `free` blocks
        return lane, pool

    run_lane, run_pool = lane_and_pool()
    steps, finished, _ = run_lane.advance_run(0.0, 0.0, 1.0, 0.0, 0.0, math.inf, math.inf, run_pool)
    step_lane, step_pool = lane_and_pool()
    stepped = 0
    while stepped < 10 * 64:
        needing = step_lane.needing_block()
        if needing:
            if not step_pool.add_block_each(needing):
                break
            step_lane.got_block()
        stepped += 1
        step_lane.advance(float(stepped))
    assert steps == stepped and not finished
    assert run_pool.held == step_pool.held and run_pool.num_free == step_pool.num_free == free - sum(
        run_pool.held[f"r{i}"] for i in range(5)) + sum(lane_and_pool()[1].held[f"r{i}"] for i in range(5))
    def filed(lane: DecodeLane) -> dict[int, list[str]]:
        return {at: [r.request_id for r in members] for at, members in lane._block_at.items()}

    assert filed(run_lane) == filed(step_lane)
    assert [r.lane_block_due for r in run_lane.members] == [r.lane_block_due for r in step_lane.members]
    run_lane.check(run_pool.held)
    assert run_lane.times_since(0) == step_lane.times_since(0) == [float(j + 1) for j in range(steps)]


def test_compact_request_log_holds_what_full_records_hold_across_its_blocks():
    """Compact rows are packed per request and joined into blocks every ROWS_PER_BLOCK requests:
    the columns read back equal the full records' (times bitwise, counts exactly, a never-scheduled
    request's NaN), and so do the inter-token gaps, whatever block a request landed in."""
    import numpy as np

    from engine.core.request import RequestStatus
    from sim.records import ROWS_PER_BLOCK, RequestLog
    full, compact = RequestLog(keep_token_times=True), RequestLog(keep_token_times=False)
    for i in range(ROWS_PER_BLOCK + 37):
        request = Request(f"r{i}", range(1 + i % 700), 1 + i % 5, arrival_s=i * 0.1 + 1 / 3)
        request.first_scheduled_s = None if i % 11 == 0 else request.arrival_s + i * 1e-3
        request.num_preemptions, request.num_cached_tokens, request.num_lookup_tokens = i % 3, 2**40 + i, 3 * i
        request.num_prefill_tokens = 5 * i
        for j in range(i % 4):
            request.append_output(None, request.arrival_s + 0.5 + j * (0.01 + i * 1e-7))
        request.status = RequestStatus.FINISHED_LENGTH
        full.add(request)
        compact.add(request)
    a, b = full.columns(), compact.columns()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name], equal_nan=True), name
    assert compact.total_output_tokens == full.total_output_tokens == sum(i % 4 for i in range(ROWS_PER_BLOCK + 37))
    assert compact.itl.distribution() == pytest.approx(full.summarize()["itl_s"], rel=5e-3)


def test_itl_sketch_counts_series_of_gaps_and_single_ones():
    import numpy as np

    from sim.records import FLUSH_AT, ItlSketch
    sketch = ItlSketch()
    sketch.add_series(1.0, 1.0, 2, 2)  # gaps 1 and 2, two requests each
    sketch.add(5.0, 3)
    sketch.add_series(0.5, 0.0, 1, 1)
    sketch.add_gaps([0.25])
    sketch.add_series(0.3, 1e-9, 1000, 2)  # in one bin: counted there whole
    sketch.add_series(0.125, 1e-6, FLUSH_AT + 10, 4)  # across bins; alone past FLUSH_AT gaps: flushed
    narrow, long_series = 0.3 + 1e-9 * np.arange(1000), 0.125 + 1e-6 * np.arange(FLUSH_AT + 10)
    expected = np.concatenate([np.repeat([1.0, 2.0, 5.0, 0.5, 0.25], [2, 2, 3, 1, 1]), np.repeat(narrow, 2),
                               np.repeat(long_series, 4)])
    got = sketch.distribution()
    assert sketch.n == len(expected)
    spelled = ItlSketch()  # the same gaps one by one: the same bins
    for gap, count in [(1.0, 2), (2.0, 2), (5.0, 3), (0.5, 1), (0.25, 1), *((x, 2) for x in narrow),
                       *((x, 4) for x in long_series)]:
        spelled.add(float(gap), count)
    spelled.distribution()
    assert (spelled.counts == sketch.counts).all()
    assert got["mean"] == pytest.approx(expected.mean(), rel=1e-12)
    assert got["std"] == pytest.approx(expected.std(), rel=1e-9)
    for p in (50, 90, 99):
        assert got[f"p{p}"] == pytest.approx(np.percentile(expected, p), rel=3e-3)




def test_prefill_tokens_count_a_one_token_chunk_after_a_cached_readmission():
    """A preempted request with one output and a whole-block prompt comes back with its prompt
    cached and runs its output as a 1-token prefill chunk, which a decode-looking guess had not
    counted (a final review's seed 197)."""
    import random

    from collections import defaultdict

    rnd, bs = random.Random(197), 8
    config = SchedulerConfig(name="continuous", max_num_seqs=rnd.randint(2, 8), max_num_batched_tokens=64,
                             long_prefill_token_threshold=rnd.choice([8, 16, 64]), num_kv_blocks=rnd.randint(8, 14),
                             block_size=bs, max_model_len=96, enable_prefix_caching=True)
    base = [rnd.randrange(100) for _ in range(64)]
    requests = sorted((Request(f"r{i}", base[: bs * rnd.randint(1, 4)], rnd.randint(1, 6), arrival_s=rnd.random() * 0.01)
                       for i in range(rnd.randint(4, 16))), key=lambda r: r.arrival_s)
    sim = simulate(requests, config, lambda: CostModelExecutor(COST), keep_steps=True)
    chunks = defaultdict(list)
    for step in sim.steps:
        for request_id, (n, _) in zip(step.plan.request_ids[step.plan.num_decodes:], step.plan.prefill_chunks):
            chunks[request_id].append(n)
    assert any(1 in c and r.num_preemptions for r in sim.records for c in [chunks[r.request_id]])
    assert {r.request_id: r.prefill_tokens for r in sim.records} == {r.request_id: sum(chunks[r.request_id])
                                                                      for r in sim.records}


@pytest.mark.parametrize("replicas", [1, 3])
def test_the_call_log_holds_what_the_step_records_give_a_trace(replicas):
    """keep_calls (sim.run's traces) keeps (label, start, duration, replica) compactly instead of
    each step's plan: the same calls, in the same order, as the step records give."""
    workload = WorkloadConfig(arrival="poisson", num_requests=40, rate=50.0, seed=3,
                              prompt=LengthDist(kind="uniform", low=1, high=40),
                              output=LengthDist(kind="uniform", low=1, high=24))
    config = SchedulerConfig(name="continuous", max_num_seqs=8, max_num_batched_tokens=64,
                             long_prefill_token_threshold=16, num_kv_blocks=12, block_size=8, max_model_len=96)
    runs = [simulate(workload_requests(workload)[0], config, lambda: CostModelExecutor(COST), num_replicas=replicas,
                     router="least_outstanding", **{keep: True}) for keep in ("keep_steps", "keep_calls")]
    steps, calls = runs
    assert len(calls.calls) == steps.num_steps == len(steps.steps) > 0 and len(calls.calls.names) < len(calls.calls)
    for i in range(replicas):
        assert list(calls.replica_calls(i)) == list(steps.replica_calls(i))
    assert calls.trace_calls() == steps.trace_calls()  # every replica's, in the order they ended
    assert steps.metrics() == calls.metrics()
    neither = simulate(workload_requests(workload)[0], config, lambda: CostModelExecutor(COST))
    with pytest.raises(ValueError, match="kept neither its steps nor its calls"):
        neither.trace_calls()
