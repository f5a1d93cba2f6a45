"""The project end to end on a GPU: the seed experiment (real and simulated, with its quick
calibration), the calibration's held-out fit error, and a quick validation, on cuda or mps.

    python benchmarks/device_check.py                           # the GPU this machine has (cuda, then mps)
    python benchmarks/device_check.py --device cpu --model tiny # the script itself, on any machine

Without a GPU (and without ``--device cpu``) it says what is missing and exits 1: a GPU check
that ran on the CPU would be a false result. Each step is the app a user runs, in its own
process; the output lands in ``--out`` (default outputs/device_check/<device>).
"""

from __future__ import annotations

import argparse
import json
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


def run_app(app: str, *overrides: str) -> None:
    """``python -m experiments.<app> overrides...`` with its output shown; a failure stops the check."""
    cmd = [sys.executable, "-m", f"experiments.{app}", *overrides]
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    print(f"({app}: {time.perf_counter() - t0:.0f} s)", flush=True)


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
    run_app("seed", *model, f"hydra.run.dir={out / 'seed'}")  # prints the seed table, real and simulated
    profile = out / "seed" / "calibration" / "profile.json"
    print("\n" + "\n".join(heldout_lines(profile)))
    run_app("validate", *model, "+experiment=quick_validate", f"calibration.profile={profile}",
            f"hydra.run.dir={out / 'validate'}")  # prints the validation table
    print(f"\ndevice_check on {device}: done; outputs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
