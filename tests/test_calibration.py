"""Calibration: the fit, the plan features, the profile's guard, and the Hydra app end to end."""

import json
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration.calibrate import add_physical, fit_cost_model
from calibration.physical import PhysicalShape
from calibration.cost_model import FEATURES, PASS_EDGES, REGISTER_BLOCKS, SAMPLE_KNOTS, TOKEN_KNOTS, CostModel, \
    ProfileMismatchError, plan_features, tents
from calibration.fit import Errors, fit_nnls, split_heldout, supported_knots
from calibration.grid import GRID_SPECS, Shape, build_grid
from calibration.profiler import Measurement, make_runner, step_overheads
from calibration.roofline import (GPU_CALLS, Machine, ModelShape, best_s, call_work, measure_machine, roofline_s,
                                  workload_floor_s)
from engine.core.config import ModelConfig, SchedulerConfig
from engine.llm_engine import StepRecord
from engine.model import kernels
from engine.model.kernels.features import cpu_features
from engine.model.loader import config_fingerprint
from engine.core.plan import BatchPlan
from engine.core.request import Request
from tests.helpers import drain


def feature(plan: BatchPlan, name: str) -> float:
    return plan_features(plan)[FEATURES.index(name)]


def hand_plan() -> BatchPlan:
    # two decodes at contexts 10 and 20; chunks: 5 tokens after 3 (no sample), a 4-token prompt
    return BatchPlan("continuous", ("a", "b", "c", "d"), (1, 1, 5, 4), (10, 20, 3, 0),
                     (True, True, False, True), explicit_decodes=2)


def test_features_of_a_hand_made_mixed_plan():
    p = hand_plan()
    assert len(plan_features(p)) == len(FEATURES)
    assert feature(p, "const") == 1
    assert feature(p, "prefill_tokens") == 9
    assert feature(p, "decode_tokens") == 2
    assert feature(p, "decode_context") == 30
    assert feature(p, "prefill_attention") == 5 * (3 + 2.5) + 4 * (0 + 2)
    assert feature(p, "num_requests") == 4
    # T = 11 lies halfway between knots 10 and 12; S = 3 is a knot
    assert feature(p, "tokens@10") == pytest.approx(0.5) and feature(p, "tokens@12") == pytest.approx(0.5)
    assert sum(plan_features(p)[FEATURES.index(f"tokens@{TOKEN_KNOTS[0]}"):][:len(TOKEN_KNOTS)]) == pytest.approx(1)
    assert feature(p, "samples@3") == 1 and feature(p, "samples@2") == 0


def test_features_of_pure_decode_and_unsampled_prefill():
    d = BatchPlan("static", ("a", "b", "c"), (1, 1, 1), (7, 8, 9), (True,) * 3, explicit_decodes=3)
    assert (feature(d, "decode_tokens"), feature(d, "decode_context"), feature(d, "prefill_tokens")) == (3, 24, 0)
    assert feature(d, "tokens@3") == 1 and feature(d, "samples@3") == 1
    big = BatchPlan("static", tuple("abcdefghijkl"), (1,) * 12, (5,) * 12, (True,) * 12, explicit_decodes=12)
    assert feature(big, "samples@8") == pytest.approx(0.5) and feature(big, "samples@16") == pytest.approx(0.5)
    p = BatchPlan("continuous", ("a",), (128,), (256,), (False,), explicit_decodes=0)
    assert feature(p, "prefill_attention") == 128 * (256 + 64)
    assert feature(p, "tokens@128") == 1
    assert all(feature(p, f"samples@{k}") == 0 for k in SAMPLE_KNOTS)  # no lm_head row


def test_tents_interpolate_and_extrapolate_proportionally():
    knots = (1, 2, 4)
    assert tents(0, knots) == [0, 0, 0]
    assert tents(3, knots) == [0, 0.5, 0.5]
    assert tents(12, knots) == [0, 0, 3.0]


@settings(max_examples=200, deadline=None)
@given(entries=st.lists(st.tuples(st.integers(1, 600), st.integers(0, 3000), st.booleans()), min_size=1,
                        max_size=70),
       num_decodes=st.integers(0, 70), coefficients=st.lists(st.floats(0, 1), min_size=len(FEATURES),
                                                             max_size=len(FEATURES)))
