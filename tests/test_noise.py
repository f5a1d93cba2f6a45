"""Predictions a user can trust: robust measurement, the profile's noise, bands, and validation's pass rule."""

import math
from dataclasses import replace

import numpy as np
import pytest

from calibration.cost_model import FEATURES, CostModel, weights_read_gb_s
from calibration.grid import Shape
from calibration.noise import noise_report, round_factors
from calibration.profiler import Robustness, call_stamps, measure_shapes, round_order, trimmed_mean
from engine.core.config import SchedulerConfig
from engine.core.request import Request
from experiments.validate import Contention, Stamps, contended, counted, repeat_floor, row_passes
from sim import CostModelExecutor, simulate
from sim.bands import band, bands, conformal_band, inside, prediction_ranks, replicates, width
from sim.executors import NoisyExecutor, cost_model_from


# --- calibration on a noisy machine -------------------------------------------------------------

def test_rounds_interleave_shapes_in_a_fresh_order_each():
    orders = round_order(10, 3, seed=0)
    assert all(sorted(o) == list(range(10)) for o in orders)  # every shape once per round
    assert len({tuple(o) for o in orders}) == 3  # and never the same order twice here
    assert round_order(10, 3, seed=0) == orders  # seeded


class FakePool:
    """Times from a script: shape name → list of (seconds, contended) handed out in call order."""

    request_ids = [f"r{i}" for i in range(4)]

    def __init__(self, script):
        self.script = {k: list(v) for k, v in script.items()}
        self.calls = []

    def execute(self, plan):
        name = next(k for k, s in SHAPES.items() if s.to_plan(self.request_ids) == plan)
        self.calls.append(name)
        queue = self.script[name]
        return queue.pop(0) if len(queue) > 1 else queue[0]


SHAPES = {"a": Shape("decode", decode_contexts=(4,)), "b": Shape("decode", decode_contexts=(4, 4)),
          "c": Shape("prefill", chunks=((8, 0, True),))}


def test_measure_retries_contended_calls_and_adds_rounds_only_for_wide_shapes():
    # a: steady; b: one contended call (re-timed), steady after; c: wide (1.0 vs 2.0) twice over
    script = {"a": [(1.0, False)], "b": [(1.0, False), (9.0, True), (1.0, False)],
              "c": [(1.0, False), (2.0, False), (1.0, False), (2.0, False), (1.0, False)]}
    pool = FakePool(script)
    shapes = list(SHAPES.values())
    ms, mlog = measure_shapes(pool, shapes, repeats=2, warmup=0, progress=False,
                              robust=Robustness(wide_spread=0.1, extra_rounds=2))
    by = dict(zip(SHAPES, ms))
    assert by["a"].times_s == (1.0, 1.0) and by["b"].times_s == (1.0, 1.0)  # the contended 9.0 was re-timed
    assert mlog.retried == 1
    assert len(by["c"].times_s) == 4 and mlog.extra_rounds == 2  # only c got the extra rounds
    assert by["c"].typical_s == pytest.approx(1.5)  # interquartile mean of 1, 2, 1, 2


def test_a_round_whose_memory_stamp_moved_is_measured_again():
    pool = FakePool({k: [(1.0, False)] for k in SHAPES})
    stamps = iter([50.0, 30.0, 50.0, 49.0])  # before, round 0 (-40%: again), round 0 again, round 1
    ms, mlog = measure_shapes(pool, list(SHAPES.values()), repeats=2, warmup=0, progress=False,
                              robust=Robustness(extra_rounds=0), stamp=lambda: next(stamps))
    assert mlog.rounds_remeasured == 1 and mlog.round_stamps_gb_s == [30.0, 50.0, 49.0]
    assert all(len(m.times_s) == 2 for m in ms)  # the drifted round's times were dropped, not kept
    assert len(pool.calls) == 3 * len(SHAPES)
    # and left the call order with them: the order names each kept time once (noise.call_lag1's)
    names = list(SHAPES)
    assert len(mlog.order) == 2 * len(SHAPES) and [names[i] for i in mlog.order] == pool.calls[len(SHAPES):]


