"""The physical cost model: bytes and FLOPs from a config, transfer to other shapes, what-if hardware."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from calibration.cost_model import ProfileMismatchError
from calibration.physical import (PHYSICAL_FEATURES, ROW_KNOTS, Machine, PhysicalCostModel, PhysicalShape, WhatIf,
                                  at_run_bandwidth, hats, physical_features)
from engine.core.config import ModelConfig
from engine.core.model_shape import config_fingerprint, model_shape
from engine.core.plan import BatchPlan
from experiments.simulate import run_app
from sim.executors import cost_model_from
from sim.run import load_cost_model
from tests.test_sim_app import composed

TINY = ModelConfig(name="tiny")
Q05 = ModelConfig(name="qwen2_5_0_5b", dtype="bfloat16")
UNIT = Machine(memory_gb_s=1.0, matmul_gflops=1.0)  # roofline seconds are bytes or FLOPs × 1e-9
IDX = {name: i for i, name in enumerate(PHYSICAL_FEATURES)}


def test_tiny_shape_by_hand():
    # tiny: hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads of 16, vocab 512, qwen2 (qkv bias)
    s = PhysicalShape.of(model_shape(TINY), "float32")
    per_layer = (64 * 64 * 2 + 64 * 32 * 2 + (64 + 32 + 32)) + 3 * 64 * 128 + 2 * 64
    assert s.dense_params == 2 * per_layer + 64 == 74304
    assert s.lm_head_params == 512 * 64
    assert s.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 == 512
    assert s.attn_flops_per_pair == 4 * 2 * 4 * 16 == 512
    q3 = PhysicalShape.of(model_shape(ModelConfig(name="qwen3_0_6b")), "bfloat16")
    assert q3.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2 and q3.bytes_per_param == 2
    # Qwen3-0.6B: 0.44 B non-embedding parameters, Qwen2.5-1.5B: 1.31 B (their model cards)
    assert 0.43e9 < q3.dense_params < 0.45e9
    assert 1.30e9 < PhysicalShape.of(model_shape(ModelConfig(name="qwen2_5_1_5b")), "bfloat16").dense_params < 1.32e9


def test_features_of_a_mixed_plan_match_hand_computed_bytes_and_flops():
    s = PhysicalShape.of(model_shape(TINY), "float32")
    # two decodes at contexts 10 and 20, a 5-token chunk after 3 (sampled), a 4-token chunk from 0 (not)
    plan = BatchPlan.of("t", ["a", "b", "c", "d"], (1, 1, 5, 4), (10, 20, 3, 0), (True, True, True, False), 2)
    row = physical_features(plan, s, UNIT)
    tokens = 11
    dense = max(74304 * 4, 2 * 74304 * tokens) * 1e-9  # compute-bound at 11 rows (2·11 > 4 bytes)
    w = (tokens - 10) / (12 - 10)  # between knots 10 and 12
    assert row[IDX["rows@10"]] == pytest.approx(dense * (1 - w))
    assert row[IDX["rows@12"]] == pytest.approx(dense * w)
    lm = max(32768 * 4, 2 * 32768 * 3) * 1e-9  # the lm_head over 3 sampled rows, on the same curve
    assert row[IDX["rows@3"]] == pytest.approx(lm)
    assert row[IDX["layer"]] == 2 and row[IDX["request_layer"]] == 4 * 2
    assert row[IDX["decode_attention"]] == pytest.approx((11 + 21) * 512 * 1e-9)  # bytes = FLOPs per pair here
    prefill = max(8 * 512, 5 * (3 + 3) * 512) + max(4 * 512, 4 * 2.5 * 512)
    assert row[IDX["prefill_attention"]] == pytest.approx(prefill * 1e-9)
    assert sum(row[IDX[f"rows@{k}"]] for k in ROW_KNOTS) \
        == pytest.approx(dense + lm)


def test_hats_are_a_partition_of_unity_constant_outside():
    knots = (1, 2, 4, 8)
    for x in (1, 1.5, 3, 7, 8, 100):
        assert sum(w for _, w in hats(x, knots)) == pytest.approx(1.0)
    assert hats(100, knots) == [(3, 1.0)] and hats(3, knots) == [(1, 0.5), (2, 0.5)]


def physical_model(shape=None, machine=Machine(40.0, 400.0)) -> PhysicalCostModel:
    coef = [0.0] * len(PHYSICAL_FEATURES)
    coef[IDX["layer"]], coef[IDX["request_layer"]] = 1e-4, 2e-5
    for k in PHYSICAL_FEATURES[2:]:  # every term at 1.5× its roofline
        coef[IDX[k]] = 1.5
    return PhysicalCostModel(tuple(coef), shape or PhysicalShape.of(model_shape(Q05), "bfloat16"), machine, 1e-3)


def general(cost: PhysicalCostModel, plan: BatchPlan) -> float:
    """A call's seconds as the fit defines them: coefficients times the plan's feature row."""
    return sum(c * x for c, x in zip(cost.coefficients, physical_features(plan, cost.shape, cost.machine)))


def test_decodes_are_linear_in_context_and_match_predict():
    """predict takes a shortcut for decodes-only calls (decode_cost_terms, cached per count): it
    must give what the feature row gives, as a mixed call's does."""
    cost = physical_model()
    plan = BatchPlan.of("t", ["a", "b", "c"], (1, 1, 1), (5, 50, 500), (True,) * 3, 3)
    assert cost.predict(plan) == pytest.approx(general(cost, plan))
    longer = BatchPlan.of("t", ["a", "b", "c"], (1, 1, 1), (5, 50, 1500), (True,) * 3, 3)
    fixed, per = cost.decode_cost_terms(3)
    assert per > 0 and general(cost, longer) - general(cost, plan) == pytest.approx(per * 1000)
    assert cost.predict(longer) == pytest.approx(general(cost, longer))
    assert fixed + per * 1555 == pytest.approx(general(cost, longer))
    mixed = BatchPlan.of("t", ["a", "b"], (1, 7), (5, 0), (True, True), 1)
    assert cost.predict(mixed) == pytest.approx(general(cost, mixed))


