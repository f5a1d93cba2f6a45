"""The Hydra apps users drive: every config composes, bad overrides fail clearly, and a tiny
sweep, validation and report run end to end."""

import json
from pathlib import Path
import subprocess
import sys

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from engine.core.config import SCHEDULER_NAMES
from experiments.schema import to_object
from experiments import bench, calibrate, report, run, seed, seed_http, serve, simulate, sweep, validate  # noqa: F401  (registers schemas)
from tests.helpers import REPO_ROOT

CONF = str(REPO_ROOT / "conf")
APPS = ["seed", "run", "simulate", "sweep", "validate", "calibrate", "serve", "bench", "seed_http", "report"]
MODELS = ["tiny", "qwen2_5_0_5b"]
WORKLOADS = ["seed_burst", "poisson", "gamma", "closed_loop"]


def composed(app: str, overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=app, overrides=overrides)


@pytest.mark.parametrize("app", APPS)
def test_every_app_config_composes_into_its_schema(app):
    cfg = composed(app, [])
    obj = to_object(cfg)
    assert type(obj).__name__.endswith("App")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("scheduler", SCHEDULER_NAMES)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_model_scheduler_workload_combination_composes(model, scheduler, workload):
    for app in ("run", "simulate", "sweep"):
        obj = to_object(composed(app, [f"model={model}", f"scheduler={scheduler}", f"workload={workload}"]))
        assert obj.scheduler.name == scheduler and obj.model.name == model


def test_max_model_len_past_the_models_positions_is_cut_for_engine_and_simulator_alike(caplog):
    """The tiny model has 4,096 positions: the simulator must refuse what the engine would."""
    for app in ("run", "simulate", "sweep", "validate"):
        with caplog.at_level("WARNING", logger="miniserve.config"):
            obj = to_object(composed(app, ["model=tiny", "scheduler.max_model_len=8192"]))
        assert obj.scheduler.max_model_len == 4096 and "longer than the model's 4096 positions" in caplog.text
        assert to_object(composed(app, ["model=tiny", "scheduler.max_model_len=1024"])).scheduler.max_model_len == 1024


def test_trace_workload_needs_a_path_and_local_model_needs_a_path():
    with pytest.raises((ConfigCompositionException, ValueError), match="path"):
        to_object(composed("simulate", ["workload=trace"]))
    with pytest.raises((ConfigCompositionException, ValueError), match="path"):
        to_object(composed("run", ["model=local"]))


@pytest.mark.parametrize("override,error", [
    ("scheduler.max_num_seq=4", "max_num_seq"),
    ("workload.rate=fast", "rate"),
    ("backend=gpu", "backend must be one of"),
    ("scheduler.name=fifo", "scheduler.name must be one of"),
    ("load=0", "load must be > 0"),
    ("workload=seed_burst load=0.5", "load sets an arrival rate"),
    # a cap above the token budget would never bind (vLLM refuses it too)
    ("scheduler.max_num_seqs=512", r"max_num_batched_tokens \(256\) must be at least scheduler.max_num_seqs \(512\)"),
])
def test_bad_sweep_overrides_fail_clearly(override, error):
    with pytest.raises((ConfigCompositionException, ValueError), match=error):
        to_object(composed("sweep", override.split()))


def test_unknown_group_option_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException, match="workload"):
        composed("run", ["workload=nonexistent"])


def run_app(module: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *overrides], capture_output=True, text=True,
                          timeout=600, cwd=REPO_ROOT, check=True)


@pytest.fixture(scope="module")
def tiny_profile(tiny_calibration):
    assert tiny_calibration.run.returncode == 0, tiny_calibration.run.stderr[-3000:]
    return tiny_calibration.dir / "profile.json"


def test_tiny_sweep_real_and_simulated_then_report(tmp_path, tiny_profile):
    common = ["model=tiny", "model.device=cpu", "model.num_threads=1", "scheduler=static,continuous",
              "scheduler.max_num_seqs=4", "workload.num_requests=10", "load=0.5,1.2",
              f"calibration.profile={tiny_profile}"]
    run_app("experiments.sweep", "-m", "backend=sim", *common, f"hydra.sweep.dir={tmp_path / 'sim'}")
    run_app("experiments.sweep", "-m", "backend=real", *common, f"hydra.sweep.dir={tmp_path / 'real'}")
    jobs = sorted(p.parent for p in tmp_path.glob("*/*/job.json"))
    assert len(jobs) == 8
    for d in jobs:
        job = json.loads((d / "job.json").read_text())
        m = json.loads((d / "metrics.json").read_text())
        assert m["completed"] == 10 and job["max_num_seqs"] == 4
        assert job["load"] in (0.5, 1.2) and job["rate"] == pytest.approx(job["load"] * job["saturation_req_s"])
    out = run_app("experiments.report", f"sweep_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'report'}")
    sweep_csv = pd.read_csv(tmp_path / "report" / "sweep.csv")
    assert set(sweep_csv.backend) == {"sim", "real"} and len(sweep_csv) == 8
    assert (tmp_path / "report" / "sweep_rate_curves.png").stat().st_size > 10_000
    assert "sweep_rate_curves.png" in (tmp_path / "report" / "summary.md").read_text()
    assert "summary.md" in out.stdout


