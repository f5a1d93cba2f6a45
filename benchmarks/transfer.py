"""Transfer: a profile calibrated on one model predicts other models' calls and runs.

    flock /tmp/miniserve-bench.lock python benchmarks/transfer.py --profile P.json \
        [--models qwen2_5_0_5b,qwen2_5_1_5b,qwen3_0_6b] [--dtype bfloat16] [--load 0.6] [--poisson-requests 16] \
        [--repeats 3]

For each model: build it (seeded random weights of its real shape), run the seed burst and one
Poisson row (``--load`` × the simulated saturation rate) through the real continuous engine
``--repeats`` times, then simulate the same arrivals with the profile's cost model — for another
model than the profile's, the physical model transferred to that shape. Prints per-call error on
every real call of the repeats (median, worst) and sim-vs-real throughput, TTFT p50, E2E p50/p99
against the real runs' median, with half their spread beside it (one real run on this kind of
machine moves by more than the tolerance: a figure within max(10%, half the spread) is "ok"), once
at the calibration's bandwidth and once priced at the real runs' bandwidth (``at_run_bandwidth``) as
``experiments.validate use_run_bandwidth=true`` prices it: the calibration's, scaled by how fast each
run's own weights read around it against the calibration's (what the calls stream; a fresh
buffer's stamp can be further off what they saw: docs/architecture.md), the fresh buffer's stamp
where the two cannot be compared (a profile calibrated in another dtype). The profile's own model
shows the empirical and the physical model side by side.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.physical import PhysicalCostModel, at_run_bandwidth  # noqa: E402
from calibration.roofline import MemoryStamp  # noqa: E402
from engine.core.config import ModelConfig, SchedulerConfig  # noqa: E402
from engine.core.request import Request  # noqa: E402
from engine.observe.workload import WorkloadConfig, generate, make_requests  # noqa: E402
from experiments.report_table import format_table  # noqa: E402
from experiments.validate import placed_gb_s, row_passes  # noqa: E402
from sim.executors import CostModelExecutor  # noqa: E402
from sim.run import load_cost_model, saturation_rate  # noqa: E402
from sim.simulator import simulate  # noqa: E402

METRICS = (("thr", lambda m: m["output_throughput_tok_s"]), ("ttft_p50", lambda m: m["ttft_s"]["p50"]),
           ("e2e_p50", lambda m: m["e2el_s"]["p50"]), ("e2e_p99", lambda m: m["e2el_s"]["p99"]))
TOLERANCE = 0.10  # the end-to-end target


def per_call_errors(cost, steps) -> np.ndarray:
    """|predicted − measured| / measured of every model call of a real run."""
    return np.asarray([abs(cost.predict(s.plan) - s.model_s) / s.model_s for s in steps])


def sim_metrics(cost, real, scheduler: SchedulerConfig) -> dict:
    replay = [Request(r.request_id, range(r.prompt_tokens), r.output_tokens, arrival_s=r.arrival_s)
              for r in real.records]
    return simulate(replay, scheduler, lambda: CostModelExecutor(cost)).metrics()


def run_model(name: str, dtype: str, profile: str, load: float, poisson_requests: int, max_num_seqs: int,
              repeats: int) -> list:
    from engine.llm_engine import Engine
    from engine.model.runner import ModelRunner

    model = ModelConfig(name=name, dtype=dtype, device="cpu")
    costs = {"physical": load_cost_model(profile, model, physical=True)}
    own = costs["physical"].info.get("transfer") is None
    if own:
        costs["empirical"] = load_cost_model(profile, model)
        if isinstance(costs["empirical"], PhysicalCostModel):  # preferred physical: the empirical one by hand
            from calibration.cost_model import CostModel
            costs["empirical"] = CostModel.load(profile)
    scheduler = SchedulerConfig(name="continuous", max_num_seqs=max_num_seqs)
    seed = WorkloadConfig()
    mu = saturation_rate(costs["physical"], scheduler, seed)
    rows = [("seed_burst", seed),
            (f"poisson@{load:g}", replace(seed, arrival="poisson", rate=load * mu, num_requests=poisson_requests))]
    runner = ModelRunner(model, scheduler)
    engine = Engine(scheduler, model, runner=runner)
    out = []
    for row, workload in rows:
        reals, stamps = [], []
        for _ in range(repeats):
            engine.reset(scheduler)
            engine.warmup()
            with MemoryStamp(runner.device, runner.decode_weights()) as memory:
                reals.append(engine.run(make_requests(generate(workload), vocab_size=runner.vocab_size,
                                                      seed=workload.seed)))
            # validate's use_run_bandwidth=true (run_bandwidth=weights): the calibration's bandwidth
            # scaled by this run's weights' read rate over the calibration's; the fresh buffer's stamp
            # where the two cannot be compared (no stamp, or a profile in another dtype)
            placed = placed_gb_s(costs["physical"], {"weights_gb_s": memory.weights_gb_s})
            stamps.append(memory.gb_s if placed is None else placed)
        real_ms = [real.metrics() for real in reals]
        run_gb_s = statistics.median(stamps)
        steps = [s for real in reals for s in real.steps]
        for kind, cost in costs.items():
            for priced in ("calibration", "run"):
                if priced == "run" and kind != "physical":
                    continue
                c = at_run_bandwidth(cost, run_gb_s) if priced == "run" else cost
                errs = per_call_errors(c, steps)
                sim_m = sim_metrics(c, reals[0], scheduler)  # every repeat serves the same arrivals
                rec = {"model": name, "row": row, "cost": kind + (" @run GB/s" if priced == "run" else ""),
                       "calls": len(reals[0].steps), "repeats": repeats, "call_median": float(np.median(errs)),
                       "call_worst": float(errs.max()), "run_gb_s": run_gb_s, "run_gb_s_runs": stamps,
                       "calibration_gb_s": cost.memory_read_gb_s}
                for metric, read in METRICS:
                    values = [read(m) for m in real_ms]
                    median = statistics.median(values)
                    # validate's rule: within max(tolerance, half the real spread) of the real median
                    rec[metric], _, rec[metric + "_ok"] = row_passes(read(sim_m), values, TOLERANCE)
                    rec[metric + "_real"] = median
                    rec[metric + "_half_spread"] = (max(values) - min(values)) / 2 / median  # shown beside it
                out.append(rec)
        print(f"  {name} {row}: real {statistics.median(m['output_throughput_tok_s'] for m in real_ms):.2f} tok/s "
              f"(median of {repeats}), {len(reals[0].steps)} calls, priced at {min(stamps):.0f}-{max(stamps):.0f} GB/s",
              flush=True)
    del engine, runner
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--models", default="qwen2_5_0_5b,qwen2_5_1_5b,qwen3_0_6b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load", type=float, default=0.6)
    ap.add_argument("--poisson-requests", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="real runs per row (their median is compared)")
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args()
    records = []
    for name in args.models.split(","):
        records += run_model(name, args.dtype, args.profile, args.load, args.poisson_requests, args.max_num_seqs,
                             args.repeats)
    def cell(r: dict, metric: str) -> str:  # error against the real median, ± half the real spread
        return (f"{100 * r[metric]:+.1f}% ±{100 * r[metric + '_half_spread']:.0f}"
                + ("" if r[metric + "_ok"] else " !"))

    print(format_table(
        ["model", "row", "cost model", "calls", "call med", "call worst", "thr", "TTFT p50", "E2E p50", "E2E p99",
         "GB/s run/cal"],
        [[r["model"], r["row"], r["cost"], r["calls"], f"{100 * r['call_median']:.1f}%",
          f"{100 * r['call_worst']:.1f}%", *(cell(r, m) for m, _ in METRICS),
          f"{r['run_gb_s']:.0f}/{r['calibration_gb_s']:.0f}"] for r in records]))
    ok = sum(r[m + "_ok"] for r in records for m, _ in METRICS)
    print(f"end to end within max({TOLERANCE:.0%}, half the real spread): {ok} of {len(records) * len(METRICS)} "
          f"(! marks the others); errors against the median of {args.repeats} real runs per row")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
