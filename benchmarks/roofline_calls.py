"""Model-call time against this machine's limit, per call shape, in fp32 and bf16.

Each call's roofline time is max(bytes moved / bandwidth, FLOPs / matmul throughput)
(calibration.roofline). Two machines are used side by side:
- probe: this machine measured in this run (calibration.roofline.measure_machine: the fastest of
  torch and oneDNN-packed probes, each best of several repeats). Bandwidth is a property of the
  memory, not of the dtype, so the best over dtypes and over two probe rounds (before and after the
  model calls, so a slow spell on a shared host does not lower the limit) is used for both.
- issue: the figures issue #7 states for this machine (21 GB/s; 210 GFLOP/s fp32, 750 bf16).
Prints the median measured time per shape and measured/roofline against each (target ≤ 1.3).

    flock /tmp/miniserve-bench.lock python benchmarks/roofline_calls.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from calibration.roofline import Machine, ModelShape, call_work, measure_machine, roofline_s
from engine.config import ModelConfig, SchedulerConfig
from engine.model_runner import ModelRunner
from engine.plan import BatchPlan
from engine.request import Request

CTX = 256  # decode context per request
SHAPES = {  # name: (prior context per request, tokens per request)
    "decode B=1": ([CTX], [1]),
    "decode B=8": ([CTX] * 8, [1] * 8),
    "decode B=32": ([CTX] * 32, [1] * 32),
    "prefill 128": ([0], [128]),
    "prefill 512": ([0], [512]),
}
ISSUE_MACHINE = {"float32": Machine(21e9, 210e9), "bfloat16": Machine(21e9, 750e9)}  # issue #7's figures


def shape_plan(runner: ModelRunner, contexts: list[int], chunks: list[int], tag: str):
    """A plan over requests whose first ``context`` tokens already sit in the runner's KV slots."""
    reqs = {}
    for i, (ctx, n) in enumerate(zip(contexts, chunks)):
        r = Request(f"{tag}{i}", [(i * 31 + j) % 1000 + 1 for j in range(ctx + n + 1)], 4)
        reqs[r.request_id] = r
    ids = tuple(reqs)
    if any(contexts):
        runner.execute(BatchPlan("continuous", ids, tuple(contexts), (0,) * len(ids), (False,) * len(ids), 0), reqs)
    nd = sum(1 for n in chunks if n == 1)
    return BatchPlan("continuous", ids, tuple(chunks), tuple(contexts), (True,) * len(ids), nd), reqs


def measure(runner: ModelRunner, plan: BatchPlan, reqs, repeats: int) -> float:
    for _ in range(2):
        runner.execute(plan, reqs)  # warm this shape
    return statistics.median(runner.execute(plan, reqs).duration_s for _ in range(repeats))


def probe(dtypes: list[str], repeats: int) -> dict[str, Machine]:
    machines = {d: measure_machine(getattr(torch, d), repeats) for d in dtypes}
    for d, m in machines.items():
        print(f"  probe {d}: bandwidth {m.bandwidth_bytes_s / 1e9:.1f} GB/s, matmul {m.matmul_flops_s / 1e9:.0f} GFLOP/s",
              flush=True)
    return machines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",")
    print(f"threads={torch.get_num_threads()}; machine probes before the model calls:")
    rounds = [probe(dtypes, args.repeats)]
    measured: dict[str, dict[str, tuple[BatchPlan, ModelShape, float]]] = {}
    for d in dtypes:
        runner = ModelRunner(ModelConfig(name=args.model, dtype=d, num_threads=args.threads),
                             SchedulerConfig(max_num_seqs=32, max_model_len=1024))
        shape = ModelShape.of(runner.model)
        measured[d] = {}
        for name, (contexts, chunks) in SHAPES.items():
            plan, reqs = shape_plan(runner, contexts, chunks, name.replace(" ", "_"))
            measured[d][name] = (plan, shape, measure(runner, plan, reqs, args.repeats))
            runner.free(plan.request_ids)
        del runner
    print("machine probes after the model calls:")
    rounds.append(probe(dtypes, args.repeats))
    bandwidth = max(m[d].bandwidth_bytes_s for m in rounds for d in dtypes)
    print(f"probe limit: bandwidth {bandwidth / 1e9:.1f} GB/s (best of both rounds, any dtype); matmul " + ", ".join(
        f"{d} {max(m[d].matmul_flops_s for m in rounds) / 1e9:.0f} GFLOP/s" for d in dtypes))
    print("issue #7 figures: bandwidth 21.0 GB/s; matmul " + ", ".join(
        f"{d} {ISSUE_MACHINE[d].matmul_flops_s / 1e9:.0f} GFLOP/s" for d in dtypes if d in ISSUE_MACHINE))
    worst: dict[str, float] = {}
    for d in dtypes:
        machines = {"probe": Machine(bandwidth, max(m[d].matmul_flops_s for m in rounds))}
        if d in ISSUE_MACHINE:
            machines["issue"] = ISSUE_MACHINE[d]
        print(f"\n{d}: {'shape':12s} {'measured ms':>12s}" + "".join(
            f" {k + ' roof ms':>14s} {'bound':>8s} {'meas/roof':>10s}" for k in machines))
        for name, (plan, shape, t) in measured[d].items():
            nbytes, flops = call_work(plan, shape)
            row = f"{d}: {name:12s} {1e3 * t:12.1f}"
            for k, m in machines.items():
                roof = roofline_s(plan, shape, m)
                bound = "memory" if nbytes / m.bandwidth_bytes_s >= flops / m.matmul_flops_s else "compute"
                worst[f"{k}_{d}"] = max(worst.get(f"{k}_{d}", 0.0), t / roof)
                row += f" {1e3 * roof:14.1f} {bound:>8s} {t / roof:10.2f}"
            print(row, flush=True)
    print("\n" + " ".join(f"worst_meas_over_roofline_{k}={w:.2f}" for k, w in worst.items()))


if __name__ == "__main__":
    main()