def test_a_bad_value_in_a_sweep_list_is_one_line_and_a_failed_exit(tmp_path, tiny_profile):
    done = subprocess.run([sys.executable, "-m", "experiments.sweep", "-m", "backend=sim", "model=tiny",
                           "scheduler=continuous", "scheduler.max_num_seqs=4,-1", "workload.num_requests=5", "load=0.5",
                           f"calibration.profile={tiny_profile}", f"hydra.sweep.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "error in job 1 (" in done.stderr and "max_num_seqs must be a positive integer, got -1" in done.stderr
    single = subprocess.run([sys.executable, "-m", "experiments.sweep", "backend=sim", "model=tiny",
                             "scheduler.max_num_seqs=-1", f"calibration.profile={tiny_profile}",
                             f"hydra.run.dir={tmp_path / 'single'}"], capture_output=True, text=True, timeout=600,
                            cwd=REPO_ROOT)  # no -m: a single job has no number
    assert single.returncode == 2 and "Traceback" not in single.stderr
    assert "error: scheduler.max_num_seqs must be a positive integer, got -1" in single.stderr


def test_tiny_validation_writes_the_error_table(tmp_path, tiny_profile):
    out = run_app("experiments.validate", "model=tiny", "model.device=cpu", "model.num_threads=1",
                  f"calibration.profile={tiny_profile}", "matrix.schedulers=[static,continuous]",
                  "matrix.max_num_seqs=[4]", "matrix.arrivals=[poisson]",
                  "matrix.load_levels=[0.5]", "matrix.repeats=2", "bands.replicates=5",
                  "contention.others_cores=-1",  # every run counts as contended: flagged and re-run once
                  f"hydra.run.dir={tmp_path}")
    df = pd.read_csv(tmp_path / "validation.csv")
    assert list(df.columns[:6]) == ["workload", "scheduler", "max_num_seqs", "metric", "real", "real_min"]
    assert {"real_max", "real_cv", "real_runs", "contended_runs", "reruns", "sim", "rel_error", "allowed", "ok",
            "band_p5", "band_p95", "band_width", "band_hits"} <= set(df.columns)
    assert (df.real_runs == 2).all() and (df.real_min <= df.real).all() and (df.real <= df.real_max).all()
    assert "repeat_ok" not in df.columns and "held out" not in out.stdout  # two runs: none held out against two
    assert (df.allowed >= df.tolerance).all() and (df.ok == (df.rel_error.abs() <= df.allowed)).all()
    assert (df.band_p5 <= df.band_p95).all() and (df.band_hits <= df.real_runs).all()
    # each row's band draws a bandwidth from the 3 other rows' 4 attempts each (and the profile's history), never its own
    assert df.band_source.str.contains("12 of other rows' real runs").all()
    assert json.loads(Path(tiny_profile).read_text())["noise"]["memory_gb_s_history"]
    runs = pd.read_csv(tmp_path / "real_runs.csv")  # every attempt: two repeats, each re-run once, no more
    assert set(runs.repeat) == {0, 1} and (runs.groupby(["row", "repeat"]).size() == 2).all()
    assert runs.contended.all() and runs.reason.str.contains("cores").all()
    assert (df.contended_runs == 2).all() and (df.reruns == 2).all()  # flagged, never silently averaged
    assert "in 90% band" in out.stdout and "band coverage" in out.stdout
    # beside the deterministic simulation, the median of replicates with the calls' own noise
    assert (df.sim_calls_noise > 0).all() and df.ok_calls_noise.dtype == bool
    assert f"{int(df.ok_calls_noise.sum())}/{len(df)}" in out.stdout and "sim_calls_noise" in out.stdout
    timing = df[df.metric.isin(["output_throughput", "ttft_p50", "e2e_p99"])]  # leave-one-row-out bands
    assert (timing.conformal_p5 <= timing.conformal_p95).all() and (timing.conformal_hits <= timing.real_runs).all()
    assert df[df.metric == "model_calls"].conformal_hits.isna().all()  # counts, not times: none
    assert "in LORO band" in out.stdout and "(leave-one-row-out)" in out.stdout
    assert set(df.workload) == {"seed_burst", "poisson@0.5"} and set(df.scheduler) == {"static", "continuous"}
    assert len(df) == 4 * 9
    # the burst's plans are the pure policy's in both runs, so its call counts agree exactly
    burst_calls = df[(df.workload == "seed_burst") & (df.metric == "model_calls")]
    assert (burst_calls.real == burst_calls.sim).all()
    assert (df.memory_gb_s > 0).all()  # each real run carries the memory bandwidth it ran at
    # and the kernels its calls took: the tiny profile's, so nothing is said about them
    profiled = json.loads(Path(tiny_profile).read_text())["measured_on"]["kernels"]
    assert all(r["kernels"] == profiled for r in json.loads((tmp_path / "real_runs.json").read_text()))
    assert "other kernels" not in out.stdout
    assert (df.runs_gb_s > 0).all()  # and the row the bandwidth its runs' calls saw (use_run_bandwidth's)
    assert "median |err|" in out.stdout and "GB/s" in out.stdout
    # how far each simulated metric moves with the machine 2% slower or faster: a burst (all at
    # t=0) keeps its plans, so its calls do not move and its throughput moves by the speed exactly
    burst = df[df.workload == "seed_burst"].set_index(["scheduler", "metric"]).sim_moves
    assert (df.sim_moves >= 0).all() and (burst.xs("model_calls", level="metric") == 0).all()
    assert burst.xs("output_throughput", level="metric").to_numpy() == pytest.approx(1 / 0.98 - 1, rel=1e-3)
    assert "ill-conditioned" in out.stdout and "2% slower or faster" in out.stdout
    report_dir = tmp_path / "report"
    run_app("experiments.report", f"validate_dir={tmp_path}", f"hydra.run.dir={report_dir}")
    assert (report_dir / "sim_vs_real.png").is_file()


def test_report_with_nothing_to_read_says_so(tmp_path):
    out = subprocess.run([sys.executable, "-m", "experiments.report", f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert out.returncode != 0 and "nothing to report" in out.stderr


@pytest.mark.parametrize("app,preset", [("validate", "quick_validate"), ("sweep", "cpu_sweep"), ("simulate", "seed"),
                                        ("run", "seed"), ("sweep", "seed")])
def test_experiment_presets_compose(app, preset):
    obj = to_object(composed(app, [f"+experiment={preset}"]))
    if preset == "seed":
        assert obj.workload.arrival == "burst" and obj.workload.num_requests == 16 and obj.scheduler.max_num_seqs == 8
    if preset == "quick_validate":
        assert obj.matrix.max_num_seqs == [8]


def test_a_replay_keeps_the_prompts_ids_so_prefix_cache_hits_are_the_runs():
    """A replay kept lengths only and gave every request range(p): all prompts then shared their
    leading blocks, and a simulation with prefix caching found hits the real run never had."""
    from engine.core.config import SchedulerConfig
    from engine.observe.workload import LengthDist, WorkloadConfig, generate, make_requests
    from experiments.validate import replay_requests
    from sim import CostModelExecutor, simulate
    from sim.executors import cost_model_from

    workload = WorkloadConfig(arrival="poisson", rate=20.0, num_requests=16, content="multi_turn", turns=2,
                              turn_gap_s=0.3, prefix_tokens=24, seed=2,
                              prompt=LengthDist(kind="uniform", low=4, high=20, max=200),
                              output=LengthDist(kind="uniform", low=1, high=8))
    scheduler = SchedulerConfig(max_num_seqs=4, block_size=4, enable_prefix_caching=True)
    cost = cost_model_from(const=0.01, prefill_tokens=1e-3, decode_tokens=1e-3)
    requests = make_requests(generate(workload))
    replay = [(r.request_id, r.arrival_s, r.num_prompt_tokens, r.max_tokens, list(r.prompt_token_ids))
              for r in requests]

    def hits(reqs):
        return simulate(reqs, scheduler, lambda: CostModelExecutor(cost)).metrics()["prefix_cache_hits"]
    assert 0 < hits(replay_requests(replay, True)) == hits(make_requests(generate(workload)))
    lengths_only = [entry[:4] for entry in replay]
    with pytest.raises(ValueError, match="content"):
        replay_requests(lengths_only, prefix_caching=True)
    unique = replay_requests(lengths_only)  # without caching: lengths are all a simulation reads
    assert [r.num_prompt_tokens for r in unique] == [r.num_prompt_tokens for r in requests]
    assert hits(unique) == 0
