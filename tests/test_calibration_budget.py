"""A calibration sized to its machine: the grid thinned to the time budget, cut by cut."""

import math
import time

import pytest

from calibration.budget import plan_measurement, price_calls
from calibration.calibrate import EXTRA_SHARE, MEASURE_SHARE, CalibrationConfig, plan_to_budget, with_pass_edges
from calibration.grid import GRID_SPECS, Shape, build_grid
from calibration.noise import round_factors
from calibration.profiler import Robustness, measure_shapes

# the full grid as a calibration on a 2-core AVX2 VM builds it (the edges of the gemv's 6-row passes)
FULL = build_grid(with_pass_edges(GRID_SPECS["full"], 6))


def slow_machine_prices(shapes):
    """A CPU where a 1-token call takes 0.1 s and a 256-token one 2.9 s (a 2-core AVX2 VM)."""
    return price_calls(shapes, (1, 0.1), (256, 2.9))


def cost(plan):
    return sum((w + r) * c for w, r, c in zip(plan.warmups, plan.repeats, plan.call_s))


def test_prices_are_linear_in_tokens_through_the_two_pilot_calls():
    shapes = [Shape("decode", decode_contexts=(8,)), Shape("decode", decode_contexts=(8,) * 4),
              Shape("prefill", chunks=((100, 0, True),)), Shape("mixed", (5, 5), ((9, 0, True),))]
    assert [s.num_tokens for s in shapes] == [1, 4, 100, 11]
    assert price_calls(shapes, (1, 0.1), (101, 1.1)) == pytest.approx([0.1, 0.13, 1.09, 0.2])
    assert price_calls(shapes, (1, 0.1), (1, 0.1)) == pytest.approx([0.1] * 4)  # one size: one price


def test_a_budget_the_grid_fits_or_none_keeps_the_grid_as_written():
    prices = slow_machine_prices(FULL)
    for budget in (None, 1e6):
        plan = plan_measurement(FULL, prices, repeats=3, warmup=1, budget_s=budget)
        assert plan.shapes == FULL and plan.cuts == []
        assert set(plan.warmups) == {1} and set(plan.repeats) == {3}
        assert plan.predicted_s == pytest.approx(4 * sum(prices))


def test_a_tight_budget_cuts_mixed_steps_then_warm_ups_then_repeats_of_long_calls_only():
    prices = slow_machine_prices(FULL)
    whole = 4 * sum(prices)
    budget = 0.38 * whole  # every cut can bring it to 37% (the grid's prompts are never cut)
    plan = plan_measurement(FULL, prices, repeats=3, warmup=1, budget_s=budget)
    assert cost(plan) == pytest.approx(plan.predicted_s) and plan.predicted_s <= budget
    assert len(plan.cuts) == 3
    mixed = [s for s in FULL if s.kind == "mixed"]
    kept_mixed = [s for s in plan.shapes if s.kind == "mixed"]
    assert kept_mixed == mixed[:12]  # the first drawn: still a random draw of the scheduler's steps
    # decodes and prefill chunks are never cut, and their order is the grid's
    assert [s for s in plan.shapes if s.kind != "mixed"] == [s for s in FULL if s.kind != "mixed"]
    for shape, w, r, c in zip(plan.shapes, plan.warmups, plan.repeats, plan.call_s):
        if c < 0.5:  # short calls keep their warm-up and every repeat: that is where the noise is
            assert (w, r) == (1, 3), shape.name
        else:
            assert w == 0 and r in (2, 3)
    # the repeats cut are those of the longest calls
    two = [c for c, r in zip(plan.call_s, plan.repeats) if r == 2]
    three_long = [c for c, r in zip(plan.call_s, plan.repeats) if r == 3 and c >= 0.5]
    assert two and (not three_long or min(two) >= max(three_long))


def test_a_budget_nothing_fits_applies_every_cut_and_says_it_is_over():
    prices = slow_machine_prices(FULL)
    plan = plan_measurement(FULL, prices, repeats=3, warmup=1, budget_s=1.0)
    assert plan.predicted_s > 1.0 and min(plan.repeats) == 2  # every shape keeps two repeats
    assert sum(s.kind == "mixed" for s in plan.shapes) == 12
    assert all(r == 2 for r, c in zip(plan.repeats, plan.call_s) if c >= 0.5)


class PricedPool:
    """A pool whose calls take a time set by their tokens, counted per plan."""

    request_ids = [f"r{i}" for i in range(64)]

    def __init__(self, s_per_token):
        self.s_per_token = s_per_token
        self.calls = []

    def execute(self, plan):
        self.calls.append(plan)
        return 0.05 + self.s_per_token * plan.total_tokens, False


