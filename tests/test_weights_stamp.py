"""The stamp of a process's own decode weights: on a VM they can land in memory that reads slower
than fresh memory for the process's whole life, and only a read of them shows it."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from calibration import roofline  # noqa: E402
from calibration.cost_model import SLOW_PLACEMENT, slow_placement_warning, weights_read_gb_s  # noqa: E402
from calibration.report import weights_line  # noqa: E402
from engine.core.config import ModelConfig, SchedulerConfig  # noqa: E402
from engine.model.runner import ModelRunner  # noqa: E402
from tests.test_model_runner import force_dispatch  # noqa: E402


@pytest.mark.parametrize("choice", ["gemv", "torch", "onednn"])
def test_decode_weights_are_the_copies_a_one_row_call_reads(monkeypatch, choice):
    """gemv: every projection's panels; F.linear: its plain weight; oneDNN's packed copies are
    opaque: nothing (the stamp is then None, not a guess). Each linear forced, so each runner holds
    that candidate's layout alone and its branch runs whatever the measured table picks here."""
    force_dispatch(monkeypatch, f"linear={choice}")
    runner = ModelRunner(ModelConfig(name="tiny", num_threads=1, device="cpu"), SchedulerConfig(max_num_seqs=2))
    lean = runner._lean
    assert set(lean.choices) == {choice}
    got = [w.data_ptr() for w in runner.decode_weights()]
    if choice == "gemv":
        assert got == [p.panels.data.data_ptr() for p in lean.projections]
    elif choice == "torch":
        assert got == [p.plain.data_ptr() for p in lean.projections]
    else:
        assert got == [] and all(p.packed is not None for p in lean.projections)


def test_generic_runner_stamps_its_linears_and_a_gpu_nothing(monkeypatch):
    generic = ModelRunner(ModelConfig(name="tiny", num_threads=1, device="cpu"), SchedulerConfig(max_num_seqs=2),
                          generic=True)
    linears = [m.weight for m in generic.model.modules() if isinstance(m, torch.nn.Linear)]
    assert [w.data_ptr() for w in generic.decode_weights()] == [w.data_ptr() for w in linears]
    monkeypatch.setattr(generic, "device", torch.device("cuda"))
    assert generic.decode_weights() == []


