"""The spine: the real engine loop (tiny model) and the simulator make the same plans and, fed the
real run's measured steps, stamp every token at the same time."""

from dataclasses import replace

import pytest

from engine.core.config import ModelConfig, SchedulerConfig
from engine.llm_engine import Engine
from engine.model.runner import ModelRunner
from engine.observe.workload import LengthDist, WorkloadConfig, generate, make_requests
from sim import CostModelExecutor, ReplayDivergedError, ReplayExecutor, simulate
from sim.executors import cost_model_from

POISSON = WorkloadConfig(arrival="poisson", num_requests=24, rate=50.0, seed=3,
                         prompt=LengthDist(kind="uniform", low=4, high=40),
                         output=LengthDist(kind="uniform", low=1, high=12))
BURST = WorkloadConfig()  # the seed's burst: 16 × (12-token prompt, 4/16/8/12 outputs)
CONFIGS = {
    "serial": SchedulerConfig(name="serial", max_num_seqs=4),
    "static": SchedulerConfig(name="static", max_num_seqs=4),
    "continuous": SchedulerConfig(name="continuous", max_num_seqs=4, max_num_batched_tokens=24,
                                  long_prefill_token_threshold=8),
    # so few KV blocks that running requests get preempted and recomputed
    "continuous_preempting": SchedulerConfig(name="continuous", max_num_seqs=6, max_num_batched_tokens=32,
                                             long_prefill_token_threshold=16, num_kv_blocks=8, block_size=8,
                                             max_model_len=64),
}


@pytest.fixture(scope="module")
def real_run():
    """Real runs on one loaded tiny model (its KV slots fit every config here), each once."""
    runner = ModelRunner(ModelConfig(name="tiny"), SchedulerConfig(max_num_seqs=8))
    Engine(SchedulerConfig(max_num_seqs=8), runner.model_config, runner=runner).warmup()
    done = {}

    def run(name: str, workload: WorkloadConfig):
        key = (name, workload)
        if key not in done:
            engine = Engine(CONFIGS[name], runner.model_config, runner=runner)
            requests = make_requests(generate(workload), vocab_size=runner.vocab_size, seed=workload.seed)
            done[key] = engine.run(requests)
        return done[key]
    return run


@pytest.mark.parametrize("name", list(CONFIGS))
def test_replaying_measured_steps_reproduces_plans_and_token_times(real_run, name):
    real = real_run(name, POISSON)
    sim = simulate(make_requests(generate(POISSON)), CONFIGS[name], lambda: ReplayExecutor(real.steps), keep_steps=True)
    assert [s.plan for s in sim.steps] == [s.plan for s in real.steps]
    assert [(s.start_s, s.end_s) for s in sim.steps] == [(s.start_s, s.end_s) for s in real.steps]
    assert sim.trace_calls() == real.trace_calls()  # the call alone, not the step's work before it
    real_by_id = {r.request_id: r for r in real.records}
    assert len(sim.records) == len(real_by_id) == POISSON.num_requests
    for rec in sim.records:
        ref = real_by_id[rec.request_id]
        assert rec.output_tokens == ref.output_tokens and rec.num_preemptions == ref.num_preemptions
        assert abs(rec.first_scheduled_s - ref.first_scheduled_s) <= 1e-9
        assert len(rec.token_times_s) == len(ref.token_times_s)
        assert max(abs(a - b) for a, b in zip(rec.token_times_s, ref.token_times_s)) <= 1e-9
    sm, rm = sim.metrics(), real.metrics()
    for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        for stat, value in rm[key].items():
            assert sm[key][stat] == pytest.approx(value, abs=1e-9), (key, stat)
    if name == "continuous_preempting":
        assert sum(r.num_preemptions for r in sim.records) > 0  # the test really covers preemption
    if name == "continuous":
        # arrivals really interleaved with steps: some step ran while later requests had not arrived
        last_arrival = max(r.arrival_s for r in sim.records)
        assert sum(s.start_s < last_arrival for s in real.steps) >= 2


@pytest.mark.parametrize("name", ["static", "continuous"])
def test_a_replay_built_from_a_burst_runs_records_serves_the_same_requests_together(real_run, name):
    """validate, transfer and the side-by-side script simulate a real run from its records: when
    requests arrive at the same instant the engine admits them in submission order, so the
    records must keep it (in finish order the short requests would be admitted first)."""
    from engine.core.request import Request

    real = real_run(name, BURST)
    assert [r.request_id for r in real.records] == [f"req-{i}" for i in range(BURST.num_requests)]
    replay = [Request(r.request_id, range(r.prompt_tokens), r.output_tokens, arrival_s=r.arrival_s)
              for r in real.records]
    sim = simulate(replay, CONFIGS[name], lambda: ReplayExecutor(real.steps), keep_steps=True)
    assert [s.plan for s in sim.steps] == [s.plan for s in real.steps]
    sim_by_id = {r.request_id: r for r in sim.records}
    for ref in real.records:
        assert sim_by_id[ref.request_id].token_times_s == pytest.approx(ref.token_times_s, abs=1e-9)


@pytest.mark.parametrize("name", ["serial", "static", "continuous", "continuous_preempting"])
def test_cost_model_gives_the_real_plans_for_a_burst(real_run, name):
    workload = replace(BURST, prompt=LengthDist(kind="uniform", low=4, high=40), seed=1)
    real = real_run(name, workload)
    cost = cost_model_from(step_overhead_s=2e-4, const=1e-3, prefill_tokens=2e-6, decode_tokens=3e-5,
                           decode_context=1e-8, prefill_attention=1e-9, num_requests=1e-6)
    sim = simulate(make_requests(generate(workload)), CONFIGS[name], lambda: CostModelExecutor(cost), keep_steps=True)
    assert [s.plan for s in sim.steps] == [s.plan for s in real.steps]
    # and the simulated clock is the cost model's: each call lasts predict(plan)
    for s in sim.steps:
        assert s.end_s - s.start_s == pytest.approx(cost.predict(s.plan), rel=1e-12)


