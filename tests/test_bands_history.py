"""Replicate bands whose run-wide draw is a memory bandwidth from this machine's history."""

import json
import math
import random
from dataclasses import replace

import pytest

from calibration import bandwidth_history
from calibration.noise import RunNoise, calibration_stamps, calls_gb_s
from calibration.physical import Machine, at_run_bandwidth
from engine.core.config import SchedulerConfig
from engine.core.plan import BatchPlan
from engine.core.request import Request
from experiments.validate import row_run_noise, run_call_limits
from sim.bands import replicates
from sim.executors import NoisyExecutor, cost_model_from
from tests.test_physical import physical_model

DECODE = BatchPlan.of("t", ["a", "b"], (1, 1), (100, 200), (True, True), 2)
PREFILL = BatchPlan.of("t", ["a"], (128,), (0,), (True,), 0)
CONFIG = SchedulerConfig(name="continuous", max_num_seqs=4)


def quiet(cost, **noise):
    """The cost model with only the given noise (no call residuals unless asked)."""
    return replace(cost, info={**cost.info, "noise": {"call_log": [0.0], **noise}})


def burst(n=8):
    return [Request(f"r{i}", range(10 + i), 4 + i % 3, arrival_s=0.05 * i) for i in range(n)]


def test_a_replicate_draws_its_bandwidth_from_the_history_and_prices_calls_at_it():
    cost = quiet(physical_model(machine=Machine(40.0, 400.0)))
    slow = NoisyExecutor(cost, 0, RunNoise((20.0,)))
    assert slow.memory_gb_s == 20.0 and slow.run_factor == 1.0
    assert slow.call_s(DECODE) == pytest.approx(at_run_bandwidth(cost, 20.0).predict(DECODE))
    assert slow.call_s(DECODE) > cost.predict(DECODE) > NoisyExecutor(cost, 0, RunNoise((80.0,))).call_s(DECODE)
    drawn = {NoisyExecutor(cost, s, RunNoise((20.0, 40.0, 80.0))).memory_gb_s for s in range(30)}
    assert drawn == {20.0, 40.0, 80.0}  # every stamp can be drawn, nothing else


def test_under_a_bandwidth_draw_the_call_residuals_add_spread_but_no_mean():
    """The bandwidth a run's calls saw already holds their mean residual (its calls add up to the
    run's total there), so the residuals drawn on top are centred: at the calibration's own
    bandwidth the calls average the prediction. A stamp and the round factor keep them as measured."""
    skewed = [-0.1, -0.05, 0.0, 0.0, 0.02, 0.1, 0.4]  # right-skewed, as a busy host's calls are
    cost = quiet(physical_model(machine=Machine(40.0, 400.0)), call_log=skewed, round_log=[0.0])
    predicted = cost.predict(DECODE)

    def mean_call(run_noise):
        calls = [ex.call_s(DECODE) for ex in (NoisyExecutor(cost, s, run_noise) for s in range(40)) for _ in range(100)]
        return sum(calls) / len(calls)

    assert mean_call(RunNoise((40.0,), from_calls=(True,))) == pytest.approx(predicted, rel=0.01)
    measured_mean = sum(math.exp(r) for r in skewed) / len(skewed)
    assert measured_mean > 1.04
    # a probe's stamp holds no mean residual, nor does a round factor: the residuals keep theirs
    assert mean_call(RunNoise((40.0,))) == pytest.approx(predicted * measured_mean, rel=0.01)
    assert mean_call(RunNoise()) == pytest.approx(predicted * measured_mean, rel=0.01)


def test_an_empirical_model_moves_by_its_profiles_physical_model_so_compute_bound_calls_stay():
    phys = physical_model(machine=Machine(40.0, 400.0))
    cost = cost_model_from(const=0.01, decode_tokens=0.004, prefill_tokens=0.0005)
    cost = replace(cost, info={"physical": phys.to_dict(), "noise": {"call_log": [0.0]}})
    ex = NoisyExecutor(cost, 0, RunNoise((20.0,)))
    ratio = at_run_bandwidth(phys, 20.0).predict(DECODE) / phys.predict(DECODE)
    assert ex.call_s(DECODE) == pytest.approx(cost.predict(DECODE) * ratio) and ratio > 1.3
    prefill_ratio = at_run_bandwidth(phys, 20.0).predict(PREFILL) / phys.predict(PREFILL)
    assert ex.call_s(PREFILL) == pytest.approx(cost.predict(PREFILL) * prefill_ratio) and prefill_ratio < ratio
    # without a physical model there is nothing to price a bandwidth with: the round factor, as before
    bare = replace(cost, info={"noise": {"call_log": [0.0], "round_log": [0.1]}})
    assert NoisyExecutor(bare, 0, RunNoise((20.0,), (0.1,))).run_factor == pytest.approx(math.exp(0.1))


