"""Where real and simulated TTFT part: a validation's real runs beside the simulator's, step by step.

    python benchmarks/ttft_side_by_side.py VALIDATION_DIR PROFILE [--rows poisson@0.3]

Reads VALIDATION_DIR/real_runs.json (experiments.validate keeps each real run's steps and first
tokens), re-simulates each row's requests with PROFILE and prints per row, real vs simulated:
TTFT p50; the same simulated with each call as its real run measured it (sim.executors.
MeasuredCallsExecutor: the cost model exact for that run, so what is left is the loop's; the median
over the row's runs, and how many runs' plans the simulation left, at which step); TTFT's two parts
per request (waiting: arrival → first scheduled; serving: first scheduled → first token); the
model call of steps that start after the engine sat idle against the calls of busy steps (each as
measured / predicted); the time outside the call per step, split into before the call (step start
→ call start) and after it (call end → next step start). No model runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not an installed copy

from calibration.cost_model import CostModel  # noqa: E402
from engine.core.config import SchedulerConfig  # noqa: E402
from sim.executors import CostModelExecutor, MeasuredCallsExecutor  # noqa: E402
from sim.simulator import simulate  # noqa: E402
from experiments.validate import recorded_steps, replay_requests  # noqa: E402


def med(xs) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("validation_dir")
    ap.add_argument("profile")
    ap.add_argument("--rows", default="", help="comma list of workload names (default: all)")
    ap.add_argument("--idle-s", type=float, default=0.005, help="a gap this long before a step counts as idle")
    args = ap.parse_args()
    cost = CostModel.load(args.profile)
    val = json.loads((Path(args.validation_dir) / "real_runs.json").read_text())
    rows = {}
    for r in val:
        rows.setdefault(r["row"], []).append(r)
    print(f"{'row':28s} {'TTFT p50 real/sim':>18s} {'@measured calls':>16s} {'wait real/sim':>14s} {'serve real/sim':>15s} "
          f"{'idle call meas/pred':>20s} {'busy call meas/pred':>20s} {'before ms':>10s} {'after ms':>9s}")
    wanted = set(filter(None, args.rows.split(",")))
    for i, rr in sorted(rows.items()):
        meta = rr[0]["meta"]
        if wanted and meta["workload"] not in wanted:
            continue
        config = SchedulerConfig(**meta["scheduler"])
        reqs = replay_requests(rr[0]["replay"], config.enable_prefix_caching)
        sim = simulate(reqs, config, lambda: CostModelExecutor(cost), keep_steps=True)
        s_first = {r.request_id: (r.arrival_s, r.first_scheduled_s, r.token_times_s[0]) for r in sim.records}
        real_ttft, wait, serve, idle_ratio, busy_ratio, before, after = [], [], [], [], [], [], []
        measured_ttft, diverged = [], []
        for run in rr:
            real_ttft.append(med([t - a for _, a, _, t in run["first_tokens"]]))
            records = recorded_steps(run)
            executor = MeasuredCallsExecutor(cost, records)
            oracle = simulate(replay_requests(run["replay"], config.enable_prefix_caching), config, lambda: executor)
            measured_ttft.append(oracle.metrics()["ttft_s"]["p50"])
            if executor.diverged_at is not None:
                diverged.append(executor.diverged_at)
            wait += [f - a for _, a, f, _ in run["first_tokens"]]
            serve += [t - f for _, _, f, t in run["first_tokens"]]
            for k, st in enumerate(records):
                prev_end = records[k - 1].end_s if k else -1.0
                ratio = st.model_s / cost.predict(st.plan)
                (idle_ratio if k == 0 or st.start_s - prev_end > args.idle_s else busy_ratio).append(ratio)
                before.append(st.end_s - st.model_s - st.start_s)
                if k + 1 < len(records):
                    after.append(records[k + 1].start_s - st.end_s)
        sim_ttft = med([t - a for a, _, t in s_first.values()])
        s_wait = med([f - a for a, f, _ in s_first.values()])
        s_serve = med([t - f for _, f, t in s_first.values()])
        name = f"{meta['workload']} {config.name} cap={config.max_num_seqs}"
        left = f"{len(diverged)}@{min(diverged)}" if diverged else "0"
        print(f"{name:28s} {med(real_ttft):8.3f}/{sim_ttft:<8.3f} {med(measured_ttft):8.3f} {left:>7s} "
              f"{med(wait):6.3f}/{s_wait:<6.3f} "
              f"{med(serve):7.3f}/{s_serve:<6.3f} {med(idle_ratio):9.2f} (n={len(idle_ratio):3d}) "
              f"{med(busy_ratio):9.2f} (n={len(busy_ratio):3d}) {1e3 * med(before):9.2f} {1e3 * med(after):8.2f}")
    print(f"\nprofile: step overhead {1e3 * cost.step_overhead_s:.2f} ms, of it before the call "
          f"{1e3 * cost.before_call_s:.2f} ms")


if __name__ == "__main__":
    main()
