"""Model-call time against this machine's limit, per call shape, in fp32 and bf16.

The machine's memory bandwidth and matmul throughput (calibration.roofline.measure_machine) give
each call's roofline time: max(bytes moved / bandwidth, FLOPs / matmul throughput). Bandwidth is
a property of the memory, not of the dtype, so the best of the fp32 and bf16 measurements is used
for both. Prints median measured time per shape and measured/roofline (target ≤ 1.3).

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",")
    machines = {d: measure_machine(getattr(torch, d)) for d in dtypes}
    bandwidth = max(m.bandwidth_bytes_s for m in machines.values())
    for d, m in machines.items():
        print(f"{d}: bandwidth {m.bandwidth_bytes_s / 1e9:.1f} GB/s, matmul {m.matmul_flops_s / 1e9:.0f} GFLOP/s")
    print(f"roofline bandwidth (best of dtypes): {bandwidth / 1e9:.1f} GB/s; threads={torch.get_num_threads()}")
    worst = {}
    for d in dtypes:
        machine = Machine(bandwidth, machines[d].matmul_flops_s)
        runner = ModelRunner(ModelConfig(name=args.model, dtype=d, num_threads=args.threads),
                             SchedulerConfig(max_num_seqs=32, max_model_len=1024))
        shape = ModelShape.of(runner.model)
        print(f"\n{d}: {'shape':12s} {'measured ms':>12s} {'roofline ms':>12s} {'bound':>8s} {'meas/roof':>10s}")
        for name, (contexts, chunks) in SHAPES.items():
            plan, reqs = shape_plan(runner, contexts, chunks, name.replace(" ", "_"))
            t = measure(runner, plan, reqs, args.repeats)
            runner.free(plan.request_ids)
            roof = roofline_s(plan, shape, machine)
            nbytes, flops = call_work(plan, shape)
            bound = "memory" if nbytes / machine.bandwidth_bytes_s >= flops / machine.matmul_flops_s else "compute"
            worst[d] = max(worst.get(d, 0.0), t / roof)
            print(f"{d}: {name:12s} {1e3 * t:12.1f} {1e3 * roof:12.1f} {bound:>8s} {t / roof:10.2f}", flush=True)
        del runner
    print("\n" + " ".join(f"worst_meas_over_roofline_{d}={w:.2f}" for d, w in worst.items()))


if __name__ == "__main__":
    main()
