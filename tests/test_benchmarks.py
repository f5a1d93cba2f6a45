"""The benchmarks are programs users run on machines CI never sees: each must at least compile
cleanly, and the roofline benchmark (which issue figures come from) must run end to end."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_each_benchmark_compiles_without_warnings(path):
    """A SyntaxWarning here is a crash there: an f-string followed by a parenthesis is a call on a str."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile(path.read_text(), str(path), "exec")


def test_roofline_calls_runs_and_prints_its_split_and_worst_ratios():
    proc = subprocess.run([sys.executable, "benchmarks/roofline_calls.py", "--model", "tiny", "--pairs", "2",
                           "--dtypes", "float32", "--device", "cpu", "--shapes", "decode B=1,prefill 128"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "float32: where a call's time goes" in proc.stdout
    assert "GB/s of weights" in proc.stdout  # the profiled split found the linears
    worst = [w for w in proc.stdout.split() if w.startswith("worst_meas_over_roofline_paired_float32=")]
    assert len(worst) == 1 and float(worst[0].split("=")[1]) > 0
