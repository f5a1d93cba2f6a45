"""``python -m experiments.simulate``: the files real runs write, and clear errors for bad configs."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from calibration.cost_model import ProfileMismatchError
from engine.core.config import ModelConfig
from engine.observe.metrics import REQUEST_COLUMNS, summarize
from engine.core.model_shape import config_fingerprint
from engine.observe.trace import summarize_trace
from experiments.schema import to_object
from experiments.simulate import SimulateApp, run_app
from sim.run import MissingProfileError
from sim.executors import cost_model_from
from tests.test_results import check_vllm_keys

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def tiny_profile(path: Path) -> str:
    cost_model_from(step_overhead_s=2e-4, fingerprint=config_fingerprint(ModelConfig(name="tiny")), const=2e-3,
                    prefill_tokens=1e-5, decode_tokens=1e-4, decode_context=1e-7).save(path)
    return str(path)


def composed(*overrides: str) -> SimulateApp:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return to_object(compose(config_name="simulate", overrides=list(overrides)))


def test_app_writes_the_real_runs_files(tmp_path):
    profile = tiny_profile(tmp_path / "profile.json")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "experiments.simulate", "model=tiny", f"calibration.profile={profile}",
                           "workload=gamma", "workload.num_requests=40", "workload.rate=20", "replicas=2",
                           "router=least_outstanding", "goodput=ttft:100 tpot:5", f"hydra.run.dir={out}"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics.keys() == summarize([]).keys() and metrics["completed"] == 40
    results = json.loads((out / "results.json").read_text())
    check_vllm_keys(results)
    assert results["completed"] == 40 and results["request_rate"] == 20.0 and results["burstiness"] == 0.25
    assert results["request_goodput"] == pytest.approx(metrics["goodput_req_s"]) and results["goodput"] == "ttft:100 tpot:5"
    assert results["p99_ttft_ms"] == pytest.approx(1e3 * metrics["ttft_s"]["p99"])
    with open(out / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == REQUEST_COLUMNS and len(rows) == 40
    calls = sum(summarize_trace(out / f"trace_replica{i}.json", 8).model_calls for i in range(2))
    info = json.loads((out / "sim.json").read_text())
    assert calls == info["num_steps"] > 0
    for i in range(2):  # sim.json's summaries, from the calls as written: what the files read back say
        name = f"trace_replica{i}.json"
        from_file, written = summarize_trace(out / name, 8).to_dict(), info["traces"][name]
        assert from_file["calls_by_label"] == written["calls_by_label"] and written["model_calls"] > 0
        for key in ("busy_s", "span_s", "gap_s", "occupancy_at_max"):
            assert written[key] == pytest.approx(from_file[key], rel=1e-9, abs=1e-9)
    with open(out / "timeseries.csv") as f:
        assert len(list(csv.DictReader(f))) == calls


def test_missing_profile_fails_with_a_clear_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.simulate", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0
    assert "no calibration profile" in proc.stderr and "experiments.calibrate" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "metrics.json").exists()


def test_profile_for_another_model_is_refused(tmp_path):
    app = composed("model=qwen2_5_0_5b", f"calibration.profile={tiny_profile(tmp_path / 'p.json')}")
    with pytest.raises(ProfileMismatchError, match="calibrate this model"):
        run_app(app, tmp_path / "out")
    with pytest.raises(MissingProfileError, match="does not exist"):
        run_app(composed("calibration.profile=/nonexistent/profile.json"), tmp_path / "out")
    assert not (tmp_path / "out" / "metrics.json").exists()


@pytest.mark.parametrize("override,message", [
    ("replica=2", "replica"),
    ("workload.rat=3", "rat"),
    ("scheduler.max_num_seqs=many", "max_num_seqs"),
    ("workload=nonexistent", "nonexistent"),
])
def test_typos_fail_at_compose_time(override, message):
    with pytest.raises(ConfigCompositionException, match=message):
        composed(override)


def test_bad_values_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="router must be one of"):
        run_app(composed("router=random", f"calibration.profile={tiny_profile(tmp_path / 'p.json')}", "model=tiny"),
                tmp_path / "out")
    with pytest.raises(Exception, match="workload.concurrency must be >= 1"):
        composed("workload=closed_loop", "workload.concurrency=0")
    with pytest.raises(Exception, match=r"bands.replicates must be an integer >= 0 \(0: none\), got -3"):
        composed("bands.replicates=-3")  # had run no replicates, silently
    with pytest.raises(Exception, match="bands.calls_noise must be an integer >= 0"):
        composed("bands.calls_noise=-1")
    with pytest.raises(Exception, match="must be finite and > 0"):
        composed("workload.rate=inf")  # had been a burst at t = 0, with Infinity in results.json


@pytest.mark.parametrize("workload", ["seed_burst", "poisson", "gamma", "closed_loop", "trace"])
def test_every_workload_config_composes(workload):
    extra = ["workload.path=x.csv"] if workload == "trace" else []
    app = composed(f"workload={workload}", *extra)
    assert app.workload.arrival in ("burst", "poisson", "gamma", "closed_loop", "trace")


def test_capacity_search_from_the_app(tmp_path):
    app = composed("model=tiny", f"calibration.profile={tiny_profile(tmp_path / 'p.json')}",
                   "workload.num_requests=150", "scheduler.max_num_seqs=8", "capacity.enabled=true",
                   "capacity.low=1", "capacity.high=400", "capacity.slo_ttft_p99_s=0.05", "capacity.rel_tol=0.05",
                   "trace=false", "timeseries=false")
    metrics = run_app(app, tmp_path / "out")
    found = json.loads((tmp_path / "out" / "capacity.json").read_text())
    assert found["max_rate_req_s"] == metrics["capacity_req_s"]
    assert 1 < found["max_rate_req_s"] < 400
    ok = [p for p in found["probes"] if p["ok"]]
    assert all(p["ttft_p99_s"] <= 0.05 for p in ok) and max(p["rate"] for p in ok) == found["max_rate_req_s"]
    assert not (tmp_path / "out" / "trace.json").exists()


def test_bands_from_the_profiles_noise_land_in_metrics_json(tmp_path):
    path = Path(tiny_profile(tmp_path / "profile.json"))
    data = json.loads(path.read_text())
    data["noise"] = {"round_log": [-0.1, 0.0, 0.1], "call_log": [-0.05, 0.0, 0.05]}
    path.write_text(json.dumps(data))
    args = ["model=tiny", f"calibration.profile={path}", "workload.num_requests=30", "workload.rate=50",
            "bands.replicates=8", "goodput=ttft:100 tpot:5 e2el:900"]
    metrics = run_app(composed(*args), tmp_path / "a")
    again = run_app(composed(*args), tmp_path / "b")
    bands = metrics["bands"]
    assert bands["replicates"] == 8 and bands == again["bands"]  # seeded: the same bands again
    assert bands["drawn_from"] == "round factor from 3 calibration rounds"  # no history in this profile
    for name in ("output_throughput", "ttft_p50", "tpot_p99", "e2e_p99"):
        assert bands[name]["p5"] <= bands[name]["p50"] <= bands[name]["p95"]
    assert bands["e2e_p50"]["p95"] > bands["e2e_p50"]["p5"]  # the noise moves the metric
    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["bands"] == bands
    del data["noise"]  # a profile from before the noise was kept: refused, not a zero-width band
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no measured noise"):
        run_app(composed(*args), tmp_path / "c")


def test_the_calls_own_noise_lifts_a_tail_off_its_median(tmp_path):
    """bands.calls_noise=N: the median of N runs with the profile's call residuals only (correlated
    call to call, no run-wide draw) lands in metrics.json; a deterministic run's TPOT p99 sits
    near its p50, the noisy runs' does not."""
    path = Path(tiny_profile(tmp_path / "profile.json"))
    data = json.loads(path.read_text())
    data["noise"] = {"round_log": [0.5], "call_log": [-0.3, -0.1, 0.0, 0.1, 0.3], "call_lag1": 0.8}
    path.write_text(json.dumps(data))
    args = ["model=tiny", f"calibration.profile={path}", "workload.num_requests=40", "workload.rate=50",
            "bands.calls_noise=6"]
    metrics = run_app(composed(*args), tmp_path / "a")
    noisy = metrics["calls_noise"]
    assert noisy["replicates"] == 6 and noisy == run_app(composed(*args), tmp_path / "b")["calls_noise"]  # seeded
    assert "bands" not in metrics  # no run-wide draw asked for: the round factor (+65%) is never drawn
    plain_spread = metrics["tpot_s"]["p99"] / metrics["tpot_s"]["p50"]
    assert noisy["tpot_p99"] / noisy["tpot_p50"] > plain_spread
    assert 0.7 < noisy["output_throughput"] / metrics["output_throughput_tok_s"] < 1.3
    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["calls_noise"] == noisy