def test_predict_is_the_coefficients_times_the_features(entries, num_decodes, coefficients):
    nd = min(num_decodes, len(entries))
    entries = [(1, c, True) for _, c, _ in entries[:nd]] + entries[nd:]
    n, ctx, samples = zip(*entries)
    plan = BatchPlan("continuous", tuple(f"r{i}" for i in range(len(entries))), n, ctx, samples, nd)
    model = CostModel(tuple(coefficients))
    expected = sum(c * x for c, x in zip(coefficients, plan_features(plan)))
    assert model.predict(plan) == pytest.approx(expected, rel=1e-12, abs=1e-300)


def test_nnls_recovers_known_coefficients():
    rng = np.random.default_rng(3)
    X = np.column_stack([np.ones(300), rng.uniform(1, 256, 300), rng.uniform(0, 1e4, 300), rng.integers(1, 33, 300)])
    truth = np.array([0.08, 3e-3, 0.0, 2e-3])
    coef = fit_nnls(X, X @ truth)
    np.testing.assert_allclose(coef, truth, rtol=1e-6, atol=1e-12)
    noisy = X @ truth * rng.lognormal(0, 0.01, 300)
    np.testing.assert_allclose(fit_nnls(X, noisy), truth, rtol=0.05, atol=1e-6)


def test_fit_reproduces_a_known_cost_model_on_heldout_grid_plans():
    shapes = build_grid(GRID_SPECS["full"])
    ids = [f"r{i}" for i in range(64)]
    truth = np.zeros(len(FEATURES))
    for name, value in {"const": 0.05, "prefill_tokens": 3e-3, "decode_context": 2e-6, "num_requests": 1e-3,
                        "tokens@2": 0.06, "samples@1": 0.04, "samples@32": 0.08}.items():
        truth[FEATURES.index(name)] = value
    known = CostModel(tuple(truth))
    measurements = [Measurement(s, p := s.to_plan(ids), (known.predict(p),)) for s in shapes]
    held = split_heldout([s.kind for s in shapes], 0.25)
    _, predicted = fit_cost_model(measurements, held)
    errors = Errors.of(predicted[held], [m.median_s for m in np.asarray(measurements)[held]])
    assert errors.max_error < 1e-6 and errors.r2 > 0.999999


def test_heldout_split_keeps_every_kind_on_both_sides():
    kinds = ["decode"] * 8 + ["prefill"] * 8 + ["mixed"] * 4
    held = split_heldout(kinds, 0.25, seed=1)
    for kind in ("decode", "prefill", "mixed"):
        sel = np.asarray(kinds) == kind
        assert 0 < held[sel].sum() < sel.sum()


def test_grid_plans_are_valid_and_cover_every_kind():
    for name, spec in GRID_SPECS.items():
        shapes = build_grid(spec)
        assert {s.kind for s in shapes} == {"decode", "prefill", "mixed"}
        for s in shapes:
            plan = s.to_plan([f"r{i}" for i in range(spec.max_seqs + 32)])
            assert plan.total_tokens <= max(spec.max_batched_tokens, max(spec.prefill_chunks))
            assert all(n == 1 for n in plan.num_tokens[:plan.num_decodes])
            assert plan.phase == s.kind or (s.kind == "prefill" and plan.phase == "prefill")


def test_profile_for_another_model_or_dtype_is_refused(tmp_path):
    tiny = config_fingerprint(ModelConfig(name="tiny"))
    path = tmp_path / "profile.json"
    CostModel((0.01,) * len(FEATURES), 1e-4, FEATURES, tiny,
              {"model": {"name": "tiny", "dtype": "float32"}}).save(path)
    assert CostModel.load(path, expect_fingerprint=tiny).step_overhead_s == 1e-4
    for other in (ModelConfig(name="qwen2_5_0_5b"), ModelConfig(name="tiny", dtype="bfloat16")):
        with pytest.raises(ProfileMismatchError, match="tiny, float32"):
            CostModel.load(path, expect_fingerprint=config_fingerprint(other))
    data = json.loads(path.read_text())
    data["feature_names"] = data["feature_names"][:6]
    data["coefficients"] = data["coefficients"][:6]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileMismatchError, match="recalibrate"):
        CostModel.load(path, expect_fingerprint=tiny)


def test_step_overhead_is_time_outside_the_model_call_plus_the_gap():
    plan = hand_plan()
    steps = [StepRecord(plan, 0.0, 1.0, 0.9), StepRecord(plan, 1.05, 2.0, 0.9)]
    assert step_overheads(steps) == pytest.approx([0.1 + 0.05, 0.05])