def test_the_weights_are_stamped_after_every_round_and_judged_by_the_median():
    """One slow stamp around a calibration must not set what every real run is judged against."""
    pool = FakePool({k: [(1.0, False)] for k in SHAPES})
    weights = iter([40.0, 41.0, 39.0])
    _, mlog = measure_shapes(pool, list(SHAPES.values()), repeats=3, warmup=0, progress=False,
                             robust=Robustness(extra_rounds=0), stamp=lambda: 50.0, weights_stamp=lambda: next(weights))
    assert mlog.round_weights_gb_s == [40.0, 41.0, 39.0]  # the profile keeps them as weights_read_gb_s.rounds
    slow_around = {"weights_read_gb_s": {"before": 29.0, "after": 36.0, "rounds": mlog.round_weights_gb_s}}
    assert weights_read_gb_s(slow_around) == 39.0  # median of 29, 36, 40, 41, 39; the pair alone: 32.5
    assert weights_read_gb_s({"weights_read_gb_s": {"before": 29.0, "after": 36.0}}) == 32.5  # an older profile
    limits = Contention(others_cores=0.15, memory_drift=0.2)
    calibration = Stamps(50.0, weights_read_gb_s(slow_around))
    assert contended(0.0, Stamps(50.0, 41.0), calibration, limits) == ""  # 41 vs 32.5 would read +26%
    assert CostModel((0.0,) * len(FEATURES), info={"memory_read_gb_s": {"before": 30.0, "after": 34.0,
                                                        "rounds": [50.0, 52.0, 48.0]}}).memory_read_gb_s == 48.0


def test_every_call_is_stamped_just_before_and_just_after_the_attempt_that_is_kept():
    """A clock ticks at every event (a call, a stamp of any kind) and each call stamp reads the
    clock: a call stamped at c and timed at c + 1 must get its after stamp at c + 2, with a round's
    own stamps after it, and a contended attempt's retry gets a stamp of its own."""
    clock = [0]

    def tick() -> float:
        clock[0] += 1
        return float(clock[0])

    script = {"a": [(1.0, False)], "b": [(1.0, False), (9.0, True), (1.0, False)], "c": [(1.0, False)]}
    pool = FakePool(script)
    execute, kept = pool.execute, {k: [] for k in SHAPES}

    def timed(plan):  # the clock at the stamp just before each attempt that is kept
        before = clock[0]
        tick()
        t, contended = execute(plan)
        if not contended:
            kept[pool.calls[-1]].append(before)
        return t, contended

    pool.execute = timed
    rounds = iter([50.0, 30.0, 50.0])  # before, round 0 (-40%: would be measured again), round 1
    ms, mlog = measure_shapes(pool, list(SHAPES.values()), repeats=2, warmup=0, progress=False,
                              robust=Robustness(extra_rounds=0), stamp=lambda: (tick(), next(rounds))[1],
                              weights_stamp=tick, call_stamp=tick)
    assert mlog.rounds_remeasured == 0 and mlog.retried == 1  # the drifted round kept, b's contended call again
    for name, m in zip(SHAPES, ms):
        assert m.stamps_gb_s == pytest.approx(tuple(math.sqrt(c * (c + 2)) for c in kept[name]))
    calls = []
    plain, _ = measure_shapes(FakePool({k: [(1.0, False)] for k in SHAPES}), list(SHAPES.values()), repeats=2,
                              warmup=0, progress=False, robust=Robustness(extra_rounds=0, stamp_calls=False),
                              call_stamp=lambda: calls.append(1) or 1.0)
    assert all(m.stamps_gb_s == () for m in plain) and not calls