def test_an_old_profile_without_a_history_draws_a_round_factor_exactly_as_before():
    noise = {"round_log": [-0.1, 0.0, 0.2], "call_log": [-0.05, 0.0, 0.05, 0.2]}
    cost = replace(physical_model(), info={"noise": noise})
    assert RunNoise.of_profile(cost.info).memory_gb_s == ()
    ex = NoisyExecutor(cost, 7)
    rng = random.Random(7)  # the draws of the executor before the history, in its order
    assert ex.memory_gb_s is None and ex.run_factor == math.exp(rng.choice(noise["round_log"]))
    assert ex.call_s(DECODE) == pytest.approx(cost.predict(DECODE) * ex.run_factor * math.exp(rng.choice(noise["call_log"])))
    with_history = replace(cost, info={"noise": {**noise, "memory_gb_s_history": [30.0, 50.0]}})
    assert RunNoise.of_profile(with_history.info).memory_gb_s == (30.0, 50.0)
    assert NoisyExecutor(with_history, 7).memory_gb_s in (30.0, 50.0)


def test_seeded_history_replicates_are_reproducible_and_spread_with_the_history():
    cost = quiet(physical_model(), call_log=[-0.02, 0.0, 0.02])
    wide, narrow = RunNoise((20.0, 40.0, 80.0)), RunNoise((40.0,))
    e2e = lambda noise, seed: [r.metrics()["e2el_s"]["p50"] for r in  # noqa: E731
                               replicates(burst, CONFIG, cost, 8, seed=seed, run_noise=noise)]
    assert e2e(wide, 3) == e2e(wide, 3)
    spread = lambda xs: (max(xs) - min(xs)) / min(xs)  # noqa: E731
    assert spread(e2e(wide, 3)) > 3 * spread(e2e(narrow, 3))


def test_calls_gb_s_recovers_the_bandwidth_the_calls_were_made_at():
    phys = physical_model(machine=Machine(40.0, 400.0))
    plans = [BatchPlan.of("t", [f"q{j}" for j in range(b)], (1,) * b, (100,) * b, (True,) * b, b) for b in (1, 2, 4, 8)]
    at25 = at_run_bandwidth(phys, 25.0)
    assert calls_gb_s(phys, [(p, at25.predict(p)) for p in plans]) == pytest.approx(25.0, rel=2e-3)
    assert calls_gb_s(phys, []) is None


def test_calls_gb_s_prices_the_runs_whole_time_not_its_median_call():
    """A run whose calls have a slow tail (a third of them twice their time at 25 GB/s): the
    bandwidth it saw is the one at which the model predicts the run's total model time, below 25,
    where the median call would have said 25 and priced the run too fast."""
    phys = physical_model(machine=Machine(40.0, 400.0))
    plans = [BatchPlan.of("t", [f"q{j}" for j in range(b)], (1,) * b, (100,) * b, (True,) * b, b)
             for b in (1, 2, 4, 8) for _ in range(3)]
    at25 = at_run_bandwidth(phys, 25.0)
    calls = [(p, at25.predict(p) * (2.0 if i % 3 == 0 else 1.0)) for i, p in enumerate(plans)]
    seen = calls_gb_s(phys, calls)
    assert seen < 24.0
    at_seen = at_run_bandwidth(phys, seen)
    assert sum(at_seen.predict(p) for p, _ in calls) == pytest.approx(sum(t for _, t in calls), rel=2e-3)


def runs_of(rows=3):
    """Three real runs per row; row i's calls saw 10·(i+1) GB/s and were stamped 100 + i."""
    return [{"row": i, "repeat": k, "attempt": 0, "memory_gb_s": 100.0 + i, "calls_gb_s": 10.0 * (i + 1)}
            for i in range(rows) for k in range(3)]