def test_roofline_counts_weights_kv_and_flops():
    shape = ModelShape(dense_params=1000, lm_head_params=500, bytes_per_param=4, kv_bytes_per_token=8,
                       attn_flops_per_pair=16)
    bytes_moved, flops = call_work(hand_plan(), shape)
    kv_read = (10 + 1) + (20 + 1) + (3 + 5) + (0 + 4)
    assert bytes_moved == (1000 + 500) * 4 + (kv_read + 11) * 8
    pairs = (10 + 1) + (20 + 1) + 5 * (3 + 3) + 4 * (0 + 2.5)
    assert flops == 2 * 1000 * 11 + 2 * 500 * 3 + 16 * pairs
    assert roofline_s(hand_plan(), shape, Machine(1e3, 1e12)) == pytest.approx(bytes_moved / 1e3)


@pytest.mark.parametrize("sched", [SchedulerConfig(name="serial", max_num_seqs=1),
                                   SchedulerConfig(name="static", max_num_seqs=4),
                                   SchedulerConfig(name="continuous", max_num_seqs=3, max_num_batched_tokens=8,
                                                   long_prefill_token_threshold=5)])
def test_a_workloads_floor_counts_the_flops_every_schedule_of_it_does(sched):
    """However a scheduler batches and chunks them, the calls' FLOPs add up to the floor's: the
    floor is schedule-free, so a system's time over it is all that system's loss."""

    shape = ModelShape(dense_params=1000, lm_head_params=500, bytes_per_param=4, kv_bytes_per_token=8,
                       attn_flops_per_pair=16)
    requests = [Request(f"r{i}", [2 + i] * prompt, output)
                for i, (prompt, output) in enumerate([(11, 1), (3, 4), (17, 9), (8, 2), (1, 6)])]
    lengths = [(r.num_prompt_tokens, r.max_tokens) for r in requests]
    plans, _ = drain(sched, requests)
    flops = sum(call_work(p, shape)[1] for p in plans)
    compute_bound = Machine(bandwidth_bytes_s=1e30, matmul_flops_s=1e6)
    assert workload_floor_s(lengths, shape, compute_bound) == pytest.approx(flops / 1e6)
    # memory-bound: the longest request's 9 calls each read the weights once
    memory_bound = Machine(bandwidth_bytes_s=1e3, matmul_flops_s=1e30)
    assert workload_floor_s(lengths, shape, memory_bound) == pytest.approx(9 * 1500 * 4 / 1e3)
    with pytest.raises(ValueError, match="output token"):
        workload_floor_s([(11, 0)], shape, compute_bound)


