"""A model call right after the engine sat idle vs the same call back to back.

Calibration times calls back to back; a serving loop at low load sleeps until the next arrival, so
its first call after the sleep finds cold caches and sleeping worker threads. This prints, per
shape, the median call time back to back and after idle gaps, alternating in one process.

    flock /tmp/miniserve-bench.lock python benchmarks/call_after_idle.py [--model qwen2_5_0_5b] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not an installed copy

from calibration.grid import GRID_SPECS, Shape  # noqa: E402
from calibration.profiler import ShapePool, make_runner  # noqa: E402
from engine.core.config import ModelConfig  # noqa: E402

SHAPES = {"decode B=1 @64": Shape("decode", decode_contexts=(64,)),
          "decode B=4 @64": Shape("decode", decode_contexts=(64,) * 4),
          "prefill 32": Shape("prefill", chunks=((32, 0, True),))}
GAPS_S = (0.0, *(idle for idle, _ in GRID_SPECS["full"].idle_levels))  # back to back, and the full grid's idles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    runner = make_runner(ModelConfig(name=args.model, dtype=args.dtype, num_threads=args.threads), 8, 200)
    pool = ShapePool(runner, 8, 200)
    plans = {k: s.to_plan(pool.request_ids) for k, s in SHAPES.items()}
    times = {(k, g): [] for k in plans for g in GAPS_S}
    for _ in range(2):
        for plan in plans.values():
            pool.execute(plan)
    for _ in range(args.rounds):
        for k, plan in plans.items():
            for g in GAPS_S:
                pool.execute(plan)  # the call before the gap
                time.sleep(g)
                times[k, g].append(pool.execute(plan)[0])
    print(f"{'shape':16s} " + " ".join(f"{'idle ' + str(g) + ' s':>12s}" for g in GAPS_S) + "   (median ms)")
    for k in plans:
        base = statistics.median(times[k, 0.0])
        print(f"{k:16s} " + " ".join(f"{statistics.median(times[k, g]) * 1e3:9.1f}{'':3s}" for g in GAPS_S)
              + f"   after {GAPS_S[-1]:g} s idle: {statistics.median(times[k, GAPS_S[-1]]) / base:.2f}x")


if __name__ == "__main__":
    main()