def test_replay_reports_where_a_run_diverges(real_run):
    # a burst: the second step (a fourth request admitted) differs however fast the real run went
    real = real_run("continuous", BURST)
    other = replace(CONFIGS["continuous"], max_num_seqs=3)
    with pytest.raises(ReplayDivergedError, match="step 1:"):
        simulate(make_requests(generate(BURST)), other, lambda: ReplayExecutor(real.steps))


def test_a_simulated_steps_model_time_is_the_call_alone_as_the_real_one_is():
    """A real step record's model_s is the device timer's call; the work before the call
    (scheduling, packing) is in the step, not the call. The simulator recorded both as the call,
    so its traces' busy time, gaps and occupancy measured something else than the real ones."""
    cost = replace(cost_model_from(step_overhead_s=0.004, const=0.01, prefill_tokens=1e-4, decode_tokens=1e-3),
                   info={"step_overhead": {"before_call_median_s": 0.003}})
    sim = simulate(make_requests(generate(BURST)), CONFIGS["continuous"], lambda: CostModelExecutor(cost),
                   keep_steps=True)
    assert sim.steps
    for step in sim.steps:
        assert step.model_s == pytest.approx(cost.predict(step.plan))
        assert step.end_s - step.start_s == pytest.approx(0.003 + step.model_s)
        label, call_start, call_s = step.trace_call
        assert call_start == pytest.approx(step.start_s + 0.003) and call_s == step.model_s


@pytest.mark.parametrize("name", ["static", "continuous_preempting"])
def test_the_measured_calls_executor_times_each_call_as_the_real_run_did(real_run, name):
    """MeasuredCallsExecutor: the cost model's step with each call at its measured duration, while
    the plans are the run's; from the first plan that differs, the cost model's calls."""
    from sim.executors import MeasuredCallsExecutor

    workload = replace(BURST, prompt=LengthDist(kind="uniform", low=4, high=40), seed=1)
    real = real_run(name, workload)
    cost = cost_model_from(step_overhead_s=2e-4, const=1e-3, prefill_tokens=2e-6, decode_tokens=3e-5)
    executor = MeasuredCallsExecutor(cost, real.steps)
    sim = simulate(make_requests(generate(workload)), CONFIGS[name], lambda: executor, keep_steps=True)
    assert executor.diverged_at is None and [s.plan for s in sim.steps] == [s.plan for s in real.steps]
    assert [s.model_s for s in sim.steps] == [s.model_s for s in real.steps]
    cut = MeasuredCallsExecutor(cost, real.steps[:3])  # the record ends: the rest is the cost model's
    sim = simulate(make_requests(generate(workload)), CONFIGS[name], lambda: cut, keep_steps=True)
    assert cut.diverged_at == 3
    assert [s.model_s for s in sim.steps[3:]] == pytest.approx([cost.predict(s.plan) for s in sim.steps[3:]])


def test_a_closed_loop_keeps_that_many_clients_in_the_engine_as_in_the_simulator():
    """workload=closed_loop: the engine ran every request at once (make_requests drops the
    workload's concurrency) while the simulator ran that many clients; now Engine.run takes it."""
    from engine.llm_engine import Engine

    workload = WorkloadConfig(arrival="closed_loop", concurrency=2, num_requests=8, seed=4,
                              prompt=LengthDist(kind="uniform", low=4, high=20),
                              output=LengthDist(kind="uniform", low=1, high=6))
    served = generate(workload)
    assert served.concurrency == 2
    runner = ModelRunner(ModelConfig(name="tiny"), SchedulerConfig(max_num_seqs=4))
    engine = Engine(CONFIGS["continuous"], runner.model_config, runner=runner)
    real = engine.run(make_requests(served, vocab_size=runner.vocab_size, seed=4), concurrency=served.concurrency)
    assert len(real.records) == 8
    spans = [(r.arrival_s, r.token_times_s[-1]) for r in real.records]
    in_flight = [sum(a <= t < f for a, f in spans) for t, _ in spans]  # at each arrival
    assert max(in_flight) == 2 and sorted(a for a, _ in spans)[:2] == [0.0, 0.0]
    finishes = {f for _, f in spans}
    assert all(a in finishes for a, _ in spans if a > 0)  # each later request arrives at a finish
    sim = simulate(make_requests(generate(workload)), CONFIGS["continuous"], lambda: ReplayExecutor(real.steps),
                   concurrency=2, keep_steps=True)
    assert [s.plan for s in sim.steps] == [s.plan for s in real.steps]
    few = make_requests(generate(replace(workload, num_requests=2)), vocab_size=runner.vocab_size)
    assert len(engine.run(few, concurrency=5).records) == 2  # more clients than requests: all at once
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        engine.run(make_requests(generate(workload), vocab_size=runner.vocab_size), concurrency=0)


def test_a_closed_loops_clients_are_the_bench_clients_cap():
    from experiments.bench import closed_loop_cap

    closed = generate(WorkloadConfig(arrival="closed_loop", concurrency=3, num_requests=5))
    assert closed_loop_cap(closed, None) == closed_loop_cap(closed, 3) == 3
    assert closed_loop_cap(generate(WorkloadConfig(arrival="poisson", rate=2.0, num_requests=5)), 4) == 4
    with pytest.raises(ValueError, match="concurrency"):
        closed_loop_cap(closed, 8)