def test_quick_calibration_of_the_tiny_model_through_the_hydra_app(tiny_calibration):
    out, tmp_path = tiny_calibration.run, tiny_calibration.dir  # the session's one run (conftest.py)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held out" in out.stdout and "roofline" in out.stdout
    # progress is on by default, but off a terminal only one summary line reaches the output and the log
    log = (tmp_path / "calibrate.log").read_text()
    assert "\r" not in out.stdout + out.stderr + log and "calibrating" not in out.stderr
    assert "timed calls in" in log and "calls measured again" in log
    assert "time budget 300 s" in log  # the default budget, which the tiny model's grid fits whole
    data = json.loads((tmp_path / "profile.json").read_text())
    spread = data["noise"]["shape_spread"]  # the run's own noise, reported beside its errors
    assert 0 <= spread["median"] <= spread["p90"]
    assert f"median {100 * spread['median']:.1f}%, 90th percentile {100 * spread['p90']:.1f}%" in out.stdout
    assert 0 <= data["fit"]["heldout_mape"] and 0 <= data["fit"]["heldout_max_error"]
    assert data["fit"]["heldout_max_error"] >= data["fit"]["heldout"]["median_error"]
    assert data["fingerprint"] == config_fingerprint(ModelConfig(name="tiny"))
    assert data["measured_on"]["threads"] == 1 and data["model"]["dtype"] == "float32"
    on = data["measured_on"]  # where it was measured, as a GPU profile would say it
    assert on["device"] == "cpu" and on["device_name"] == on["cpu"] and on["torch"] == torch.__version__
    assert on["cpu_features"] == sorted(cpu_features())
    assert set(on["kernels"]) == {"gemv", "gate_up_silu", "decode_attention", "prefill_attention", "layer_ops",
                                  "argmax", "decoder_layers"}
    # one attention kernel, recorded per phase of a step; SiLU·up in the gate/up product where the gemv runs
    op = {"prefill_attention": "decode_attention", "gate_up_silu": "gemv"}
    runs = {k: kernels.enabled() and kernels.can_run(op.get(k, k), torch.float32) for k in on["kernels"]
            if k != "decoder_layers"}
    # the fused ops run wherever they can; the gemv and the attention kernel where the dispatch
    # table measured them faster (never where they cannot run); the layers in one call only where
    # the gemv, the layer ops and the attention kernel all run
    assert all(on["kernels"][k] == runs[k] for k in ("layer_ops", "argmax"))
    assert all(runs[k] or not on["kernels"][k] for k in ("gemv", "decode_attention", "prefill_attention"))
    assert on["kernels"]["gate_up_silu"] == on["kernels"]["gemv"]  # tiny's MLP width, 128, interleaves
    assert on["kernels"]["decoder_layers"] <= (on["kernels"]["gemv"] and on["kernels"]["layer_ops"]
                                               and (on["kernels"]["decode_attention"] or on["kernels"]["prefill_attention"]))
    # the quick grid with prompts at the edges of this machine's gemv passes (both blocks' without a gemv)
    edges = tuple(data["grid"]["spec"]["edge_chunks"])
    assert set(edges) <= set(PASS_EDGES) and edges
    from dataclasses import replace
    quick = replace(GRID_SPECS["quick"], edge_chunks=edges)
    assert data["grid"]["calls"] == len(build_grid(quick)) and data["grid"]["budget"]["cuts"] == []
    # what the budget leaves for measuring also bounds the retries and extra rounds
    assert 0 < data["grid"]["robust"]["budget_s"] == data["grid"]["budget"]["budget_s"] < 0.8 * 300
    kinds = [m["kind"] for m in data["measurements"]]
    engine = [m for m in data["measurements"] if m["kind"] == "engine"]
    # every engine call timed, once: each shape's calls from the runs (same lengths, same plans) are its repeats
    assert sum(len(m["times_s"]) for m in engine) == data["grid"]["engine_calls"] == data["step_overhead"]["steps"] > 0
    # the first step after a rest: the loop's late wake-up and the work before its call
    assert data["step_overhead"]["idle_wake_median_s"] >= 0 and data["step_overhead"]["idle_before_call_median_s"] > 0
    assert len(engine) == data["grid"]["engine_shapes"] == len({m["shape"] for m in engine})
    assert max(len(m["times_s"]) for m in engine) == 3  # the default three runs replay the same plans
    assert len(kinds) == data["grid"]["calls"] + data["grid"]["engine_shapes"]
    assert "engine" in data["fit"]["by_kind_heldout"]  # calls inside a serving loop are scored too
    assert (tmp_path / "calibration.png").stat().st_size > 10_000
    # both models fitted on the same calls and both reported; the profile says which its own model uses
    assert "physical held out" in out.stdout and data["preferred"] in ("empirical", "physical")
    physical = data["physical"]
    assert physical["fit"]["heldout"]["n"] == data["fit"]["heldout"]["n"] > 0
    assert physical["machine"]["memory_gb_s"] > 0 and physical["shape"]["layers"] == 2
    assert all(m["physical_s"] > 0 for m in data["measurements"])
    # where the decode weights can be read (not oneDNN's opaque copies), every grid call carries its
    # stamp and its time as timed beside the one put at the usual bandwidth, and the rounds theirs;
    # the engine calls carry their serving run's stamp, one per run (a shape's repeats are its runs)
    grid = [m for m in data["measurements"] if m["kind"] != "engine"]
    if data["weights_read_gb_s"]["before"] is not None:
        assert all(len(m["stamps_gb_s"]) == len(m["raw_times_s"]) == len(m["times_s"]) for m in data["measurements"])
        assert 1 <= len({w for m in engine for w in m["stamps_gb_s"]}) <= 3
        assert len(data["weights_read_gb_s"]["rounds"]) >= GRID_SPECS["quick"].repeats
        assert "held out, as timed" in out.stdout and "every call stamped" in out.stdout
    else:
        assert not any("stamps_gb_s" in m for m in grid)
    # the calls' order reached the noise report: the lag-1 correlation was computed over its pairs
    assert data["noise"]["call_lag1_pairs"] > 0 and -1 <= data["noise"]["call_lag1"] <= 1
    refit = add_physical({k: v for k, v in data.items() if k not in ("physical", "preferred")},
                         PhysicalShape(**physical["shape"]))
    assert refit["physical"]["coefficients"] == pytest.approx(physical["coefficients"], rel=1e-6, abs=1e-12)
    model = CostModel.load(tmp_path / "profile.json", expect_fingerprint=data["fingerprint"])
    assert model.predict(hand_plan()) > 0 and model.step_overhead_s == data["step_overhead"]["median_s"]



