"""The benchmarks are programs users run on machines CI never sees: each must at least compile
cleanly, and the two that issue figures come from (roofline, engine vs transformers) must run end
to end on the tiny model."""

import re
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
    # each shape's row: paired [p25-p75], best, and the call right after the probes ("1st")
    header = next(line for line in proc.stdout.splitlines() if "paired [p25-p75]" in line)
    assert re.search(r"paired \[p25-p75\]\s+best\s+1st", header)
    for name in ("decode B=1", "prefill 128"):
        row = next(line for line in proc.stdout.splitlines() if line.startswith(f"float32: {name} "))
        cells = re.search(r"([\d.]+) \[([\d.]+)-([\d.]+)\]\s+([\d.]+)\s+([\d.]+)", row)
        paired, q1, q3, best, first = (float(c) for c in cells.groups())
        assert q1 <= paired <= q3 and best > 0 and first > 0


def test_engine_vs_hf_pairs_its_ratio_by_round():
    """The headline ratio is the median of each round's own ratio (a spell lands on one round of
    every system), and every system generates exactly the requested tokens in every round."""
    proc = subprocess.run([sys.executable, "benchmarks/engine_vs_hf.py", "--model", "tiny", "--workloads", "seed",
                           "--repeats", "3", "--systems", "engine CB,HF CB"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    times, over_floor = {}, {}  # (round, system) -> seconds, and its time over the workload's floor, as printed
    for line in lines:
        run = re.match(r"\s*round (\d+): (.+?)\s+([\d.]+) s\s+([\d.]+)x the floor \(([\d.e+-]+) s at", line)
        if run:
            key = int(run[1]), run[2]
            times[key], over_floor[key] = float(run[3]), float(run[4])
            floor = float(run[5])
            assert over_floor[key] == pytest.approx(times[key] / floor, rel=0.02, abs=0.01)
            assert ("its steps' roofline" in line) == (run[2] == "engine CB")  # only the engine's steps are known
    assert len(times) == 6  # 3 rounds of 2 systems
    by_round = next(line for line in lines if "by round:" in line)
    printed = [float(x) for x in by_round.split("by round:")[1].split(";")[0].split(",")]
    for i, ratio in enumerate(printed, start=1):  # each round's HF time over its engine time (tok/s the other way)
        assert ratio == pytest.approx(times[i, "HF CB"] / times[i, "engine CB"], rel=0.03, abs=0.01)
    assert lines[-1] == f"engine_vs_hf_cb={sorted(printed)[1]:.2f}"


def test_engine_vs_hf_refuses_zero_rounds():
    proc = subprocess.run([sys.executable, "benchmarks/engine_vs_hf.py", "--model", "tiny", "--repeats", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--repeats" in proc.stderr


def test_ridge_probe_runs_beside_the_gemv_or_says_why_not():
    """The fp32 ridge loop needs AVX2 (in AVX-512 vectors where the CPU as allowed has them): there the
    one-thread row prints the loop and the gemv over the same weights and their ratio; elsewhere the
    benchmark says n/a."""
    from engine.model.kernels.features import cpu_features

    proc = subprocess.run([sys.executable, "benchmarks/ridge_probe.py", "--model", "tiny", "--dtypes", "float32",
                           "--rows", "8", "--threads", "1", "--repeats", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if "avx2" not in cpu_features():
        assert "float32: n/a (the ridge loop needs avx2" in proc.stdout
        return
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("float32 1 thread,  8 rows:"))
    assert "ridge" in line and "gemv" in line
    ratio = [w for w in proc.stdout.split() if w.startswith("gemv_over_ridge_float32_1t_8r=")]
    assert len(ratio) == 1 and float(ratio[0].split("=")[1]) > 0


def test_ridge_probe_refuses_rows_it_has_no_loop_for():
    proc = subprocess.run([sys.executable, "benchmarks/ridge_probe.py", "--model", "tiny", "--rows", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--rows" in proc.stderr
