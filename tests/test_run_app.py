"""experiments.run: a real run writes the same files a simulated run does, in both modes."""

import json
import subprocess
import sys

import pytest

from engine.observe.metrics import read_requests_csv
from engine.observe.trace import summarize_trace
from tests.test_results import check_vllm_keys


@pytest.mark.parametrize("mode", ["inprocess", "server"])
def test_real_run_writes_metrics_requests_and_trace(tmp_path, mode):
    subprocess.run([sys.executable, "-m", "experiments.run", "model=tiny", "model.device=cpu", "model.num_threads=1",
                    f"mode={mode}", "scheduler=static", "scheduler.max_num_seqs=4", "workload.num_requests=8",
                    f"hydra.run.dir={tmp_path}"], check=True, capture_output=True, timeout=300)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    records = read_requests_csv(tmp_path / "requests.csv")
    assert metrics["completed"] == len(records) == 8
    results = json.loads((tmp_path / "results.json").read_text())
    check_vllm_keys(results)
    assert results["completed"] == 8 and results["backend"] == ("miniserve" if mode == "inprocess" else "openai")
    assert metrics["total_output_tokens"] == sum(r.output_tokens for r in records) == 80  # 2 × (4+16+8+12)
    run = json.loads((tmp_path / "run.json").read_text())
    trace = summarize_trace(tmp_path / "trace.json", max_num_seqs=4)
    assert run["trace"]["model_calls"] == trace.model_calls
    # static, groups of 4 with outputs 4, 16, 8, 12: 1 prefill + 15 decodes per group, two groups
    # (over HTTP the burst may reach the server a few requests at a time, so only in-process is exact)
    if mode == "inprocess":
        assert trace.model_calls == 32 and trace.prefill_calls == 2


def test_unknown_mode_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "experiments.run", "model=tiny", "mode=remote",
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "mode must be one of" in out.stderr