@pytest.mark.parametrize("damage,why", [
    (lambda text: text[:40], "JSONDecodeError"),  # truncated
    (lambda text: "[1, 2]", "AttributeError"),  # JSON, not a profile
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "coefficients"}), "KeyError"),
])
def test_a_damaged_profile_is_named_not_a_traceback(tmp_path, damage, why):
    (tmp_path / "p.json").write_text(damage(Path(tiny_profile(tmp_path / "good.json")).read_text()))
    with pytest.raises(ProfileMismatchError, match=f"p.json is not a calibration profile.*{why}"):
        run_app(composed("model=tiny", f"calibration.profile={tmp_path / 'p.json'}"), tmp_path / "out")


def test_a_nan_in_a_profile_is_refused_not_simulated(tmp_path):
    profile = json.loads(Path(tiny_profile(tmp_path / "p.json")).read_text())
    profile["coefficients"][0] = float("nan")
    (tmp_path / "nan.json").write_text(json.dumps(profile))  # json writes NaN
    with pytest.raises(ProfileMismatchError, match="finite and non-negative"):
        run_app(composed("model=tiny", f"calibration.profile={tmp_path / 'nan.json'}"), tmp_path / "out")


def test_bad_settings_fail_before_the_simulation_with_one_line(tmp_path):
    profile = tiny_profile(tmp_path / "p.json")
    for args, message in ((["goodput=ttfb:500"], "unknown metric 'ttfb'"),
                          (["workload.num_requests=0"], "num_requests must be >= 1"),
                          (["calibration.what_if.memory_gb_s=inf"], "finite and positive"),
                          (["workload=seed_burst", "capacity.enabled=true", "capacity.slo_ttft_p99_s=1"],
                           "poisson/gamma")):
        out = tmp_path / args[-1].replace("=", "_").replace(".", "_")
        proc = subprocess.run([sys.executable, "-m", "experiments.simulate", "model=tiny",
                               f"calibration.profile={profile}", *args, f"hydra.run.dir={out}"],
                              capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (out / "metrics.json").exists()  # nothing ran


def test_a_clipped_trace_says_so_in_metrics_json(tmp_path):
    """conf/workload/trace.yaml cuts lengths to prompt.max / output.max: a replay that is not the
    whole trace must say so where its numbers are, not only in a log line."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,100,7\n0.5,300,9\n2.0,200,11\n")
    overrides = ["model=tiny", f"calibration.profile={tiny_profile(tmp_path / 'p.json')}", "workload=trace",
                 f"workload.path={trace}"]
    clipped = run_app(composed(*overrides, "workload.prompt.max=150", "workload.output.max=8"), tmp_path / "cut")
    assert clipped["workload_clipped"] == {"requests": 2, "prompt_tokens_cut": 200, "output_tokens_cut": 4,
                                           "prompt_tokens_kept": 400, "output_tokens_kept": 23}
    assert json.loads((tmp_path / "cut" / "metrics.json").read_text())["workload_clipped"]["requests"] == 2
    whole = run_app(composed(*overrides, "workload.prompt.max=1000", "workload.output.max=100"), tmp_path / "whole")
    assert "workload_clipped" not in whole and whole["total_input_tokens"] == 600


def test_a_run_bound_by_kv_capacity_says_so(tmp_path):
    """As vLLM warns on preemption: a cap the KV cache cannot hold thrashes (recomputes), and the
    numbers are the cache's, not the cap's."""
    proc = subprocess.run([sys.executable, "-m", "experiments.simulate", "model=tiny",
                           f"calibration.profile={tiny_profile(tmp_path / 'p.json')}", "workload=seed_burst",
                           "workload.num_requests=8", "workload.prompt.value=60", "scheduler.num_kv_blocks=12",
                           f"hydra.run.dir={tmp_path / 'out'}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    preempted = json.loads((tmp_path / "out" / "metrics.json").read_text())["num_preemptions"]
    assert preempted > 0 and f"warning: {preempted} preemptions (recomputed)" in proc.stderr
    assert "12 blocks x 16 = 192 tokens" in proc.stderr