def test_what_if_bandwidth_scales_memory_bound_calls_only():
    cost = physical_model()
    fast = cost.with_machine(memory_gb_s=80.0)
    decode = BatchPlan.of("t", ["a"], (1,), (10,), (True,), 1)  # one row: reads every weight, memory-bound
    prefill = BatchPlan.of("t", ["a"], (256,), (0,), (True,), 0)  # 256 rows: compute-bound
    overhead = cost.coefficients[IDX["layer"]] * 24 + cost.coefficients[IDX["request_layer"]] * 24
    assert fast.predict(decode) - overhead == pytest.approx((cost.predict(decode) - overhead) / 2, rel=1e-3)
    lm_and_attention = cost.predict(prefill) - cost.coefficients[IDX["rows@256"]] * dense_s(cost, 256)
    assert fast.predict(prefill) == pytest.approx(cost.predict(prefill), rel=0.05)  # only the one-row lm_head moves
    assert lm_and_attention < 0.05 * cost.predict(prefill)
    slow_flops = cost.with_machine(matmul_gflops=200.0)
    assert slow_flops.predict(decode) == pytest.approx(cost.predict(decode), rel=1e-3)  # only its attention
    assert slow_flops.predict(prefill) > 1.9 * cost.predict(prefill) - 2 * overhead
    assert fast.info["what_if"] == {"memory_gb_s": 80.0, "matmul_gflops": 400.0}
    assert at_run_bandwidth(cost, 20.0).machine.memory_gb_s == 20.0
    empirical = cost_model_from(const=1e-3)
    assert at_run_bandwidth(empirical, 20.0) is empirical