def test_knot_support_and_the_map_from_the_measured_knots_to_every_knot():
    from calibration.fit import knot_map, supported_knots
    knots = (1, 2, 4, 8, 16)
    # 3 lies halfway between 2 and 4: half a call each pins neither; two such calls pin both; 20 is past the end
    assert supported_knots([1, 3, 8, 20], knots) == [True, False, False, True, True]
    assert supported_knots([3, 3], knots) == [False, True, True, False, False]
    values = np.array([1.0, 8.0])  # the curve at knots 1 and 8, the only ones measured
    flat = knot_map(knots, [True, False, False, True, False], proportional=False)
    np.testing.assert_allclose(flat @ values, [1.0, 2.0, 4.0, 8.0, 8.0])  # linear between, constant past 8
    grows = knot_map(knots, [True, False, False, True, False], proportional=True)
    np.testing.assert_allclose(grows @ values, [1.0, 2.0, 4.0, 8.0, 16.0])  # past 8: scaled by the knot


def physical_truth():
    """A known smooth physical cost on the 0.5B shape: worse at small row counts, flat from 64."""
    from calibration.physical import PHYSICAL_FEATURES, ROW_KNOTS, Machine as PhysicalMachine, PhysicalCostModel
    from engine.core.model_shape import model_shape
    coef = np.zeros(len(PHYSICAL_FEATURES))
    coef[0] = 1e-4
    for i, k in enumerate(ROW_KNOTS):
        coef[2 + i] = 1.0 + 0.5 / min(k, 64) ** 0.5
    coef[-2:] = 1.5
    return PhysicalCostModel(tuple(coef), PhysicalShape.of(model_shape(ModelConfig(name="qwen2_5_0_5b")), "float32"),
                             PhysicalMachine(40.0, 400.0))


@pytest.mark.parametrize("model", ["empirical", "physical"])
def test_a_grid_without_calls_near_a_knot_fits_the_curve_there_from_its_neighbours(model):
    """The quick grid times no call near 10 or 12 tokens, nor past 96: least squares left those
    knots at 0, and a 12-token prefill was predicted at a quarter of its time (the seed's serial
    run +12.5% fast). Fitted on the quick grid against a known smooth cost, every prefill up to 96
    tokens must come out within 3% of it."""
    from calibration.calibrate import fit_physical
    from calibration.physical import PhysicalCostModel
    shapes = build_grid(GRID_SPECS["quick"])
    ids = [f"r{i}" for i in range(64)]
    plans = [s.to_plan(ids) for s in shapes]
    if model == "empirical":
        coef = np.zeros(len(FEATURES))
        coef[FEATURES.index("const")], coef[FEATURES.index("decode_context")] = 0.02, 1e-6
        for k in TOKEN_KNOTS:  # the dense products: a concave curve over the call's tokens
            coef[FEATURES.index(f"tokens@{k}")] = 4e-3 * k ** 0.8
        for k in SAMPLE_KNOTS:
            coef[FEATURES.index(f"samples@{k}")] = 0.01
        truth = CostModel(tuple(coef))
    else:
        truth = physical_truth()
    measurements = [Measurement(s, p, (truth.predict(p),)) for s, p in zip(shapes, plans)]
    held = np.zeros(len(shapes), dtype=bool)
    if model == "empirical":
        fitted, _ = fit_cost_model(measurements, held)
        fit = CostModel(tuple(fitted))
    else:
        fitted, _ = fit_physical(measurements, held, truth.shape, truth.machine)
        fit = PhysicalCostModel(tuple(fitted), truth.shape, truth.machine)
    # (the empirical model from 4 tokens: the grid's only 3-token calls are decodes, which leave its
    # prefill-token and decode-token terms apart unidentified there, knots or not)
    for t in range(1 if model == "physical" else 4, 97):
        plan = BatchPlan.of("serial", ["a"], [t], [0], [True], 0)
        assert fit.predict(plan) == pytest.approx(truth.predict(plan), rel=0.03), t


def test_the_grids_time_a_chunk_beside_every_decode_batch_and_quick_every_batch_up_to_its_max_seqs():
    for spec in GRID_SPECS.values():
        assert set(spec.decode_batches) <= set(spec.prefill_chunks)
    assert set(range(1, GRID_SPECS["quick"].max_seqs + 1)) <= set(GRID_SPECS["quick"].decode_batches)


