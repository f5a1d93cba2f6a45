"""A simulated sweep through Hydra's Ray launcher, on a Ray head started here on loopback.

Needs the ``ray`` extra (pip install -e '.[ray]'), which CI installs; skipped only without ray.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from engine.core.config import ModelConfig  # noqa: E402
from engine.core.model_shape import config_fingerprint  # noqa: E402
from sim.executors import cost_model_from  # noqa: E402

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_started(log: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    """``ray start`` says so once the head's processes are all up (its port opens earlier than that)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ray start exited early: {log.read_text()[-2000:]}"
        if "Ray runtime started" in log.read_text():
            return
        time.sleep(0.2)
    raise TimeoutError(f"the Ray head did not start within {timeout_s} s: {log.read_text()[-2000:]}")


@pytest.fixture
def ray_head():
    """A one-node Ray cluster in its own process group, stopped (TERM, then KILL) at the end."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    log = Path(temp) / "start.log"
    proc = subprocess.Popen([RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
                             f"--ray-client-server-port={free_port()}", "--num-cpus=2", "--include-dashboard=false",
                             "--disable-usage-stats", f"--temp-dir={temp}"],
                            env=env, start_new_session=True, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_until_started(log, proc, 60)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # ray start --block stops the node's processes on TERM
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(2)  # then whatever of its group is still up (gcs_server lingers) is killed
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        subprocess.run(["rm", "-rf", temp], check=False)


def test_a_simulated_sweep_runs_on_ray(ray_head, tmp_path):
    profile = tmp_path / "profile.json"
    cost_model_from(step_overhead_s=2e-4, fingerprint=config_fingerprint(ModelConfig(name="tiny")), const=2e-3,
                    decode_tokens=1e-4).save(profile)
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.sweep", "-m", "hydra/launcher=ray_cluster",
         f"hydra.launcher.ray.init.address={ray_head}", "model=tiny", "model.device=cpu",
         f"calibration.profile={profile}", "scheduler=continuous", "scheduler.max_num_seqs=4,8", "load=0.5,1.2",
         "workload.num_requests=20",
         f"hydra.sweep.dir={sweep}"],
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Ray Launcher is launching 4 jobs" in proc.stdout + proc.stderr
    jobs = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/job.json"))]
    assert sorted((j["max_num_seqs"], j["load"]) for j in jobs) == [(4, 0.5), (4, 1.2), (8, 0.5), (8, 1.2)]
    for p in sweep.glob("*/metrics.json"):
        assert json.loads(p.read_text())["completed"] == 20