def test_extra_rounds_go_to_shapes_wide_at_the_usual_bandwidth_not_as_timed():
    """a reads weights (memory share 1) and took twice as long in a round whose stamps read half as
    fast: at the usual bandwidth its repeats agree, so it gets no extra round; c (share 0) was as
    wide with the same stamps, and more repeats are what can narrow it. Without the shares both
    are judged as timed and both get the extra rounds."""
    shapes = [SHAPES["a"], SHAPES["c"]]
    script = {"a": [(1.0, False), (2.0, False), (1.5, False)], "c": [(1.0, False), (2.0, False), (1.5, False)]}

    def run(shares):
        # before each call and after each round: round 0 (2 calls, 3 stamps) at 40 GB/s, round 1 at 20
        stamps = iter([40.0] * 3 + [20.0] * 3 + [30.0] * 20)
        pool = FakePool(script)
        ms, mlog = measure_shapes(pool, shapes, repeats=2, warmup=0, progress=False,
                                  robust=Robustness(wide_spread=0.1, extra_rounds=1),
                                  call_stamp=lambda: next(stamps), memory_shares=shares)
        return [len(m.times_s) for m in ms], ms

    counts, ms = run([1.0, 0.0])
    assert counts == [2, 3]  # c alone got the extra round
    assert ms[1].stamps_gb_s == pytest.approx((40.0, 20.0, 30.0))  # its extra call stamped before and after it
    assert ms[0].times_s == (1.0, 2.0) or ms[0].times_s == (2.0, 1.0)  # kept as timed: at_usual_bandwidth puts them
    assert run(None)[0] == [3, 3]  # as timed, a's 1.0 and 2.0 are as wide as c's


def test_a_call_stamp_missing_leaves_the_shape_unstamped():
    assert call_stamps([40.0, 10.0, 40.0], [0, 1]) == pytest.approx((20.0, 20.0))
    assert call_stamps([40.0, None, 40.0], [0, 1]) == ()
    assert call_stamps([40.0, 10.0], [1]) == ()  # no stamp after it


def test_trimmed_mean_drops_the_tails():
    assert trimmed_mean([1, 2, 100]) == 2  # three or fewer: the median
    assert trimmed_mean([1, 2, 3, 4, 100, 0]) == pytest.approx(2.5)  # 0 and 100 dropped


def test_noise_report_separates_machine_rounds_from_call_residuals():
    # two shapes, three rounds; round 1 is 10% slow for both; predictions exact at the typical time
    times = [(1.0, 1.1, 1.0), (2.0, 2.2, 2.0), (0.5,)]
    typical, predicted, kinds = [1.0, 2.0, 0.5], [1.0, 2.0, 0.4], ["decode", "prefill", "engine"]
    assert round_factors(times[:2], typical[:2], 3) == pytest.approx([0.0, math.log(1.1), 0.0])
    report = noise_report(times, typical, predicted, kinds, rounds=3)
    # grid calls are exact once their round's factor is taken out; the engine call is 25% over
    assert sorted(report["call_log"])[:-1] == pytest.approx([0.0] * 6, abs=1e-4)
    assert report["call_log"][-1] == pytest.approx(math.log(1.25), abs=1e-4)
    assert report["shape_spread"]["max"] == pytest.approx(0.1)
    # a call still contended after its retries stays out of the residuals
    flagged = noise_report(times, typical, predicted, kinds, rounds=3, contended=[(False, False, True), (), ()])
    assert len(flagged["call_log"]) == len(report["call_log"]) - 1
    # and out of its shape's spread: with shape 0's slow repeat flagged, its other two agree
    assert report["shape_spread"]["median"] == pytest.approx(0.1)
    slow_flagged = noise_report(times, typical, predicted, kinds, rounds=3, contended=[(False, True, False), (), ()])
    assert slow_flagged["shape_spread"]["median"] == pytest.approx(0.05)
    assert slow_flagged["shape_spread"]["max"] == pytest.approx(0.1)


# --- prediction bands ---------------------------------------------------------------------------