@pytest.mark.parametrize("model", ["empirical", "physical"])
def test_a_mixed_calls_noise_stays_off_the_curve_at_its_sampled_rows(model):
    """One mixed call sampling 5 rows timed 25% slow (noise); its lm_head is a few percent of the
    call. A grid without 5-row calls let it pin the physical curve's rows@5 (fitted at 7.7x: a
    seed run's 5-decode steps simulated at 820 ms against 150 measured), and the empirical
    samples@5 with tokens@5 unidentified beside it. Physical: on a grid still without 5-row calls,
    the knot follows its neighbours. Both, on the quick grid: every decode batch and every chunk up
    to max_seqs priced as the truth."""
    from dataclasses import replace

    from calibration.calibrate import fit_physical
    from calibration.physical import PhysicalCostModel
    truth = physical_truth()
    noisy = Shape("mixed", decode_contexts=(40, 40, 40), chunks=((40, 0, True), (30, 0, True), (6, 32, False)))
    spec = GRID_SPECS["quick"]
    if model == "physical":
        spec = replace(spec, decode_batches=(1, 2, 3, 4, 6, 8), prefill_chunks=(1, 2, 4, 8, 16, 32, 48))
    shapes = [s for s in build_grid(spec) if model == "empirical" or s.num_tokens != 5] + [noisy]
    ids = [f"r{i}" for i in range(64)]
    plans = [s.to_plan(ids) for s in shapes]
    assert plans[-1].num_samples == 5 and (model == "empirical") == (5 in {p.total_tokens for p in plans})
    measurements = [Measurement(s, p, (truth.predict(p) * (1.25 if s is noisy else 1.0),))
                    for s, p in zip(shapes, plans)]
    held = np.zeros(len(shapes), dtype=bool)
    if model == "empirical":
        fit = CostModel(tuple(fit_cost_model(measurements, held)[0]))
    else:
        fit = PhysicalCostModel(tuple(fit_physical(measurements, held, truth.shape, truth.machine)[0]),
                                truth.shape, truth.machine)
    for n in range(1, spec.max_seqs + 1):
        assert fit.predict_decodes(n, 64 * n) == pytest.approx(truth.predict_decodes(n, 64 * n), rel=0.03), n
        if model == "empirical":
            chunk = BatchPlan.of("serial", ["a"], [n], [0], [True], 0)
            assert fit.predict(chunk) == pytest.approx(truth.predict(chunk), rel=0.03), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("onednn_runs_it", [True, False])
def test_the_machine_probes_ask_onednn_only_where_it_runs_the_dtype(dtype, onednn_runs_it, monkeypatch):
    """oneDNN's bf16 packing refuses a CPU without AVX-512 with an error (not a slow path): a bf16
    calibration there must probe without it. Played on any CPU by saying oneDNN cannot."""
    from engine.model.kernels import dispatch
    if onednn_runs_it and not dispatch.onednn_available(dtype):
        pytest.skip(f"oneDNN does not run {dtype} on this CPU (as masked)")
    if not onednn_runs_it:
        monkeypatch.setattr(dispatch, "onednn_available", lambda dtype: False)
        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                            lambda *args: pytest.fail("packed for oneDNN where it does not run"))
    machine = measure_machine(dtype, repeats=1, mem_bytes=16 << 20)
    assert machine.bandwidth_bytes_s > 0 and machine.matmul_flops_s > 0


def test_probes_on_a_gpu_time_a_run_of_calls_waited_for_once(monkeypatch):
    """A launch returns before the work is done, and a probe's call takes less than a launch and
    a wait: each timing is a run of calls between two synchronisations."""
    from engine.model import device as dev
    events = []
    monkeypatch.setattr(dev, "synchronize", lambda device: events.append(("sync", device.type)))
    best_s(lambda: events.append("call"), repeats=2, device="mps")
    timed = [("sync", "mps")] + ["call"] * GPU_CALLS + [("sync", "mps")]
    assert events == ["call"] + timed + timed  # one untimed call first


def test_the_knots_and_the_full_grid_bracket_every_step_the_gemv_may_take():
    """The gemv sweeps the weights once up to stream_rows rows and in passes past it, so a call's cost
    steps up between stream_rows and stream_rows + 1 (13% in fp32 from 16 to 17 on one CPU): for the
    fit to price the step rather than a line across it, both are knots and both are measured."""
    from engine.model.kernels import dispatch
    full = GRID_SPECS["full"]
    for n in dispatch.STREAM_ROWS + dispatch.STREAM_ROWS_AVX2:
        assert {n, n + 1} <= set(TOKEN_KNOTS) and {n, n + 1} <= set(full.decode_batches)