def dense_s(cost: PhysicalCostModel, rows: int) -> float:
    from calibration.physical import dense_roofline_s

    return dense_roofline_s(rows, cost.shape, cost.machine)


def save_profile(path, fingerprint_of: ModelConfig, physical: bool = True, preferred: str = "empirical") -> str:
    data = cost_model_from(step_overhead_s=1e-3, fingerprint=config_fingerprint(fingerprint_of), const=0.05,
                           decode_tokens=1e-3).to_dict()
    data["model"] = {"name": fingerprint_of.name, "dtype": fingerprint_of.dtype}
    if physical:
        data["physical"] = physical_model(PhysicalShape.of(model_shape(fingerprint_of), fingerprint_of.dtype)).to_dict()
        data["preferred"] = preferred
    path.write_text(json.dumps(data))
    return str(path)


def test_a_physical_profile_transfers_to_another_shape_and_says_so(tmp_path, caplog):
    profile = save_profile(tmp_path / "p.json", Q05)
    same = load_cost_model(profile, Q05)
    assert type(same).__name__ == "CostModel"  # preferred: empirical on its own model
    assert isinstance(load_cost_model(save_profile(tmp_path / "q.json", Q05, preferred="physical"), Q05),
                      PhysicalCostModel)
    big = ModelConfig(name="qwen2_5_1_5b", dtype="bfloat16")
    with caplog.at_level("WARNING"):
        cost = load_cost_model(profile, big)
    assert isinstance(cost, PhysicalCostModel) and "transferring" in caplog.text
    assert cost.shape == PhysicalShape.of(model_shape(big), "bfloat16")
    assert cost.info["transfer"]["from_model"] == "qwen2_5_0_5b"
    assert cost.fingerprint == config_fingerprint(big)
    one = BatchPlan.of("t", ["a"], (1,), (10,), (True,), 1)
    source = PhysicalCostModel.from_profile(json.loads((tmp_path / "p.json").read_text()))
    assert cost.predict(one) > 2.5 * source.predict(one)  # ~3.6× the weights to read
    # through the app: metrics.json says it was transferred
    out = tmp_path / "run"
    run_app(composed("model=qwen2_5_1_5b", "model.dtype=bfloat16", f"calibration.profile={profile}",
                     "workload.num_requests=4"), out)
    about = json.loads((out / "metrics.json").read_text())["cost_model"]
    assert about["kind"] == "physical" and about["transfer"] is True and "transferring" in about["note"]
    assert about["transfer_from"]["from_model"] == "qwen2_5_0_5b"
    assert "same_code_path" not in about["transfer_from"]
    # a Qwen3 shape runs the same lean layers and kernels: a transfer like any other
    qwen3 = load_cost_model(profile, ModelConfig(name="qwen3_0_6b", dtype="bfloat16"))
    assert "same_code_path" not in qwen3.info["transfer"] and "transferring" in qwen3.info["cost_model_note"]


def test_the_physical_model_charges_prefix_copies_by_kv_bytes_and_bandwidth(tmp_path):
    """A profile's measured copy cost is charged as the empirical model does on its own model,
    and moves with the KV bytes per token of another shape and with a what-if bandwidth."""
    data = json.loads(Path(save_profile(tmp_path / "p.json", Q05)).read_text())
    data["kv_copy_s_per_token"] = 2e-7
    own = PhysicalCostModel.from_profile(data)
    plan = BatchPlan.of("t", ["a"], (32,), (0,), (True,), 0)
    copied = BatchPlan.of("t", ["a"], (32,), (0,), (True,), 0)
    copied.kv_copy_tokens = 64
    assert own.kv_copy_s_per_token == pytest.approx(2e-7)
    assert own.predict(copied) - own.predict(plan) == pytest.approx(64 * 2e-7)
    q3 = own.for_model(PhysicalShape.of(model_shape(ModelConfig(name="qwen3_0_6b")), "bfloat16"), None, {})
    ratio = q3.shape.kv_bytes_per_token / own.shape.kv_bytes_per_token  # 114688 / 12288 bytes
    assert q3.kv_copy_s_per_token == pytest.approx(2e-7 * ratio)
    faster = own.with_machine(memory_gb_s=2 * own.machine.memory_gb_s)
    assert faster.kv_copy_s_per_token == pytest.approx(1e-7)
    data.pop("kv_copy_s_per_token")  # a profile from before copies were measured charges nothing
    assert PhysicalCostModel.from_profile(data).predict(copied) == PhysicalCostModel.from_profile(data).predict(plan)


