"""How well a calibration predicts real calls it never saw: the seed's three schedules.

    flock /tmp/miniserve-bench.lock python benchmarks/calibration_accuracy.py [--profile DIR/profile.json]

Without --profile it first calibrates the 0.5B-shaped model as `experiments.calibrate` does (the full grid,
sized to the default time budget: at most ~5 minutes).
Then it serves the seed burst (16 requests, 12-token prompts, outputs 4,16,8,12, max_num_seqs 8)
with serial, static and continuous batching on the real engine, ``--repeats`` times each (the
plans are deterministic, so every call has one median duration), and prints per scheduler the
per-call error of the cost model's prediction: median, MAPE, worst; and the run's total time
predicted from Σ(call + step overhead) against the measured one. Call timings during which
other processes used the CPU (this machine is shared) are left out of each call's median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from calibration.calibrate import CalibrationConfig, plan_record, run_calibration
from calibration.contention import Interval
from calibration.cost_model import CostModel
from calibration.profiler import Robustness, step_overheads
from engine.core.config import ModelConfig, SchedulerConfig
from engine.llm_engine import Engine
from engine.core.model_shape import config_fingerprint
from engine.observe.workload import LengthDist, WorkloadConfig, generate, make_requests

SEED_WORKLOAD = WorkloadConfig(num_requests=16, prompt=LengthDist("fixed", value=12),
                               output=LengthDist("cycle", values=(4, 16, 8, 12)))
SEED_SCHEDULER = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, long_prefill_token_threshold=128)


def watch_contention(engine: Engine) -> list[bool]:
    """Flag each model call during which other processes used the CPU (wraps this runner only)."""
    flags: list[bool] = []
    execute = engine.runner.execute

    def timed(plan, requests, *args, **kw):
        with Interval() as iv:
            out = execute(plan, requests, *args, **kw)
        flags.append(iv.contended)
        return out

    engine.runner.execute = timed
    return flags


def serve(engine: Engine, repeats: int, flags: list[bool]) -> tuple[list, np.ndarray, int, list[float], list[float]]:
    """Plans of one run; each call's median model time over the ``repeats`` runs in which nobody
    else used the CPU during it (all runs if none was quiet); how many call timings were left out;
    per-step overheads; run durations."""
    plans, times, quiet, overheads, durations = None, [], [], [], []
    for k in range(repeats):
        requests = make_requests(generate(SEED_WORKLOAD), vocab_size=engine.runner.vocab_size, seed=k)
        flags.clear()
        result = engine.run(requests)
        engine.reset()
        if plans is None:
            plans = [s.plan for s in result.steps]
        assert [(s.plan.request_ids, s.plan.num_tokens, s.plan.context_lens) for s in result.steps] == \
            [(p.request_ids, p.num_tokens, p.context_lens) for p in plans], "schedules differ between runs"
        times.append([s.model_s for s in result.steps])
        quiet.append([not f for f in flags])
        overheads += step_overheads(result.steps)
        durations.append(result.duration_s)
    t, q = np.asarray(times), np.asarray(quiet)
    medians = np.asarray([np.median(t[q[:, i], i]) if q[:, i].any() else np.median(t[:, i])
                          for i in range(t.shape[1])])
    return plans, medians, int((~q).sum()), overheads, durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, help="a profile.json; calibrate first when omitted")
    parser.add_argument("--out", type=Path, default=Path("outputs/calibration_accuracy"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-stamp-calls", action="store_true",
                        help="calibrate without a weights stamp before every call (Robustness.stamp_calls), to compare")
    args = parser.parse_args()
    model = ModelConfig(name="qwen2_5_0_5b", dtype=args.dtype, num_threads=args.threads)

    if args.profile is None:
        t = time.perf_counter()
        calibration = run_calibration(model, CalibrationConfig(
            grid="full", robust=Robustness(stamp_calls=not args.no_stamp_calls)))
        args.out.mkdir(parents=True, exist_ok=True)
        args.profile = args.out / "profile.json"
        calibration.cost_model.save(args.profile)
        print(f"calibrated in {time.perf_counter() - t:.0f} s → {args.profile}")
    cost = CostModel.load(args.profile, expect_fingerprint=config_fingerprint(model))
    threads = cost.info.get("measured_on", {}).get("threads")
    if threads != model.num_threads:
        print(f"warning: profile measured with {threads} threads, this run uses {model.num_threads}")
    for name, fit in (("empirical", cost.info["fit"]), ("physical", cost.info.get("physical", {}).get("fit"))):
        for rows in ("heldout", "heldout_as_timed"):
            if fit and rows in fit:
                e = fit[rows]
                print(f"profile grid {rows.replace('_', ' ')} ({name}): median {100 * e['median_error']:.2f}%, "
                      f"MAPE {100 * e['mape']:.2f}%, worst {100 * e['max_error']:.2f}%")

    engine = Engine(SEED_SCHEDULER, model)
    flags = watch_contention(engine)
    engine.warmup()
    header = (f"{'scheduler':<11} {'calls':>5} {'median %':>9} {'MAPE %':>7} {'worst %':>8} {'worst call':<44} "
              f"{'run s':>6} {'pred s':>7} {'ovh ms':>7} {'contended':>5}")
    print(header)
    all_rel = []
    calls: dict[str, list] = {}
    for name in ("serial", "static", "continuous"):
        engine.reset(replace(SEED_SCHEDULER, name=name))
        engine.warmup()
        plans, measured, contended, overheads, durations = serve(engine, args.repeats, flags)
        predicted = np.asarray([cost.predict(p) for p in plans])
        rel = np.abs(predicted - measured) / measured
        all_rel += rel.tolist()
        calls[name] = [{"plan": plan_record(p), "measured_s": float(m), "predicted_s": float(q)}
                       for p, m, q in zip(plans, measured, predicted)]
        worst = int(rel.argmax())
        run_pred = predicted.sum() + cost.step_overhead_s * len(plans)
        print(f"{name:<11} {len(plans):>5} {100 * np.median(rel):>9.2f} {100 * rel.mean():>7.2f} "
              f"{100 * rel.max():>8.2f} {plans[worst].label[10:54]:<44} {statistics.median(durations):>6.2f} "
              f"{run_pred:>7.2f} {1e3 * statistics.median(overheads):>7.2f} {contended:>5}")
    all_rel = np.asarray(all_rel)
    print(f"all seed calls: median {100 * np.median(all_rel):.2f}%, MAPE {100 * all_rel.mean():.2f}%, "
          f"worst {100 * all_rel.max():.2f}% (target median ≤ 5%, worst ≤ 15%)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "seed_calls.json").write_text(json.dumps(calls) + "\n")
    print(f"profile step overhead {1e3 * cost.step_overhead_s:.2f} ms")


if __name__ == "__main__":
    main()
