"""Model-call time against this machine's limit, per call shape, in fp32 and bf16.

The machine's memory bandwidth and matmul throughput give each call's roofline time
(calibration.roofline: max(bytes moved / bandwidth, FLOPs / matmul throughput)). Each is the best
of two probes: calibration.roofline.measure_machine (torch matmul) and the same shapes through
oneDNN's pre-packed linear. Bandwidth is a property of the memory, not of the dtype, so the best
over dtypes is used for both. Prints median measured time per shape and measured/roofline (target ≤ 1.3).

    flock /tmp/miniserve-bench.lock python benchmarks/roofline_calls.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from calibration.roofline import Machine, ModelShape, best_s, call_work, measure_machine, roofline_s
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


@torch.inference_mode()
def measure_packed(dtype: torch.dtype, mem_bytes: int = 512 << 20) -> Machine:
    """The same two probes through oneDNN's pre-packed linear (what the engine runs): torch's
    plain matrix-vector product reads memory slower than this machine can, so it understates the
    limit."""
    def packed(m: int, k: int, n: int) -> float:
        w, x = torch.randn(n, k, dtype=dtype), torch.randn(m, k, dtype=dtype)
        pw = torch.ops.mkldnn._reorder_linear_weight(w, m)
        return best_s(lambda: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], ""))

    esize = torch.empty((), dtype=dtype).element_size()
    rows = mem_bytes // esize // 896
    bandwidth = rows * 896 * esize / packed(1, 896, rows)
    flops = max(2 * m * k * n / packed(m, k, n) for m, k, n in ((256, 896, 4864), (512, 4864, 896),
                                                                    (1024, 1024, 1024)))
    return Machine(bandwidth, flops)


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
    machines = {}
    for d in dtypes:
        probes = {"torch": measure_machine(getattr(torch, d)), "oneDNN packed": measure_packed(getattr(torch, d))}
        for how, m in probes.items():
            print(f"{d} ({how}): bandwidth {m.bandwidth_bytes_s / 1e9:.1f} GB/s, "
                  f"matmul {m.matmul_flops_s / 1e9:.0f} GFLOP/s")
        machines[d] = Machine(max(m.bandwidth_bytes_s for m in probes.values()),
                              max(m.matmul_flops_s for m in probes.values()))
    bandwidth = max(m.bandwidth_bytes_s for m in machines.values())
    print(f"roofline: bandwidth {bandwidth / 1e9:.1f} GB/s (best probe, any dtype), matmul the best probe per "
          f"dtype; threads={torch.get_num_threads()}")
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
