"""Transfer: a profile calibrated on one model predicts other models' calls and runs.

    flock /tmp/miniserve-bench.lock python benchmarks/transfer.py --profile P.json \
        [--models qwen2_5_0_5b,qwen2_5_1_5b,qwen3_0_6b] [--dtype bfloat16] [--load 0.6] [--poisson-requests 16] \
        [--repeats 3]

Every model is built first (seeded random weights of its real shape; the profile's own model in
the profile's dtype is always among them; all held at once: bf16 0.5B + Qwen3-0.6B + 1.5B ~6 GB of
weights, fp32 twice that); then, ``--repeats`` times, each row (the seed burst and
one Poisson row at ``--load`` × that model's simulated saturation rate) is served by the real
continuous engine on every model in turn, so the models' runs of one row and repeat lie seconds
apart. The simulator replays the same arrivals with the profile's cost model — for another model
than the profile's, the physical model transferred to that shape. Printed per model and row:
per-call error on every real call of the repeats (median, worst) and sim-vs-real throughput, TTFT
p50, E2E p50/p99 against the real runs' median, with half their spread beside it (a figure within
max(10%, half the spread) is "ok"), priced three ways:

- at the calibration's bandwidth (``physical``; the profile's own model also ``empirical``);
- ``@run GB/s``: at the bandwidth the runs' own weights stamps place them at, as ``experiments.validate
  use_run_bandwidth=true`` prices a row (the calibration's, scaled by how fast each run's weights
  read around it against the calibration's; the fresh buffer's stamp across dtypes);
- ``@its calls``: each repeat at the bandwidth fitted to that run's own calls' total
  (calibration.noise.calls_gb_s, as ``validate run_bandwidth=calls``), the simulation at their
  median. On this kind of VM the host's memory moves by 1.5× within seconds, more than any transfer
  error, and two stamps around a run cannot place it; fitted, one number per run, the level is no
  longer tested (throughput nearly fits by construction) but the per-call error is then how well
  the model prices one call against another: on the profile's own model that is the calls' own
  noise, the floor for every model's, and a transferred model's distance above it is the transfer's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.noise import calls_gb_s  # noqa: E402
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


def sim_metrics(cost, requests: list[Request], scheduler: SchedulerConfig) -> dict:
    """The simulation of a real run's own requests (fresh copies: arrivals, lengths and prompt ids)."""
    replay = [Request(r.request_id, r.prompt_token_ids, r.max_tokens, arrival_s=r.arrival_s) for r in requests]
    return simulate(replay, scheduler, lambda: CostModelExecutor(cost)).metrics()


@dataclass
class Subject:
    """One model under test: its cost models, engine and rows (name, workload)."""

    name: str
    dtype: str
    costs: dict
    runner: object
    engine: object
    rows: list
    runs: dict = field(default_factory=dict)  # (row, repeat) -> (RunResult, weights-placed GB/s, calls' GB/s)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.dtype})"


def build(name: str, dtype: str, profile: str, load: float, poisson_requests: int,
          scheduler: SchedulerConfig) -> Subject:
    from engine.llm_engine import Engine
    from engine.model.runner import ModelRunner

    model = ModelConfig(name=name, dtype=dtype, device="cpu")
    costs = {"physical": load_cost_model(profile, model, physical=True)}
    if costs["physical"].info.get("transfer") is None:  # the profile's own model and dtype
        costs["empirical"] = load_cost_model(profile, model)
        if isinstance(costs["empirical"], PhysicalCostModel):  # preferred physical: the empirical one by hand
            from calibration.cost_model import CostModel
            costs["empirical"] = CostModel.load(profile)
    seed = WorkloadConfig()
    mu = saturation_rate(costs["physical"], scheduler, seed)
    rows = [("seed_burst", seed),
            (f"poisson@{load:g}", replace(seed, arrival="poisson", rate=load * mu, num_requests=poisson_requests))]
    runner = ModelRunner(model, scheduler)
    return Subject(name, dtype, costs, runner, Engine(scheduler, model, runner=runner), rows)


def serve(subject: Subject, row: int, repeat: int, scheduler: SchedulerConfig) -> None:
    """One real run of ``row`` on ``subject``, stamped by its weights and by its calls."""
    _, workload = subject.rows[row]
    engine, runner, physical = subject.engine, subject.runner, subject.costs["physical"]
    engine.reset(scheduler)
    engine.warmup()
    with MemoryStamp(runner.device, runner.decode_weights()) as memory:
        real = engine.run(make_requests(generate(workload), vocab_size=runner.vocab_size, seed=workload.seed))
    placed = placed_gb_s(physical, {"weights_gb_s": memory.weights_gb_s})
    subject.runs[row, repeat] = (real, memory.gb_s if placed is None else placed,
                                 calls_gb_s(physical, [(s.plan, s.model_s) for s in real.steps]))