def test_the_pilot_prices_the_grid_and_the_plan_leaves_room_for_the_rest():
    pool = PricedPool(0.01)
    cfg = CalibrationConfig(time_budget_s=300.0)  # the whole grid would take 466 s
    plan = plan_to_budget(pool, FULL, cfg, grid_repeats=3, started_at=time.perf_counter() - 10.0)
    assert len(pool.calls) == 4  # the smallest and the largest call, each after its warm-up
    assert plan.call_s == pytest.approx([0.05 + 0.01 * s.num_tokens for s in plan.shapes])
    left = MEASURE_SHARE * 300.0 - 10.0
    assert plan.budget_s == pytest.approx(left, abs=0.5)  # what the extra rounds may run up to ...
    assert plan.predicted_s <= (1 - EXTRA_SHARE) * plan.budget_s  # ... the base rounds planned below it
    assert plan.cuts and plan.to_dict()["repeats_by_shape"] == plan.repeats
    # the after-idle sleeps come off what is left to measure
    slept = plan_to_budget(PricedPool(0.01), FULL, cfg, 3, time.perf_counter() - 10.0, set_aside_s=28.0)
    assert slept.budget_s == pytest.approx(left - 28.0, abs=0.5) and slept.predicted_s < plan.predicted_s
    # so do the idle steps' rests: twice a 16-token call at the pilot's price each (0.21 s here)
    rests = plan_to_budget(PricedPool(0.01), FULL, cfg, 3, time.perf_counter() - 10.0, idle_steps=8)
    assert rests.budget_s == pytest.approx(left - 8 * 2 * 0.21, abs=0.5)
    unbounded = plan_to_budget(PricedPool(0.01), FULL, CalibrationConfig(time_budget_s=None), 3, time.perf_counter())
    assert unbounded.shapes == FULL and unbounded.budget_s is None and unbounded.to_dict()["predicted_s"] is None


def test_a_pilot_call_others_disturbed_is_timed_again():
    pool = PricedPool(0.01)
    disturbed = iter([False, True, False])  # the small pilot's timed call is contended once

    def execute(plan):
        took, _ = PricedPool.execute(pool, plan)
        return (took * 5, True) if next(disturbed, False) else (took, False)

    pool.execute = execute
    plan = plan_to_budget(pool, FULL, CalibrationConfig(time_budget_s=300.0), 3, time.perf_counter())
    assert len(pool.calls) == 5  # warm-up, the contended call, its retry; then the large one's two
    assert plan.call_s[0] == pytest.approx(0.05 + 0.01 * plan.shapes[0].num_tokens)  # not 5× that


def test_extra_rounds_take_the_shortest_wide_shapes_first():
    shapes = FULL[:3]
    times = {0: [1.0, 2.0], 1: [0.1, 0.2], 2: [0.5, 0.5]}  # shapes 0 and 1 spread wide, 2 does not
    plans = [s.to_plan(PricedPool.request_ids) for s in shapes]
    calls = []

    class Scripted:
        request_ids = PricedPool.request_ids

        def execute(self, plan):
            i = plans.index(plan)
            calls.append(i)
            return times[i][(len([c for c in calls if c == i]) - 1) % 2], False

    ms, mlog = measure_shapes(Scripted(), shapes, repeats=2, warmup=0, progress=False,
                              robust=Robustness(extra_rounds=1, wide_spread=0.1))
    assert calls[6:] == [1, 0] and mlog.extra_rounds == 1  # the 0.1 s shape before the 1 s one
    assert [len(m.times_s) for m in ms] == [3, 3, 2]


def test_round_factors_leave_a_shape_s_extra_repeats_out_of_the_rounds_it_was_not_in():
    typical = [1.0, 1.0]
    times = [[1.1, 1.1, 1.1], [1.1, 1.1, 2.0]]  # shape 1 had two repeats: its third is an extra round's
    assert round_factors(times, typical, [3, 2])[2] == pytest.approx(math.log(1.1))
    assert round_factors(times, typical, 3)[2] == pytest.approx((math.log(1.1) + math.log(2.0)) / 2)  # counted in


def test_per_shape_warm_ups_and_repeats_are_the_calls_made():
    shapes = FULL[:5]
    pool = PricedPool(0.0)
    ms, _ = measure_shapes(pool, shapes, repeats=[3, 2, 2, 3, 2], warmup=[1, 0, 1, 0, 0], progress=False)
    assert [len(m.times_s) for m in ms] == [3, 2, 2, 3, 2]
    plans = [s.to_plan(pool.request_ids) for s in shapes]
    assert [sum(c == p for c in pool.calls) for p in plans] == [4, 2, 3, 3, 2]


def test_a_budget_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="time_budget_s"):
        CalibrationConfig(time_budget_s=0.0)


def test_the_longest_idle_lengths_go_when_their_sleeps_outgrow_their_share_of_the_budget():
    from calibration.calibrate import IDLE_SHARE, idle_levels_in_budget
    from calibration.grid import GRID_SPECS
    from calibration.profiler import after_idle_sleep_s

    full = GRID_SPECS["full"].idle_levels  # 4 shapes: 28 s of sleep
    assert idle_levels_in_budget(full, 4, 300.0) == full and idle_levels_in_budget(full, 4, None) == full
    kept = idle_levels_in_budget(full, 4, 60.0)  # 9 s for the sleeps: 4 s and 1.5 s go
    assert kept == full[:2] and after_idle_sleep_s(4, kept) <= IDLE_SHARE * 60.0
    assert idle_levels_in_budget(full, 4, 1.0) == full[:1]  # the shortest stays, whatever the budget
