"""A real run's machine as its calls saw it (bandwidth and matmul rate), and TTFT compared request by
request: what validate's rescoring uses to tell the simulator's error from the host's spells."""

import math
import statistics

import pytest

from calibration.noise import MIN_GROUP_CALLS, calls_gb_s, calls_machine
from calibration.physical import Machine
from engine.core.config import SchedulerConfig
from engine.core.plan import BatchPlan
from engine.observe.workload import WorkloadConfig
from experiments.validate import Row, replay_requests, row_cost, ttft_per_request_error
from sim.executors import CostModelExecutor
from sim.simulator import simulate
from tests.test_physical import physical_model


ROW = Row("burst", SchedulerConfig(name="continuous", max_num_seqs=4), WorkloadConfig())
# eight requests 50 ms apart as real_runs.json keeps them: (id, arrival, prompt, output, prompt ids)
REPLAY = [(f"r{i}", 0.05 * i, 12 + i, 3 + i % 4, list(range(i * 100, i * 100 + 12 + i))) for i in range(8)]


def decode(b: int) -> BatchPlan:
    return BatchPlan.of("t", [f"q{j}" for j in range(b)], (1,) * b, (100,) * b, (True,) * b, b)


def prefill(n: int) -> BatchPlan:
    return BatchPlan.of("t", ["p"], (n,), (0,), (True,), 0)


def test_calls_machine_recovers_both_limits_the_calls_were_made_at():
    """Decodes priced at 25 GB/s, prefills at 250 GFLOP/s: both come back, where the bandwidth-only
    fit puts the prefills' slowness into the bandwidth."""
    phys = physical_model(machine=Machine(40.0, 400.0))
    at = phys.with_machine(memory_gb_s=25.0, matmul_gflops=250.0)
    plans = [decode(b) for b in (1, 2, 4, 8) for _ in range(3)] + [prefill(n) for n in (128, 256, 512) for _ in range(3)]
    calls = [(p, at.predict(p)) for p in plans]
    gb_s, gflops = calls_machine(phys, calls)
    assert gb_s == pytest.approx(25.0, rel=5e-3) and gflops == pytest.approx(250.0, rel=5e-3)
    assert calls_gb_s(phys, calls) < 24.0  # one number for both: the slow matmuls read as slow memory


def test_calls_machine_keeps_the_calibrations_matmul_rate_without_enough_compute_bound_calls():
    phys = physical_model(machine=Machine(40.0, 400.0))
    at = phys.with_machine(memory_gb_s=25.0, matmul_gflops=250.0)
    decodes = [(p, at.predict(p)) for p in [decode(b) for b in (1, 2, 4, 8) for _ in range(3)]]
    calls = decodes + [(prefill(256), at.predict(prefill(256)))] * (MIN_GROUP_CALLS - 1)
    assert calls_machine(phys, calls) == (calls_gb_s(phys, calls), None)
    assert calls_machine(phys, []) == (None, None)
    # prefills faster than any matmul rate in range prices them: the bandwidth alone, as calls_gb_s
    impossible = decodes + [(prefill(256), 1e-9)] * MIN_GROUP_CALLS
    assert calls_machine(phys, impossible) == (calls_gb_s(phys, impossible), None)


def test_run_bandwidth_machine_prices_a_row_at_its_runs_median_bandwidth_and_matmul_rate():
    phys = physical_model(machine=Machine(40.0, 400.0))
    runs = [{"repeat": k, "attempt": 0, "memory_gb_s": 50.0, "calls_gb_s": 30.0 + k, "machine_gb_s": 20.0 + k,
             "calls_gflops": g} for k, g in enumerate((300.0, 250.0, 200.0))]
    assert row_cost(phys, runs, True, "machine").machine == Machine(21.0, 250.0)
    assert row_cost(phys, runs, True, "calls").machine == Machine(31.0, 400.0)  # the bandwidth only
    assert row_cost(phys, runs, False, "machine") is phys
    # a run that fitted no matmul rate has its slow cores in its bandwidth: the row is priced as calls
    runs[1]["calls_gflops"] = None
    assert row_cost(phys, runs, True, "machine").machine == Machine(31.0, 400.0)


def test_ttft_per_request_error_pairs_each_request_with_its_simulation():
    """A real run that is the simulation itself is off by nothing; one whose every request waited 10%
    longer for its first token is off by 1/1.1 − 1 whatever its percentiles do; runs kept before
    the first tokens were give NaN."""
    cost, row, replay = physical_model(machine=Machine(40.0, 400.0)), ROW, REPLAY
    sim = simulate(replay_requests(replay), row.scheduler, lambda: CostModelExecutor(cost), keep_steps=True)
    ttft = {r.request_id: r.token_times_s[0] - r.arrival_s for r in sim.records}
    assert len(set(round(t, 6) for t in ttft.values())) > 2  # requests waited differently

    def run(k, scale):
        return {"repeat": k, "attempt": 0, "replay": replay,
                "first_tokens": [(rid, a, a, a + scale * ttft[rid]) for rid, a, *_ in replay]}

    assert ttft_per_request_error(cost, row, [run(0, 1.0)]) == pytest.approx(0.0, abs=1e-9)
    assert ttft_per_request_error(cost, row, [run(0, 1.1)]) == pytest.approx(1 / 1.1 - 1)
    # the median over the runs of each run's median, the last attempt of each repeat counted
    runs = [run(0, 1.1), run(1, 1.0), {**run(1, 2.0), "attempt": 1}, run(2, 0.8)]
    assert ttft_per_request_error(cost, row, runs) == pytest.approx(statistics.median([1 / 1.1 - 1, 0.5 - 1, 0.25]))
    assert math.isnan(ttft_per_request_error(cost, row, [{"repeat": 0, "attempt": 0, "replay": replay}]))
    # a request the simulation does not know (not in the replay) is left out, not a crash
    stray = run(0, 1.1)
    stray["first_tokens"].append(("ghost", 0.0, 0.0, 1.0))
    assert ttft_per_request_error(cost, row, [stray]) == pytest.approx(1 / 1.1 - 1)


def test_with_run_bandwidth_each_run_is_paired_with_a_simulation_at_its_own_machine():
    """Two runs at 20 and 40 GB/s, each exactly its own simulation at its bandwidth: priced run by run
    they are off by nothing; at the row's median (or the calibration's) bandwidth they are not."""
    cost, row, replay = physical_model(machine=Machine(40.0, 400.0)), ROW, REPLAY

    def run(k, gb_s):
        at = cost.with_machine(memory_gb_s=gb_s)
        sim = simulate(replay_requests(replay), row.scheduler, lambda: CostModelExecutor(at), keep_steps=True)
        return {"repeat": k, "attempt": 0, "replay": replay, "calls_gb_s": gb_s, "memory_gb_s": gb_s,
                "first_tokens": [(r.request_id, r.arrival_s, r.arrival_s, r.arrival_s + r.ttft_s) for r in sim.records]}

    runs = [run(0, 20.0), run(1, 40.0)]
    assert ttft_per_request_error(cost, row, runs, True, "calls") == pytest.approx(0.0, abs=1e-9)
    assert ttft_per_request_error(cost, row, runs, False) < -0.01  # the 20 GB/s run is slower than 40's simulation