def noisy_cost(**noise):
    cost = cost_model_from(step_overhead_s=0.001, const=0.05, prefill_tokens=0.002, decode_tokens=0.001)
    return replace(cost, info={"noise": noise})


def burst(n=12):
    return [Request(f"r{i}", range(10 + i), 4 + i % 3, arrival_s=0.1 * i) for i in range(n)]


CONFIG = SchedulerConfig(name="continuous", max_num_seqs=4)


def test_seeded_replicates_are_reproducible_and_differ_by_seed():
    cost = noisy_cost(round_log=[-0.1, 0.0, 0.1], call_log=[-0.05, 0.0, 0.05, 0.2])
    first = [r.metrics()["e2el_s"]["p50"] for r in replicates(burst, CONFIG, cost, 6, seed=3)]
    again = [r.metrics()["e2el_s"]["p50"] for r in replicates(burst, CONFIG, cost, 6, seed=3)]
    assert first == again
    assert len(set(first)) > 1  # the draws move the metric


def test_without_noise_a_replicate_is_the_deterministic_simulation():
    cost = noisy_cost()  # no noise recorded: factor 1 everywhere
    (rep,) = replicates(burst, CONFIG, cost, 1)
    plain = simulate(burst(), CONFIG, lambda: CostModelExecutor(cost))
    assert rep.metrics() == plain.metrics()
    assert NoisyExecutor(cost, 0).decode_costs(4) is None  # every step drawn on its own


def test_the_profile_measures_how_a_calls_noise_follows_the_call_before():
    """Residuals in the order the calls were timed: a slow call followed by slow calls is a lag-1
    correlation near 1, alternating slow and fast near -1; an order that does not account for every
    call (a round measured again) gives none."""
    from calibration.noise import lag1

    slow_then_fast = [0.2] * 10 + [-0.2] * 10
    shapes = [slow_then_fast[0::2], slow_then_fast[1::2]]  # two shapes timed in turn
    assert lag1(shapes, [0, 1] * 10)[0] > 0.8
    assert lag1([[0.2] * 10, [-0.2] * 10], [0, 1] * 10)[0] < -0.8  # every call flips
    assert lag1(shapes, [0, 1] * 9) == (0.0, 0)  # two calls unaccounted for
    rho, pairs = lag1([[None] + shapes[0][1:], shapes[1]], [0, 1] * 10)  # a left-out call (the first timed)
    assert pairs == 18 and rho > 0.7  # breaks the one pair it is in only
    # ten shapes timed in order, three rounds: in each the first five calls slow, the last five fast
    # (the round's median, taken out, is 0): a spell inside the round, so the calls follow one another
    times = [[math.exp(0.2 if i < 5 else -0.2)] * 3 for i in range(10)]
    report = noise_report(times, [1.0] * 10, [1.0] * 10, ["decode"] * 10, 3, order=list(range(10)) * 3)
    assert report["call_lag1"] > 0.5 and report["call_lag1_pairs"] == 29
    assert noise_report(times, [1.0] * 10, [1.0] * 10, ["decode"] * 10, 3)["call_lag1_pairs"] == 0  # no order given
    # the extra rounds (past the base rounds) run shortest first, not in a random order: left out
    assert noise_report(times, [1.0] * 10, [1.0] * 10, ["decode"] * 10, 2, order=list(range(10)) * 3
                        )["call_lag1_pairs"] == 19


