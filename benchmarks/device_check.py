"""The project end to end on a GPU: the GPU's exactness tests (tests/test_on_gpu.py: the packed
ragged forward against the unbatched reference, bf16 against fp32, the device timer), a decode
call inside the engine's step loop against the same call back to back (benchmarks/call_in_loop.py),
the seed experiment (real and simulated, with its quick calibration), the calibration's held-out
fit error, a quick validation, and with ``--roofline`` each call shape against the GPU's roofline,
on cuda or mps.

    python benchmarks/device_check.py                           # the GPU this machine has (cuda, then mps)
    python benchmarks/device_check.py --device cpu --model tiny # the script itself, on any machine

Without a GPU (and without ``--device cpu``) it says what is missing and exits 1: a GPU check
that ran on the CPU would be a false result. Each step is the app a user runs, in its own
process; the output lands in ``--out`` (default outputs/device_check/<device>). A failing step
does not stop the later ones (one lease of a GPU should say everything that is wrong); the exit
status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_here() -> str | None:
    """cuda or mps where torch sees one, else None."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps is not None and mps.is_available() else None


def step(name: str, *args: str, env: dict[str, str] | None = None) -> bool:
    """``python args...`` with its output shown; whether it succeeded."""
    cmd = [sys.executable, *args]
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT, env=None if env is None else {**os.environ, **env}).returncode
    print(f"({name}: {time.perf_counter() - t0:.0f} s{'' if rc == 0 else f', FAILED with exit status {rc}'})",
          flush=True)
    return rc == 0


def heldout_lines(profile: Path) -> list[str]:
    """The calibration's held-out fit error and where it was measured, from its profile."""
    data = json.loads(profile.read_text())
    fit, on = data["fit"], data["measured_on"]
    return [f"profile {profile}: {on['device']} ({on.get('device_name')}), torch {on['torch']}, "
            f"dtype {data['model']['dtype']}" + (f", CUDA {on['cuda_runtime']}, driver {on.get('driver')}"
                                                 if on["device"] == "cuda" else ""),
            f"held-out fit error: MAPE {fit['heldout_mape']:.1%}, worst {fit['heldout_max_error']:.1%}, "
            f"R² {fit['heldout_r2']:.3f}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("auto", "cuda", "mps", "cpu"), default="auto",
                    help="auto: the GPU this machine has; cpu only to try the script itself")
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--roofline", action="store_true",
                    help="also time each call shape against the device's roofline (benchmarks/roofline_calls.py)")
    args = ap.parse_args()
    device = args.device
    if device == "auto":
        device = gpu_here()
        if device is None:
            import torch

            print(f"device_check: no GPU here: torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'}) "
                  "sees neither an NVIDIA GPU (cuda) nor an Apple GPU (mps). Run it on a GPU machine, or "
                  "`--device cpu --model tiny` to try the script itself.", file=sys.stderr)
            return 1
    out = (args.out or ROOT / "outputs" / "device_check" / device).resolve()
    model = [f"model={args.model}", f"model.device={device}", f"model.dtype={args.dtype}"]
    failed = []
    if device != "cpu" and not step("tests", "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                                    "tests/test_on_gpu.py", env={"MINISERVE_TEST_DEVICE": device}):
        failed.append("tests")
    # the engine's calls against the same calls back to back, as the calibration times them (and
    # the collector's collections in each): a gap here is a gap between every real and simulated run
    if not step("call in loop", "benchmarks/call_in_loop.py", "--model", args.model, "--device", device,
                "--dtype", args.dtype):
        failed.append("call in loop")
    profile = out / "seed" / "calibration" / "profile.json"
    profile.unlink(missing_ok=True)  # an earlier check's profile must not stand in for this one's
    # prints the seed table, real and simulated
    if not step("seed", "-m", "experiments.seed", *model, f"hydra.run.dir={out / 'seed'}"):
        failed.append("seed")
    if profile.exists():
        print("\n" + "\n".join(heldout_lines(profile)))
        if not step("validate", "-m", "experiments.validate", *model, "+experiment=quick_validate",
                    f"calibration.profile={profile}", f"hydra.run.dir={out / 'validate'}"):  # the validation table
            failed.append("validate")
    else:
        print(f"\nno calibration profile at {profile}: validate not run")
        failed.append("validate (no profile)")
    if args.roofline and not step("roofline", "benchmarks/roofline_calls.py", "--model", args.model,
                                  "--pairs", "5", "--device", device):
        failed.append("roofline")
    print(f"\ndevice_check on {device}: {'FAILED: ' + ', '.join(failed) if failed else 'done'}; outputs in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