def test_an_empirical_profile_of_another_model_is_still_refused(tmp_path):
    profile = save_profile(tmp_path / "p.json", Q05, physical=False)
    with pytest.raises(ProfileMismatchError, match="calibrate this model"):
        load_cost_model(profile, ModelConfig(name="qwen3_0_6b", dtype="bfloat16"))
    with pytest.raises(ProfileMismatchError, match="no physical cost model"):
        load_cost_model(profile, Q05, what_if=WhatIf(memory_gb_s=60.0))


def test_what_if_through_the_app(tmp_path):
    profile = save_profile(tmp_path / "p.json", Q05)
    base, slow = tmp_path / "base", tmp_path / "slow"
    args = ("model=qwen2_5_0_5b", "model.dtype=bfloat16", f"calibration.profile={profile}", "workload.num_requests=4")
    run_app(composed(*args, "calibration.what_if.memory_gb_s=40"), base)
    run_app(composed(*args, "calibration.what_if.memory_gb_s=20"), slow)
    b, s = (json.loads((d / "metrics.json").read_text()) for d in (base, slow))
    assert s["cost_model"]["what_if"]["memory_gb_s"] == 20
    # decodes are memory-bound and slow down 2×; the 48-token prefill is compute-bound and does not
    assert 0.55 * b["output_throughput_tok_s"] < s["output_throughput_tok_s"] < 0.8 * b["output_throughput_tok_s"]
    with pytest.raises(ValueError, match="positive"):
        WhatIf(memory_gb_s=0)


def test_a_config_only_local_model_builds_seeded_random_weights(tmp_path):
    torch = pytest.importorskip("torch")
    from engine.core.model_shape import CONFIG_DIR
    from engine.model.loader import has_weights, load_model

    (tmp_path / "config.json").write_text((CONFIG_DIR / "tiny.json").read_text())
    assert not has_weights(str(tmp_path))
    local = ModelConfig(name="local", path=str(tmp_path), dtype="float32", device="cpu")
    model, tokenizer = load_model(local)
    bundled, _ = load_model(replace(local, name="tiny", path=None))
    assert tokenizer is not None and model.config.num_hidden_layers == 2
    for a, b in zip(model.parameters(), bundled.parameters()):
        assert torch.equal(a, b)  # the same seed, the same shape: the same weights as the bundled tiny
    assert config_fingerprint(local) == config_fingerprint(TINY)


def test_validate_prices_a_row_at_its_real_runs_bandwidth():
    """use_run_bandwidth: the simulated row is timed at the bandwidth stamped around the real run,
    not the calibration's (here an absurd 0.001 GB/s that would make every call take seconds)."""
    pytest.importorskip("torch")
    from engine.core.config import SchedulerConfig
    from engine.llm_engine import Engine
    from engine.observe.workload import WorkloadConfig
    from experiments.validate import Contention, Row, Stamps, real_run, row_cost, simulate_row

    tiny = ModelConfig(name="tiny", num_threads=1, device="cpu")
    shape = PhysicalShape.of(model_shape(tiny), "float32")
    cost = replace(physical_model(shape, Machine(memory_gb_s=0.001, matmul_gflops=1.0)), step_overhead_s=0.0)
    scheduler = SchedulerConfig(max_num_seqs=4)
    engine = Engine(scheduler, tiny)
    row = Row("seed_burst", scheduler, WorkloadConfig(num_requests=4))
    run = real_run(engine, row, Stamps(float("nan")), Contention()) | {"repeat": 0, "attempt": 0}
    at_calibration, _ = simulate_row(row_cost(cost, [run], False), row, run["replay"], 0, 0)
    at_run, _ = simulate_row(row_cost(cost, [run], True), row, run["replay"], 0, 0)
    assert at_calibration["output_throughput_tok_s"] < 0.1 * at_run["output_throughput_tok_s"]
    assert run["memory_gb_s"] > 1


