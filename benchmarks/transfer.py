"""Transfer: a profile calibrated on one model predicts other models' calls and runs.

    flock /tmp/miniserve-bench.lock python benchmarks/transfer.py --profile P.json \
        [--models qwen2_5_0_5b,qwen2_5_1_5b,qwen3_0_6b] [--dtype bfloat16] [--load 0.6] [--poisson-requests 16]

For each model: build it (seeded random weights of its real shape), run the seed burst and one
Poisson row (``--load`` × the simulated saturation rate) through the real continuous engine, then
simulate the same arrivals with the profile's cost model — for another model than the profile's,
the physical model transferred to that shape. Prints per-call error on the real calls (median,
worst) and sim-vs-real throughput, TTFT p50, E2E p50/p99, once at the calibration's bandwidth and
once priced at the bandwidth stamped around each real run (``at_run_bandwidth``). The profile's own
model shows the empirical and the physical model side by side.
"""

from __future__ import annotations

import argparse
import gc
import json
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
from sim.executors import CostModelExecutor  # noqa: E402
from sim.run import load_cost_model, saturation_rate  # noqa: E402
from sim.simulator import simulate  # noqa: E402

METRICS = (("thr", lambda m: m["output_throughput_tok_s"]), ("ttft_p50", lambda m: m["ttft_s"]["p50"]),
           ("e2e_p50", lambda m: m["e2el_s"]["p50"]), ("e2e_p99", lambda m: m["e2el_s"]["p99"]))


def per_call_errors(cost, steps) -> np.ndarray:
    """|predicted − measured| / measured of every model call of a real run."""
    return np.asarray([abs(cost.predict(s.plan) - s.model_s) / s.model_s for s in steps])


def sim_metrics(cost, real, scheduler: SchedulerConfig) -> dict:
    replay = [Request(r.request_id, range(r.prompt_tokens), r.output_tokens, arrival_s=r.arrival_s)
              for r in real.records]
    return simulate(replay, scheduler, lambda: CostModelExecutor(cost)).metrics()


def run_model(name: str, dtype: str, profile: str, load: float, poisson_requests: int, max_num_seqs: int) -> list:
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
        engine.reset(scheduler)
        engine.warmup()
        with MemoryStamp() as memory:
            real = engine.run(make_requests(generate(workload), vocab_size=runner.vocab_size, seed=workload.seed))
        real_m = real.metrics()
        for kind, cost in costs.items():
            for priced in ("calibration", "run"):
                if priced == "run" and kind != "physical":
                    continue
                c = at_run_bandwidth(cost, memory.gb_s) if priced == "run" else cost
                errs = per_call_errors(c, real.steps)
                sim_m = sim_metrics(c, real, scheduler)
                rec = {"model": name, "row": row, "cost": kind + (" @run GB/s" if priced == "run" else ""),
                       "calls": len(real.steps), "call_median": float(np.median(errs)), "call_worst": float(errs.max()),
                       "memory_gb_s": memory.gb_s, "calibration_gb_s": cost.memory_read_gb_s}
                for metric, read in METRICS:
                    rec[metric] = (read(sim_m) - read(real_m)) / read(real_m)
                    rec[metric + "_real"] = read(real_m)
                out.append(rec)
        print(f"  {name} {row}: real {real_m['output_throughput_tok_s']:.2f} tok/s, {len(real.steps)} calls, "
              f"memory {memory.gb_s:.0f} GB/s", flush=True)
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
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args()
    records = []
    for name in args.models.split(","):
        records += run_model(name, args.dtype, args.profile, args.load, args.poisson_requests, args.max_num_seqs)
    pct = lambda x: f"{100 * x:+.1f}%"  # noqa: E731
    print(format_table(
        ["model", "row", "cost model", "calls", "call med", "call worst", "thr", "TTFT p50", "E2E p50", "E2E p99",
         "GB/s run/cal"],
        [[r["model"], r["row"], r["cost"], r["calls"], f"{100 * r['call_median']:.1f}%",
          f"{100 * r['call_worst']:.1f}%", pct(r["thr"]), pct(r["ttft_p50"]), pct(r["e2e_p50"]), pct(r["e2e_p99"]),
          f"{r['memory_gb_s']:.0f}/{r['calibration_gb_s']:.0f}"] for r in records]))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