def test_a_sample_past_max_bytes_is_the_same_share_of_every_tensor(monkeypatch):
    """Past max_bytes the leading share of every tensor is read (here half of each, unequal sizes):
    the rate is over the bytes read."""
    seen = []
    monkeypatch.setattr(roofline, "best_s", lambda fn, repeats, device: (seen.append(fn()), 1.0)[1])
    tensors = [torch.ones(n) for n in (1 << 16, 1 << 18, 3 << 16)]
    assert roofline.tensors_read_gb_s(tensors, max_bytes=(8 << 18) // 2) == pytest.approx((8 << 18) / 2 / 1e9)
    assert [float(x) for x in seen[-1]] == [1 << 15, 1 << 17, 3 << 15]  # each tensor's first half summed
    assert roofline.tensors_read_gb_s(tensors, max_bytes=1 << 30) == pytest.approx((8 << 18) / 1e9)
    assert roofline.tensors_read_gb_s([]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_stamp_reads_the_weights_it_is_given(dtype):
    weights = [torch.ones(1 << 16, dtype=dtype), torch.ones(1 << 17, dtype=dtype)]
    with roofline.MemoryStamp("cpu", weights) as stamp:
        pass
    assert stamp.gb_s > 0 and stamp.weights_gb_s > 0 and roofline.fresh_like_gb_s(weights) > 0
    with roofline.MemoryStamp("cpu", []) as plain:
        pass
    assert plain.weights_gb_s is None and roofline.fresh_like_gb_s([]) is None


def _info(fresh: float, weights: float | None) -> dict:
    return {"memory_read_gb_s": {"before": 99.0, "after": 99.0},
            "weights_read_gb_s": {"before": weights, "after": weights, "fresh": fresh}}


def test_report_warns_where_the_weights_read_slow():
    """Judged against a fresh buffer of their dtype read the same way, not the fp32 stamp (99 here)."""
    assert weights_read_gb_s(_info(20.0, 18.0)) == 18.0
    assert weights_read_gb_s({}) is None and weights_read_gb_s(_info(20.0, None)) is None
    assert "slower than fresh memory" not in weights_line(_info(20.0, 20.0 * SLOW_PLACEMENT + 0.1))
    slow = weights_line(_info(20.0, 14.0))
    assert "30% slower than fresh memory" in slow and "calibrate again" in slow
    assert "not stamped" in weights_line(_info(20.0, None))
    unjudged = weights_line(_info(None, 14.0))  # stamped before the like-for-like buffer: no judgement
    assert "14.0 GB/s" in unjudged and "slower" not in unjudged


def test_a_profile_whose_weights_read_slow_is_warned_about_where_it_is_loaded(tmp_path, caplog):
    """simulate, validate and seed load profiles through sim.run.load_cost_model: a profile whose own
    process had its weights in slow memory is said to be slow before any run is spent on it (this
    session's first calibration read 29.4 GB/s against 54.5 and every real run was flagged)."""
    import json
    import logging
    from dataclasses import replace

    from calibration.cost_model import FEATURES
    from engine.model.loader import config_fingerprint
    from sim.run import load_cost_model

    assert slow_placement_warning(_info(20.0, 20.0 * SLOW_PLACEMENT + 0.1)) is None
    assert slow_placement_warning(_info(None, 14.0)) is None and slow_placement_warning({}) is None
    assert "30% slower" in slow_placement_warning(_info(20.0, 14.0))

    model = ModelConfig(name="tiny", dtype="float32", device="cpu")
    profile = tmp_path / "profile.json"
    base = {"feature_names": list(FEATURES), "coefficients": [0.0] * len(FEATURES),
            "fingerprint": config_fingerprint(replace(model, dtype="float32")),
            "model": {"name": "tiny", "dtype": "float32"}}
    profile.write_text(json.dumps(base | _info(54.5, 29.4)))
    with caplog.at_level(logging.WARNING, logger="miniserve.sim"):
        cost = load_cost_model(str(profile), model)
    assert "46% slower" in cost.info["placement_warning"] and cost.info["placement_warning"] in caplog.text
    assert "calibrate again" in cost.info["placement_warning"]
    profile.write_text(json.dumps(base | _info(35.1, 50.5)))  # read faster than the fresh buffer: no warning
    assert "placement_warning" not in load_cost_model(str(profile), model).info


def test_placement_is_judged_by_reads_back_to_back_where_the_profile_has_them():
    """The weights' stamp spans the whole calibration, the fresh buffer is read at its end: the
    paired ratio, where a profile has it, decides either way; the report line shows it."""
    slow_by_stamps = _info(20.0, 14.0)
    slow_by_stamps["weights_read_gb_s"]["placement"] = 0.97  # the host moved between stamps and buffer
    assert slow_placement_warning(slow_by_stamps) is None
    assert "0.97x of it, read back to back" in weights_line(slow_by_stamps)
    assert "slower" not in weights_line(slow_by_stamps)
    fine_by_stamps = _info(35.1, 50.5)
    fine_by_stamps["weights_read_gb_s"]["placement"] = 0.6
    assert "40% slower" in slow_placement_warning(fine_by_stamps)
    assert "40% slower than fresh memory" in weights_line(fine_by_stamps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_placement_ratio_reads_the_weights_beside_a_fresh_buffer(dtype):
    weights = [torch.ones(1 << 20, dtype=dtype), torch.ones(1 << 19, dtype=dtype)]
    ratio, fresh = roofline.placement_ratio(weights, pairs=2)
    assert ratio > 0 and fresh > 0
    assert roofline.placement_ratio([]) is None


def test_validate_rows_carry_the_runs_weights_stamp():
    """validation.csv: the counted runs' median weights stamp beside the calibration's; runs saved
    before the stamp existed give NaN, not an error."""
    from engine.observe.workload import WorkloadConfig
    from experiments.validate import Row, compare_row

    row = Row("seed_burst", SchedulerConfig(max_num_seqs=4), WorkloadConfig(num_requests=4))
    metrics = {"output_throughput_tok_s": 10.0, "ttft_s": {"p50": 1.0, "p99": 2.0}, "tpot_s": {"p50": 0.1, "p99": 0.2},
               "e2el_s": {"p50": 3.0, "p99": 4.0}, "model_calls": 8, "occupancy_at_max": 0.5}
    runs = [{"repeat": k, "attempt": 0, "contended": False, "memory_gb_s": 20.0, "calls_gb_s": None,
             "weights_gb_s": w, "metrics": metrics} for k, w in enumerate((15.0, 19.0, 18.0))]
    tol = {"throughput": 0.05, "p50": 0.05, "p99": 0.1, "calls": 0.0, "occupancy": 0.05}
    recs = compare_row(row, runs, metrics, [], tol, 20.0, calibration_weights_gb_s=21.0)
    assert {r["weights_gb_s"] for r in recs} == {18.0} and {r["calibration_weights_gb_s"] for r in recs} == {21.0}
    # the calls' own noise: the median of its replicates, judged by the same rule as the simulation
    slow = {**metrics, "tpot_s": {"p50": 0.1, "p99": 0.3}}
    noisy = {r["metric"]: r for r in compare_row(row, runs, metrics, [], tol, 20.0, calls_noise_m=[metrics, slow, slow])}
    assert noisy["tpot_p99"]["sim_calls_noise"] == 0.3 and not noisy["tpot_p99"]["ok_calls_noise"]
    assert noisy["tpot_p50"]["ok_calls_noise"] and "sim_calls_noise" not in recs[0]
    old = [{k: v for k, v in r.items() if k != "weights_gb_s"} for r in runs]
    assert all(math.isnan(r["weights_gb_s"]) for r in compare_row(row, old, metrics, [], tol, 20.0))


def test_a_transfer_across_dtypes_has_no_weights_stamp_to_judge_runs_by():
    from types import SimpleNamespace

    from experiments.validate import calibration_weights_gb_s, placed_gb_s

    stamped = {"weights_read_gb_s": {"before": 20.0, "after": 22.0}}
    own = SimpleNamespace(info=stamped, memory_read_gb_s=30.0)
    same = SimpleNamespace(info={**stamped, "transfer": {"from_dtype": "bfloat16", "to_dtype": "bfloat16"}},
                           memory_read_gb_s=30.0)
    other = SimpleNamespace(info={**stamped, "transfer": {"from_dtype": "float32", "to_dtype": "bfloat16"}},
                            memory_read_gb_s=30.0)
    assert calibration_weights_gb_s(own) == calibration_weights_gb_s(same) == pytest.approx(21.0)
    assert calibration_weights_gb_s(other) is None  # a bf16 sum reads slower than an fp32 one
    run = {"weights_gb_s": 23.1}
    assert placed_gb_s(same, run) == pytest.approx(30.0 * 23.1 / 21.0) and placed_gb_s(other, run) is None
