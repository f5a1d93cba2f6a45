"""The seed experiment as users run it: the Hydra app, fresh processes, seed.json and traces."""

import json
import subprocess
import sys

import pytest

SEED_KEYS = {"output_tokens", "model_calls", "prefill_calls", "decode_calls", "output_throughput_tok_s",
             "ttft_s", "e2e_s", "occupancy_at_max", "gap_s"}


def run_seed(*overrides, check=True):
    return subprocess.run([sys.executable, "-m", "experiments.seed", "model.device=cpu", *overrides],
                          capture_output=True, text=True, check=check, timeout=300)


def test_seed_app_on_tiny_model_writes_the_table_and_traces(tmp_path):
    out = run_seed("model=tiny", "model.num_threads=1", f"hydra.run.dir={tmp_path}")
    data = json.loads((tmp_path / "seed.json").read_text())
    assert list(data) == ["serial", "static", "continuous"]
    for name, row in data.items():
        assert SEED_KEYS <= set(row)
        assert row["output_tokens"] == 160
        assert {"mean", "p50", "p99"} <= set(row["ttft_s"]) and {"mean", "p50", "p99"} <= set(row["e2e_s"])
        assert (tmp_path / row["trace"]).is_file()
        assert (tmp_path / name / "metrics.json").is_file() and (tmp_path / name / "requests.csv").is_file()
    assert (data["serial"]["model_calls"], data["serial"]["prefill_calls"], data["serial"]["decode_calls"]) == (160, 16, 144)
    assert (data["static"]["model_calls"], data["static"]["prefill_calls"], data["static"]["decode_calls"]) == (32, 2, 30)
    assert data["continuous"]["model_calls"] == 28
    assert data["serial"]["occupancy_at_max"] == 0.0
    assert data["continuous"]["occupancy_at_max"] > data["static"]["occupancy_at_max"]
    assert "continuous" in out.stdout and "out tok/s" in out.stdout
    # the simulator ran the same scheduler code on the same burst: same calls and tokens
    sim = json.loads((tmp_path / "seed_sim.json").read_text())
    assert (tmp_path / "calibration" / "profile.json").is_file()
    for name in data:
        assert sim[name]["output_tokens"] == 160
        assert sim[name]["model_calls"] == data[name]["model_calls"]
        assert sim[name]["prefill_calls"] == data[name]["prefill_calls"]
        assert (tmp_path / sim[name]["trace"]).is_file()
        # each side stamped with the memory bandwidth it ran at (the real run's, the calibration's)
        assert data[name]["memory_read_gb_s"] > 0 and sim[name]["memory_read_gb_s"] > 0
        # and with the read rate of its own decode weights (where they landed in memory), where a
        # one-row decode reads plain copies (oneDNN's packed ones are opaque: None, not a guess)
        for side in (data[name], sim[name]):
            assert side["weights_read_gb_s"] is None or side["weights_read_gb_s"] > 0
        assert (data[name]["weights_read_gb_s"] is None) == (sim[name]["weights_read_gb_s"] is None)
        # and with the kernels its calls took: the same on both sides here, so no warning
        assert data[name]["kernels"] == sim[name]["kernels"] and "gemv" in data[name]["kernels"]
    assert "other kernels" not in out.stdout
    assert "real vs simulated" in out.stdout and "memory GB/s" in out.stdout and "weights GB/s" in out.stdout
    for png in ("seed_occupancy.png", "seed_active.png", "seed_latency_cdf.png"):
        assert (tmp_path / "report" / png).stat().st_size > 10_000


@pytest.mark.parametrize("override,message", [
    ("scheduler.max_num_seq=4", "max_num_seq"),
    ("scheduler.max_num_seqs=zero", "max_num_seqs"),
    ("scheduler.max_num_seqs=-2", "must be a positive integer"),
    ("model.dtype=fp8", "model.dtype must be one of"),
    ("model=nonexistent", "nonexistent"),
])
def test_bad_overrides_fail_clearly(tmp_path, override, message):
    out = run_seed("model=tiny", "simulate=false", override, f"hydra.run.dir={tmp_path}", check=False)
    assert out.returncode != 0
    assert message in out.stderr
    assert not (tmp_path / "seed.json").exists()
