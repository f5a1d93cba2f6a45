"""Test-wide setup: nothing a test runs writes into the user's own per-machine caches."""

import os

import pytest


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