def test_every_grid_measures_both_sides_of_each_step_of_the_gemvs_passes():
    """Past its one-sweep rows the gemv takes the rows in passes of its register block, so a call's
    cost is flat within a pass and steps up just past each multiple of the block (8 rows with
    AVX-512, 6 with AVX2): both sides of every step are knots, and every grid times a prompt at each,
    whichever block the machine has."""
    for block in REGISTER_BLOCKS:
        for m in range(block, 65, block):
            if m > 16:
                assert {m, m + 1} <= set(TOKEN_KNOTS) & set(PASS_EDGES)
    assert 17 < min(PASS_EDGES) and max(PASS_EDGES) == 65 and 26 not in PASS_EDGES  # 26: within a pass of both
    for name, spec in GRID_SPECS.items():
        prompts = {s.chunks[0][0] for s in build_grid(spec) if s.kind == "prefill" and len(s.chunks) == 1
                   and s.chunks[0][1] == 0}
        assert set(PASS_EDGES) <= prompts, name
        # the fit pins each of those knots (calibration.fit.supported_knots)
        assert all(supported_knots(prompts, TOKEN_KNOTS)[TOKEN_KNOTS.index(n)] for n in PASS_EDGES)


def test_the_other_blocks_edge_knots_follow_their_neighbours():
    from calibration.calibrate import pinned, with_pass_edges
    from calibration.cost_model import unmeasured_edges

    free = unmeasured_edges(with_pass_edges(GRID_SPECS["full"], 8).edge_chunks)
    assert free == {18, 19, 30, 31, 36, 37, 42, 43, 54, 55, 60, 61}  # AVX2's edges that are not AVX-512's
    # 3 × 12 tokens falls on 36: supported, but left to 33 and 40 on an AVX-512 machine
    xs = [36, 33, 40, 32, 41]
    assert supported_knots(xs, TOKEN_KNOTS)[TOKEN_KNOTS.index(36)]
    kept = pinned(xs, TOKEN_KNOTS, free)
    assert not kept[TOKEN_KNOTS.index(36)] and kept[TOKEN_KNOTS.index(33)] and kept[TOKEN_KNOTS.index(40)]
    assert pinned(xs, TOKEN_KNOTS, frozenset()) == supported_knots(xs, TOKEN_KNOTS)


def test_a_calibration_times_the_edges_of_its_own_machines_passes():
    from calibration.calibrate import with_pass_edges
    from calibration.cost_model import pass_edges

    full = GRID_SPECS["full"]
    assert with_pass_edges(full, 8).edge_chunks == (24, 25, 32, 33, 40, 41, 48, 49, 56, 57, 64, 65)
    assert with_pass_edges(full, 6).edge_chunks == (18, 19, 24, 25, 30, 31, 36, 37, 42, 43, 48, 49, 54, 55, 60, 61)
    assert with_pass_edges(full, None) == full and set(pass_edges()) == set(pass_edges((6,)) + pass_edges((8,)))


@pytest.mark.parametrize("force", ["linear=gemv", "linear=onednn", "linear=torch"])
def test_the_runner_says_the_gemvs_pass_rows_only_where_its_products_run_on_it(force, monkeypatch):
    """The block a calibration times the edges of (above): the gemv's register block as the CPU is
    masked (8 rows with AVX-512, 6 with AVX2 alone); None on oneDNN or F.linear, whose blocking
    the engine does not know. Forced, so each answer is checked on this machine whatever its
    measured table picks."""
    from tests.test_model_runner import force_dispatch

    forced = force_dispatch(monkeypatch, force)
    runner = make_runner(ModelConfig(name="tiny", device="cpu"), 2, 64)
    assert set(runner._lean.choices) == {forced}
    block = 8 if "avx512" in cpu_features() else 6  # the CPU as MINISERVE_CPU_FEATURES masks it
    assert runner.pass_rows == (block if forced == "gemv" else None)