def test_a_replicates_call_residuals_follow_one_another_as_the_calibrations_did():
    """The residuals keep the profile's distribution (mean, spread) and take its lag-1 correlation;
    without one they are drawn independently, exactly as before."""
    call_log = [-0.2, -0.1, 0.0, 0.1, 0.3]
    plain = noisy_cost(call_log=call_log)
    draws = {}
    for rho in (0.0, 0.8):
        cost = replace(plain, info={**plain.info, "noise": {**plain.info["noise"], "call_lag1": rho}})
        ex = NoisyExecutor(cost, 5)
        draws[rho] = [ex._next_residual() for _ in range(20000)]
    old = NoisyExecutor(plain, 5)
    assert draws[0.0][:50] == [old._next_residual() for _ in range(50)]  # the old draws, in the old order
    broken = replace(plain, info={**plain.info, "noise": {**plain.info["noise"], "call_lag1": float("nan")}})
    nan_ex, plain_ex = NoisyExecutor(broken, 5), NoisyExecutor(plain, 5)
    assert [nan_ex._next_residual() for _ in range(3)] == [plain_ex._next_residual() for _ in range(3)]  # NaN: none
    for rho, xs in draws.items():
        x = np.asarray(xs)
        assert abs(x.mean() - np.mean(call_log)) < 0.01 and abs(x.std() / np.std(call_log) - 1) < 0.1
        assert abs(np.corrcoef(x[:-1], x[1:])[0, 1] - rho) < 0.05
    # a request's mean over 40 decode steps keeps more of the noise: what moves a TPOT p99
    means = {rho: np.asarray(xs[:20000 // 40 * 40]).reshape(-1, 40).mean(axis=1).std() for rho, xs in draws.items()}
    assert means[0.8] > 2 * means[0.0]


def test_band_is_a_90_percent_prediction_band_and_coverage_counts_ends():
    # 101 draws: ranks 5 and 97 (1-based) hold a 102nd draw with chance 92/102 ≥ 0.9; plain
    # percentiles (5 and 95) would hold it 90/102 < 0.9
    b = band(list(range(101)))
    assert b == {"p5": 4.0, "p50": 50.0, "p95": 96.0}
    assert inside(4.0, b) and inside(96.0, b) and not inside(96.01, b) and not inside(3.9, b)
    assert width(b) == pytest.approx(92 / 50)
    assert prediction_ranks(20) == (0, 19) and prediction_ranks(100) == (4, 95)  # 19/21, 91/101
    assert prediction_ranks(5) == (0, 4)  # too few draws for 90%: the extremes
    assert set(bands([{"output_throughput_tok_s": 1.0, "ttft_s": {"p50": 1, "p99": 2}, "tpot_s": {"p50": 1, "p99": 1},
                       "e2el_s": {"p50": 1, "p99": 1}}])) >= {"output_throughput", "ttft_p50", "e2e_p99"}


def test_the_leave_one_row_out_band_scales_the_prediction_by_the_other_rows_spread():
    # 99 other runs fell 0.80 … 1.78 of their simulation: the band holds 90% of such ratios
    ratios = [0.8 + 0.01 * i for i in range(99)]
    b = conformal_band(10.0, ratios)
    assert b["p5"] == pytest.approx(10.0 * 0.8 + 10.0 * 0.01 * 4)  # the 5th smallest of 99, rank ⌊0.05·100⌋
    assert b["p95"] == pytest.approx(10.0 * (0.8 + 0.01 * 94))  # the 95th, rank ⌈0.95·100⌉
    assert b["p5"] < b["p50"] < b["p95"] and sum(b["p5"] <= 10 * r <= b["p95"] for r in ratios) == 91
    assert conformal_band(10.0, [1.0, 1.0])["p5"] == conformal_band(10.0, [1.0, 1.0])["p95"] == 10.0
    with pytest.raises(ValueError, match="at least two"):
        conformal_band(10.0, [1.0])


def test_noise_widens_the_band_around_the_deterministic_run():
    quiet = noisy_cost(round_log=[0.0], call_log=[0.0])
    loud = noisy_cost(round_log=[-0.2, 0.2], call_log=[-0.1, 0.1])
    e2e = lambda runs: band([r.metrics()["e2el_s"]["p50"] for r in runs])  # noqa: E731
    q, l_ = e2e(replicates(burst, CONFIG, quiet, 20)), e2e(replicates(burst, CONFIG, loud, 20))
    assert width(q) == 0.0 and width(l_) > 0.2
    assert inside(q["p50"], l_)


# --- validation: the pass rule and contended runs -----------------------------------------------

def test_a_row_passes_within_the_tolerance_or_half_the_real_spread():
    # real 90, 100, 110: median 100, half spread 10%
    assert row_passes(108.0, [90.0, 100.0, 110.0], 0.05) == (pytest.approx(0.08), pytest.approx(0.10), True)
    assert row_passes(112.0, [90.0, 100.0, 110.0], 0.05)[2] is False
    # tight real runs: the tolerance decides
    assert row_passes(104.0, [100.0, 100.0, 100.0], 0.05)[2] is True
    assert row_passes(106.0, [100.0, 100.0, 100.0], 0.05)[2] is False


def test_occupancy_is_judged_in_points_not_relative_to_a_real_zero():
    """A row that never reaches its cap has occupancy 0: relative to it, any simulated share was an
    infinite error (a sim of 0.056 failed by "inf%"); as a share it is 5.6 points off."""
    from experiments.validate import ABSOLUTE_KINDS, METRICS

    assert {kind for _, _, kind in METRICS} & ABSOLUTE_KINDS == {"occupancy"}
    assert row_passes(0.04, [0.0, 0.0, 0.0], 0.05, absolute=True) == (pytest.approx(0.04), 0.05, True)
    assert row_passes(0.056, [0.0, 0.0, 0.0], 0.05, absolute=True)[2] is False
    # half the real spread in points: 0.10–0.30 allows 0.10 either side of the median 0.25
    assert row_passes(0.16, [0.10, 0.25, 0.30], 0.05, absolute=True) == (pytest.approx(-0.09), pytest.approx(0.10), True)
    assert row_passes(0.14, [0.10, 0.25, 0.30], 0.05, absolute=True)[2] is False
    assert repeat_floor(0.0, [0.0, 0.01, 0.02], 0.05, absolute=True) == (1.0, 1.0)


def test_repeat_floor_holds_each_real_run_out_in_turn():
    # real 100, 104, 130 at 5%: 100 vs {104, 130} (median 117, allowed 11.1%): off 14.5%, fails;
    # 104 vs {100, 130} (115, 13.0%): off 9.6%, passes; 130 vs {100, 104} (102, 5%): fails
    repeat, sim = repeat_floor(103.0, [100.0, 104.0, 130.0], 0.05)
    assert repeat == pytest.approx(1 / 3)
    # the simulation against the same pairs: 103 vs 117 (−12.0%, fails), vs 115 (−10.4%, passes),
    # vs 102 (+1.0%, passes)
    assert sim == pytest.approx(2 / 3)
    # identical real runs: every held-out run predicts the others exactly
    assert repeat_floor(50.0, [100.0] * 4, 0.05) == (1.0, 0.0)
    assert repeat_floor(100.0, [100.0, 101.0], 0.05) is None  # two runs: nothing left to judge by


def test_contended_names_each_reason_and_old_profiles_skip_the_memory_check():
    limits = Contention(others_cores=0.15, memory_drift=0.2)
    assert contended(0.1, Stamps(50.0), Stamps(50.0), limits) == ""
    assert "cores" in contended(0.5, Stamps(50.0), Stamps(50.0), limits)
    assert "memory 35 GB/s vs calibration 50" in contended(0.0, Stamps(35.0), Stamps(50.0), limits)
    assert contended(0.0, Stamps(35.0), Stamps(math.nan), limits) == ""


def test_a_run_is_judged_by_its_weights_read_rate_where_both_sides_stamped_one():
    limits = Contention(others_cores=0.15, memory_drift=0.2)
    # the fresh buffer read 22% slow but the weights, what the calls stream, 4%: not contended
    assert contended(0.0, Stamps(22.0, 25.0), Stamps(28.0, 26.0), limits) == ""
    # the weights read 25% slow while the fresh buffer did not: contended, and the reason says which
    reason = contended(0.0, Stamps(28.0, 19.0), Stamps(28.0, 26.0), limits)
    assert "weights 19 GB/s vs calibration 26 (-27%)" in reason
    # either side without a weights stamp (a GPU, an older profile): the fresh buffers decide
    assert "memory 22 GB/s" in contended(0.0, Stamps(22.0, 25.0), Stamps(28.0, None), limits)
    assert "memory 22 GB/s" in contended(0.0, Stamps(22.0, None), Stamps(28.0, 26.0), limits)


def test_the_last_attempt_of_each_repeat_counts_and_the_contended_first_stays_out():
    runs = [{"repeat": 0, "attempt": 0, "contended": True, "x": 1}, {"repeat": 0, "attempt": 1, "contended": False, "x": 2},
            {"repeat": 1, "attempt": 0, "contended": False, "x": 3}]
    assert [r["x"] for r in counted(runs)] == [2, 3]


def test_past_the_time_budget_only_the_base_rounds_run():
    script = {"a": [(1.0, True)], "b": [(1.0, False)], "c": [(1.0, False), (2.0, False)]}
    pool = FakePool(script)
    ms, mlog = measure_shapes(pool, list(SHAPES.values()), repeats=2, warmup=0, progress=False,
                              robust=Robustness(budget_s=0.0))
    assert mlog.retried == 0 and mlog.extra_rounds == 0  # a contended a and a wide c, but no time left
    assert all(len(m.times_s) == 2 for m in ms) and len(pool.calls) == 6


def test_a_call_still_contended_after_its_retries_is_kept_flagged_and_left_out_of_the_typical_time():
    script = {"a": [(1.0, False), (5.0, True), (5.0, True), (1.2, False)], "b": [(1.0, False)], "c": [(1.0, True)]}
    pool = FakePool(script)
    ms, _ = measure_shapes(pool, list(SHAPES.values()), repeats=2, warmup=0, progress=False,
                           robust=Robustness(max_retries=1, extra_rounds=0))
    a, _, c = ms
    assert a.times_s == (1.0, 5.0) and a.contended == (False, True)
    assert a.typical_s == 1.0  # the disturbed 5.0 is left out
    assert c.typical_s == 1.0 and all(c.contended)  # nothing undisturbed: all of them count


def test_after_idle_is_the_median_extra_per_idle_length_each_taken_in_turn_within_a_round():
    from calibration.profiler import after_idle_sleep_s, measure_after_idle

    slept = []
    # round 0: a 0.1 s pair of each shape, then a 2 s pair of each; rounds 1 and 2: 0.1 s pairs
    a = [(1.0, False), (1.2, False), (1.0, False), (1.6, False)] + [(1.0, False), (1.2, False)] * 2
    b = [(2.0, False), (2.1, False), (2.0, False), (2.4, False)] + [(2.0, False), (2.1, False)] * 2
    pool = FakePool({"a": a, "b": b})
    levels = ((0.1, 3), (2.0, 1))
    out = measure_after_idle(pool, [SHAPES["a"], SHAPES["b"]], levels, sleep=slept.append)
    # round 0 takes both idle lengths, rounds 1 and 2 the short one only
    assert slept == [0.1, 0.1, 2.0, 2.0, 0.1, 0.1, 0.1, 0.1]
    assert sum(slept) == pytest.approx(after_idle_sleep_s(2, levels))
    short, long = out["levels"]
    assert (short["idle_s"], short["pairs"], long["idle_s"], long["pairs"]) == (0.1, 6, 2.0, 2)
    assert short["extra_s"] == pytest.approx(0.15)  # median of 0.2 ×3 and 0.1 ×3
    assert long["extra_s"] == pytest.approx(0.5) and long["ratio_median"] == pytest.approx((1.6 + 2.4 / 2) / 2)