def records_of(subject: Subject, scheduler: SchedulerConfig, repeats: int) -> list[dict]:
    out = []
    for row, (row_name, workload) in enumerate(subject.rows):
        reals = [subject.runs[row, k][0] for k in range(repeats)]
        # every repeat served these (serve makes them the same way)
        requests = make_requests(generate(workload), vocab_size=subject.runner.vocab_size, seed=workload.seed)
        real_ms = [real.metrics() for real in reals]
        stamps = [subject.runs[row, k][1] for k in range(repeats)]
        fitted = [subject.runs[row, k][2] for k in range(repeats)]  # None where no bandwidth fits its calls
        for kind, cost in subject.costs.items():
            for priced in ("calibration", "run", "calls"):
                if priced != "calibration" and kind != "physical":
                    continue
                if priced == "calls" and None in fitted:
                    continue
                # per call at each repeat's own price; the simulation at the repeats' median
                per_repeat = {"calibration": [cost] * repeats,
                              "run": [at_run_bandwidth(cost, statistics.median(stamps))] * repeats,
                              "calls": [at_run_bandwidth(cost, b) for b in fitted]}[priced]
                c = per_repeat[0] if priced != "calls" else at_run_bandwidth(cost, statistics.median(fitted))
                errs = np.concatenate([per_call_errors(cr, real.steps) for cr, real in zip(per_repeat, reals)])
                sim_m = sim_metrics(c, requests, scheduler)
                label = {"calibration": "", "run": " @run GB/s", "calls": " @its calls"}[priced]
                rec = {"model": subject.label, "row": row_name, "cost": kind + label, "calls": len(reals[0].steps),
                       "repeats": repeats, "call_median": float(np.median(errs)), "call_worst": float(errs.max()),
                       "priced_gb_s": c.memory_read_gb_s, "run_gb_s_runs": stamps, "calls_gb_s_runs": fitted,
                       "calibration_gb_s": cost.memory_read_gb_s}
                for metric, read in METRICS:
                    values = [read(m) for m in real_ms]
                    # validate's rule: within max(tolerance, half the real spread) of the real median
                    rec[metric], _, rec[metric + "_ok"] = row_passes(read(sim_m), values, TOLERANCE)
                    rec[metric + "_real"] = statistics.median(values)
                    rec[metric + "_half_spread"] = (max(values) - min(values)) / 2 / statistics.median(values)
                out.append(rec)
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
    scheduler = SchedulerConfig(name="continuous", max_num_seqs=args.max_num_seqs)
    info = json.loads(Path(args.profile).read_text()).get("model", {})
    if not info.get("name"):
        raise SystemExit(f"{args.profile} names no model: calibrate again (python -m experiments.calibrate)")
    own = (info["name"], info.get("dtype", "float32"))
    wanted = [(name, args.dtype) for name in args.models.split(",")]
    subjects = [build(name, dtype, args.profile, args.load, args.poisson_requests, scheduler)
                for name, dtype in ([own] if own not in wanted else []) + wanted]
    for repeat in range(args.repeats):  # every model's run of a row and repeat close together in time
        for row in range(len(subjects[0].rows)):  # the seed burst, the Poisson row
            for subject in subjects:
                serve(subject, row, repeat, scheduler)
                real, placed, called = subject.runs[row, repeat]
                print(f"  {subject.label} {subject.rows[row][0]} #{repeat}: {real.metrics()['output_throughput_tok_s']:.2f} "
                      f"tok/s, {len(real.steps)} calls; weights place it at {placed:.0f} GB/s, its calls at "
                      + (f"{called:.0f}" if called else "-"), flush=True)
    records = [rec for subject in subjects for rec in records_of(subject, scheduler, args.repeats)]

    def cell(r: dict, metric: str) -> str:  # error against the real median, ± half the real spread
        return (f"{100 * r[metric]:+.1f}% ±{100 * r[metric + '_half_spread']:.0f}"
                + ("" if r[metric + "_ok"] else " !"))

    print(format_table(
        ["model", "row", "cost model", "calls", "call med", "call worst", "thr", "TTFT p50", "E2E p50", "E2E p99",
         "GB/s priced/cal"],
        [[r["model"], r["row"], r["cost"], r["calls"], f"{100 * r['call_median']:.1f}%",
          f"{100 * r['call_worst']:.1f}%", *(cell(r, m) for m, _ in METRICS),
          f"{r['priced_gb_s']:.0f}/{r['calibration_gb_s']:.0f}"] for r in records]))
    counts = []
    for label, pick in (("as calibrated", lambda c: "@" not in c), ("@run GB/s", lambda c: "@run" in c),
                        ("@its calls", lambda c: "@its calls" in c)):
        mine = [r for r in records if pick(r["cost"])]
        counts.append(f"{label} {sum(r[m + '_ok'] for r in mine for m, _ in METRICS)} of {len(mine) * len(METRICS)}")
    print(f"end to end within max({TOLERANCE:.0%}, half the real spread): {'; '.join(counts)} (! marks the "
          f"others); errors against the median of {args.repeats} real runs per row")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