def test_a_rows_band_draws_from_the_other_rows_runs_never_its_own():
    cost = replace(physical_model(), info={"noise": {"round_log": [0.0]},
                                           "memory_read_gb_s": {"before": 41.0, "after": 43.0},
                                           "grid": {"round_stamps_gb_s": [42.0]}})
    noise = row_run_noise(cost, runs_of(), 1, "history")
    assert sorted(noise.memory_gb_s) == [10.0] * 3 + [30.0] * 3 + [41.0, 42.0, 43.0]  # no 20: row 1's own
    # the other rows' runs as their calls saw them, the calibration's stamps as stamped
    assert {x: noise.seen_by_calls(i) for i, x in enumerate(noise.memory_gb_s)} == \
        {10.0: True, 30.0: True, 41.0: False, 42.0: False, 43.0: False}
    assert not any(row_run_noise(cost, runs_of(), 1, "history", "stamps").from_calls)
    assert "other rows" in noise.describe() and "3 calibration stamps" in noise.source
    assert sorted(row_run_noise(cost, runs_of(), 0, "history", "stamps").memory_gb_s)[3:] == [101.0] * 3 + [102.0] * 3
    assert row_run_noise(cost, runs_of(), 1, "rounds").memory_gb_s == ()  # the band before the history
    assert calibration_stamps(cost.info) == [41.0, 43.0, 42.0]  # an older profile's rounds, in its grid block
    assert calibration_stamps({"memory_read_gb_s": {"before": 41.0, "after": 43.0, "rounds": [42.0, 0.0]}}
                              ) == [41.0, 43.0, 42.0]  # where they are kept now
    # a profile with its own history draws from it instead of its calibration stamps
    kept = replace(cost, info={**cost.info, "noise": {"memory_gb_s_history": [55.0]}})
    assert sorted(row_run_noise(kept, runs_of(), 2, "history").memory_gb_s) == [10.0] * 3 + [20.0] * 3 + [55.0]


def test_a_real_runs_call_bandwidth_comes_from_its_recorded_steps():
    phys = physical_model(machine=Machine(40.0, 400.0))
    at30 = at_run_bandwidth(phys, 30.0)
    steps = [("decode", 0.0, 1.0, at30.predict(BatchPlan.of("r", [f"q{j}" for j in range(b)], (1,) * b, (64,) * b,
                                                              (True,) * b, b)), [1] * b, [64] * b, [True] * b, b)
             for b in (1, 3, 6)]
    assert run_call_limits(phys, {"steps": steps})[0] == pytest.approx(30.0, rel=2e-3)
    assert run_call_limits(None, {"steps": steps}) == (None, None, None)


def test_the_machine_history_keeps_its_entries_and_ignores_another_machines_and_models(tmp_path, monkeypatch):
    monkeypatch.setenv("MINISERVE_BANDWIDTH_HISTORY_DIR", str(tmp_path))
    m = "qwen2_5_0_5b-fingerprint"
    assert bandwidth_history.load(2, m) == []
    path = bandwidth_history.record(2, m, [40.0, 0.0, 44.0], "calibration stamp")  # a zero is no stamp
    assert [e.gb_s for e in bandwidth_history.load(2, m)] == [40.0, 44.0]
    assert bandwidth_history.load(4, m) == []  # another thread count is another machine
    # a tiny model's calls price as a few GB/s (they are overhead): its runs never join the 0.5B's
    bandwidth_history.record(2, "tiny-fingerprint", [5.0], "validate run")
    assert [e.gb_s for e in bandwidth_history.load(2, m)] == [40.0, 44.0]
    out = bandwidth_history.profile_history(2, m, [50.0])
    assert out["memory_gb_s_history"] == [40.0, 44.0, 50.0] and "2 from this machine's history" in \
        out["memory_gb_s_history_source"]
    assert [e.gb_s for e in bandwidth_history.load(2, m)] == [40.0, 44.0, 50.0]
    # a validate run's calls' bandwidth is marked as such (a replicate centres its residuals on it)
    bandwidth_history.record(2, m, [60.0], "validate run's calls")
    bandwidth_history.record(2, m, [30.0], "validate run stamp")
    out = bandwidth_history.profile_history(2, m, [52.0])
    assert out["memory_gb_s_history_from_calls"] == [False, False, False, True, False, False]
    assert RunNoise.of_profile({"noise": out}).from_calls == (False, False, False, True, False, False)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "key": {**data["key"], "cpu": "another"}}))
    assert bandwidth_history.load(2, m) == []