def test_validate_prices_a_row_at_the_bandwidth_its_runs_calls_saw():
    """use_run_bandwidth takes each run's calls' bandwidth (calls_gb_s) over the probe's stamp (a
    0.1 s probe around the run misses spells inside it), the stamp where no bandwidth fit the
    calls, and the median over the row's counted runs (a flagged attempt that was re-run is out)."""
    from experiments.validate import row_cost

    tiny = ModelConfig(name="tiny", num_threads=1, device="cpu")
    cost = physical_model(PhysicalShape.of(model_shape(tiny), "float32"), Machine(30.0, 100.0))
    runs = [{"repeat": 0, "attempt": 0, "memory_gb_s": 50.0, "calls_gb_s": 10.0},  # re-run below: not counted
            {"repeat": 0, "attempt": 1, "memory_gb_s": 50.0, "calls_gb_s": 21.0},
            {"repeat": 1, "attempt": 0, "memory_gb_s": 50.0, "calls_gb_s": 22.0},
            {"repeat": 2, "attempt": 0, "memory_gb_s": 24.0, "calls_gb_s": None}]
    assert row_cost(cost, runs, True).machine.memory_gb_s == 22.0
    assert row_cost(cost, runs, False) is cost


def test_validate_places_a_run_by_its_weights_stamp_over_the_calibrations():
    """run_bandwidth=weights: a run's bandwidth is the calibration's scaled by its decode weights'
    read rate over the calibration's (independent of its calls), before the calls' bandwidth;
    where either side has no weights stamp (older profiles and runs) the calls' as before;
    run_bandwidth=calls ignores the weights' stamps."""
    from experiments.validate import ValidateApp, placed_gb_s, row_cost

    tiny = ModelConfig(name="tiny", num_threads=1, device="cpu")
    cost = physical_model(PhysicalShape.of(model_shape(tiny), "float32"), Machine(30.0, 100.0))
    cost = replace(cost, info={**cost.info, "weights_read_gb_s": {"before": 19.0, "after": 21.0}})
    run = {"repeat": 0, "attempt": 0, "memory_gb_s": 50.0, "calls_gb_s": 10.0, "weights_gb_s": 24.0}
    assert placed_gb_s(cost, run) == pytest.approx(30.0 * 24.0 / 20.0)
    assert placed_gb_s(cost, {k: v for k, v in run.items() if k != "weights_gb_s"}) is None
    assert placed_gb_s(physical_model(PhysicalShape.of(model_shape(tiny), "float32"), Machine(30.0, 100.0)),
                       run) is None  # a profile from before the weights stamp
    placed = {**run, "placed_gb_s": placed_gb_s(cost, run)}
    assert row_cost(cost, [placed], True, "weights").machine.memory_gb_s == pytest.approx(36.0)
    assert row_cost(cost, [placed], True, "calls").machine.memory_gb_s == 10.0  # run_bandwidth=calls
    assert row_cost(cost, [{**run, "placed_gb_s": None}], True, "weights").machine.memory_gb_s == 10.0  # no stamp
    with pytest.raises(ValueError, match="run_bandwidth must be one of weights, calls, machine"):
        ValidateApp(run_bandwidth="stamps")
