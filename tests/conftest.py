"""Test-wide setup: the suite runs on the CPU, and nothing a test runs writes into the user's own
per-machine caches."""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# The suite checks the CPU engine (its lean path, kernels and dispatch, which a GPU run does not
# use): on a machine with a GPU, ``model.device=auto`` would take it, here and in the apps the
# tests start. CUDA reads this when it first initialises, so it holds for both; MPS has no such
# switch, so the fixture below hides it in this process and the tests that start an app running
# the model name model.device=cpu. On a GPU machine, ``MINISERVE_TEST_DEVICE=cuda|mps pytest
# tests/test_on_gpu.py`` leaves the GPU visible for the tests that check it (benchmarks/device_check.py
# runs them first).
TEST_DEVICE = os.environ.get("MINISERVE_TEST_DEVICE", "cpu")
if TEST_DEVICE != "cuda":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    """With a GPU visible, only the GPU's own tests run: the rest check the CPU path, and
    ``model.device=auto`` would put them on the GPU."""
    if TEST_DEVICE == "cpu":
        return
    why = pytest.mark.skip(reason=f"MINISERVE_TEST_DEVICE={TEST_DEVICE} runs tests/test_on_gpu.py alone")
    for item in items:
        if item.path.name != "test_on_gpu.py":
            item.add_marker(why)


@pytest.fixture(autouse=True)
def _no_apple_gpu(monkeypatch):
    if TEST_DEVICE == "mps":
        return
    from engine.model import device
    monkeypatch.setattr(device, "_has_mps", lambda: False)


@pytest.fixture(autouse=True, scope="session")
def _bandwidth_history_in_a_temp_dir(tmp_path_factory):
    """calibrate and validate append to this machine's bandwidth history
    (calibration.bandwidth_history); tests keep theirs apart."""
    old = os.environ.get("MINISERVE_BANDWIDTH_HISTORY_DIR")
    os.environ["MINISERVE_BANDWIDTH_HISTORY_DIR"] = str(tmp_path_factory.mktemp("bandwidth_history"))
    yield
    if old is None:
        os.environ.pop("MINISERVE_BANDWIDTH_HISTORY_DIR", None)
    else:
        os.environ["MINISERVE_BANDWIDTH_HISTORY_DIR"] = old


@dataclass
class TinyCalibration:
    dir: Path
    run: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def tiny_calibration(tmp_path_factory, _bandwidth_history_in_a_temp_dir) -> TinyCalibration:
    """The calibrate app once per session on the tiny model, quick grid, its defaults otherwise:
    test_calibration checks what it wrote and printed, the experiments' tests read its profile
    (no app writes into a profile after calibrate; one run saves the suite its ~45 s a time)."""
    out = tmp_path_factory.mktemp("tiny_calibration")
    run = subprocess.run([sys.executable, "-m", "experiments.calibrate", "model=tiny", "calibration.grid=quick",
                          "model.num_threads=1", "model.device=cpu", f"hydra.run.dir={out}"],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    return TinyCalibration(out, run)