def test_a_call_timed_in_a_slow_spell_is_put_at_the_usual_bandwidth_by_its_memory_bound_share():
    """A decode (reading weights) timed while its stamp read half the usual rate took twice its
    time, and is put back; a long prefill (arithmetic) moves by its small memory share only."""
    from dataclasses import replace

    from calibration.calibrate import at_usual_bandwidth, memory_share

    shape = ModelShape(dense_params=10**8, lm_head_params=10**7, bytes_per_param=4, kv_bytes_per_token=1024,
                       attn_flops_per_pair=1000)
    machine = Machine(bandwidth_bytes_s=4e10, matmul_flops_s=4e11)
    ids = [f"r{i}" for i in range(2)]
    decode, prefill = Shape("decode", (16,)), Shape("prefill", (), ((512, 0, True),))
    ms = [Measurement(decode, decode.to_plan(ids), (0.010, 0.020, 0.010), (), (40.0, 20.0, 40.0)),
          Measurement(prefill, prefill.to_plan(ids), (0.300, 0.300, 0.300), (), (40.0, 20.0, 40.0)),
          Measurement(decode, decode.to_plan(ids), (0.012,)),  # unstamped: kept as is
          # an engine call, stamped per serving run: put at the grid's usual, never moving it
          Measurement(Shape.of_plan(decode.to_plan(ids), "engine"), decode.to_plan(ids), (0.008,) * 8, (),
                      (80.0,) * 8)]  # enough to move a median over every stamp: the usual is the grid's
    out, info = at_usual_bandwidth(ms, shape, machine)
    share = [memory_share(m.plan, shape, machine) for m in ms[:2]]
    assert share[0] > 0.95 and share[1] < 0.1
    assert out[0].times_s == pytest.approx((0.010, 0.020 * 0.5 ** share[0], 0.010))
    assert out[0].raw_times_s == (0.010, 0.020, 0.010) and out[0].spread < 0.05 < ms[0].spread
    assert out[1].times_s[1] == pytest.approx(0.300 * 0.5 ** share[1]) and out[1].times_s[1] > 0.28
    assert out[2] == ms[2]
    assert out[3].times_s == pytest.approx((0.008 * 2 ** share[0],) * 8) and out[3].raw_times_s == (0.008,) * 8
    assert info["usual_weights_gb_s"] == 40.0 and info["call_stamps"] == 6 and info["engine_calls_stamped"] == 8
    assert at_usual_bandwidth([replace(ms[0], stamps_gb_s=())], shape, machine)[1] == {}


@pytest.mark.parametrize("bad,name", [({"overhead_runs": 0}, "overhead_runs"), ({"repeats": 0}, "repeats"),
                                      ({"warmup": -1}, "warmup")])
def test_calibration_settings_that_would_fail_after_measuring_fail_before(bad, name):
    """overhead_runs=0 measured the whole grid, then crashed on an empty percentile: no profile."""
    from calibration.calibrate import CalibrationConfig

    with pytest.raises(ValueError, match=name):
        CalibrationConfig(**bad)


@pytest.mark.parametrize("bad", [{"max_retries": -1}, {"wide_spread": float("nan")}, {"memory_drift": 0.0},
                                 {"budget_s": -1.0}])
def test_robustness_settings_are_checked(bad):
    from calibration.profiler import Robustness

    with pytest.raises(ValueError, match=next(iter(bad))):
        Robustness(**bad)


def test_idle_steps_come_from_rests_only_and_none_measured_is_no_nan():
    """measure_idle_steps takes only steps that follow a rest; where a step outlasts the gap there
    is none, and the profile must then say so (the busy step's time), not carry NaN into every
    simulated step after a rest."""
    from calibration.cost_model import AfterIdle
    from calibration.profiler import measure_idle_steps
    from engine.core.config import SchedulerConfig
    from engine.llm_engine import Engine

    engine = Engine(SchedulerConfig(max_num_seqs=2), ModelConfig(name="tiny"))
    wake, before = measure_idle_steps(engine, steps=3)  # rests twice its step, at least 0.2 s
    assert len(wake) == len(before) == 3 and min(wake) >= 0 and min(before) > 0
    assert measure_idle_steps(engine, steps=3, gap_s=0.0) == ([], [])  # all at once: no rest
    unmeasured = AfterIdle.of({"step_overhead": {"idle_wake_median_s": float("nan"), "idle_before_call_median_s": None}})
    assert (unmeasured.wake_s, unmeasured.before_call_s) == (0.0, None)


def test_idle_steps_rest_longer_than_a_slow_step():
    """A step that outlasts IDLE_STEP_GAP_S (a large model in fp32) must still leave rests between
    the idle requests: the gap follows the step measured first (idle_step_gap_s)."""
    from calibration.profiler import IDLE_STEP_GAP_S, measure_idle_steps
    from engine.core.config import SchedulerConfig
    from engine.llm_engine import Engine

    engine = Engine(SchedulerConfig(max_num_seqs=2), ModelConfig(name="tiny"))
    execute = engine.runner.execute

    def slow(*args, **kwargs):
        time.sleep(1.2 * IDLE_STEP_GAP_S)
        return execute(*args, **kwargs)

    engine.runner.execute = slow
    wake, before = measure_idle_steps(engine, steps=2)
    assert len(wake) == len(before) == 2 and min(before) >= 0
