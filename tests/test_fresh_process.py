"""A fresh process's worker does not outlive a killed parent (experiments/fresh_process.py)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.fresh_process import PARENT_POLL_S, in_fresh_process
from tests.helpers import REPO_ROOT


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's new parent may reap it late)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_fresh_process_returns_its_result_and_raises_its_error():
    assert in_fresh_process(divmod, 17, 5) == (3, 2)
    with pytest.raises(ZeroDivisionError):
        in_fresh_process(divmod, 1, 0)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_the_worker_exits_soon_after_its_parent_is_killed(tmp_path):
    pid_file = tmp_path / "worker.pid"
    parent = subprocess.Popen(
        [sys.executable, "-c", "from experiments.fresh_process import in_fresh_process; "
         "from tests.helpers import write_pid_then_sleep; "
         f"in_fresh_process(write_pid_then_sleep, {str(pid_file)!r}, 600.0)"], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None and time.monotonic() < deadline, "the worker never started"
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        assert _running(worker)
        parent.send_signal(signal.SIGKILL)  # no handler runs: the worker is on its own
        parent.wait(30)
        deadline = time.monotonic() + 10 * PARENT_POLL_S
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(worker), "the worker outlived its killed parent"
    finally:
        parent.kill()
        if pid_file.exists() and pid_file.read_text() and _running(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
