"""Model-call time against this machine's limit, per call shape, in fp32 and bf16.

Each call's roofline time is max(bytes moved / bandwidth, FLOPs / matmul throughput)
(calibration.roofline). The limit is probed beside every call, not once: on a shared VM the
memory bandwidth the host leaves moves between spells of seconds to minutes (36-66 GB/s within a
quarter of an hour on one machine; single decode calls 44-68 ms within ten seconds on another), so
a limit measured away from a call says little about it. For each shape, ``--pairs`` times: one
bandwidth probe, one matmul probe, two calls; each pair gives the second call / roofline at that
pair's probes, and ``paired`` is the median of those ratios with its interquartile range (a spell
slows the probe beside the call as it slows the call, so their ratio keeps the kernel's share).
The second call is the one a server runs, after another call: the probes (a 512 MB read, large
matmuls) leave the caches and TLBs to themselves, and the first call after them pays to fill them
again (docs/architecture.md has the figures); its ratio is printed beside, as ``1st``. ``best``
sets the fastest call against the fastest probes of the shape's pairs: both free of noise (noise
here only adds time), the kernel against the machine undisturbed. A single probe can itself land in a
slow moment, so a pair's ratio may fall below 1 (its probe read slow); the median over the pairs
is what holds still from run to run. Issue #7's fixed figures (21 GB/s;
210 GFLOP/s fp32, 750 bf16) are shown beside them. Before the shapes it prints the read rate of
this process's own decode weights beside a fresh buffer's of their dtype: a process whose weights
landed in slower memory decodes slower for its whole life, which the probes do not see
(docs/architecture.md).

Then one profiled pass per shape splits the call: linears (oneDNN or miniserve's gemv, the gate/up
product with its activation, gate_up_silu, among them), attention (miniserve's decode attention,
SDPA) and the rest (norms, rotary, activations where not in the product, KV writes, sampling,
Python between them), with the rate the linears reached. That split says which kernel keeps a shape off its roofline.

    flock /tmp/miniserve-bench.lock python benchmarks/roofline_calls.py [--dtypes float32,bfloat16] [--pairs 15]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field

import sys
from pathlib import Path

import torch
from calls import shape_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.roofline import (BandwidthProbe, Machine, ModelShape, MatmulProbe, call_work, fresh_like_gb_s,
                                  roofline_s, tensors_read_gb_s)
from engine.core.config import ModelConfig, SchedulerConfig
from engine.model.runner import ModelRunner
from engine.core.plan import BatchPlan

CTX = 256  # decode context per request
SHAPES = {  # name: (prior context per request, tokens per request)
    "decode B=1": ([CTX], [1]),
    "decode B=8": ([CTX] * 8, [1] * 8),
    "decode B=32": ([CTX] * 32, [1] * 32),
    "prefill 128": ([0], [128]),
    "prefill 512": ([0], [512]),
}
ISSUE_MACHINE = {"float32": Machine(21e9, 210e9), "bfloat16": Machine(21e9, 750e9)}  # issue #7's figures
LINEAR_OPS = ("mkldnn::_linear_pointwise", "miniserve::gemv", "miniserve::gate_up_silu", "aten::addmm", "aten::mm")
ATTENTION_OPS = ("miniserve::decode_attention",)  # and SDPA's ops, by name
CUDA_ATTENTION_OPS = ("aten::scaled_dot_product_attention",)  # and flash-attn's, where installed


@dataclass
class Pairs:
    """One shape's (probe, call) pairs: the machine probed, then the seconds of the call right after
    the probes and of the one after that (the call a server runs, after another)."""

    calls_s: list[float]  # the second call after each pair's probes
    machines: list[Machine]
    first_calls_s: list[float] = field(default_factory=list)  # the call right after the probes

    def ratios(self, plan: BatchPlan, shape: ModelShape, calls_s: list[float] | None = None) -> list[float]:
        return [t / roofline_s(plan, shape, m) for t, m in zip(self.calls_s if calls_s is None else calls_s, self.machines)]

    def paired(self, plan: BatchPlan, shape: ModelShape) -> tuple[float, float, float]:
        """The median of call / roofline over the pairs, and its quartiles (within the data)."""
        q1, q2, q3 = statistics.quantiles(self.ratios(plan, shape), n=4, method="inclusive")
        return q2, q1, q3

    def first_after_probes(self, plan: BatchPlan, shape: ModelShape) -> float:
        """The median ratio of the calls that came right after the probes."""
        return statistics.median(self.ratios(plan, shape, self.first_calls_s))

    def best(self, plan: BatchPlan, shape: ModelShape) -> float:
        """The fastest call against the fastest bandwidth and the fastest matmul probed (each may
        come from a different pair: both are the machine's limit)."""
        fastest = Machine(max(m.bandwidth_bytes_s for m in self.machines), max(m.matmul_flops_s for m in self.machines))
        return min(self.calls_s) / roofline_s(plan, shape, fastest)


def time_pairs(runner: ModelRunner, plan: BatchPlan, reqs, memory: BandwidthProbe, matmul: MatmulProbe,
               pairs: int) -> Pairs:
    out = Pairs([], [])
    for _ in range(pairs):
        out.machines.append(Machine(memory.measure(1), matmul.measure(1)))
        out.first_calls_s.append(runner.execute(plan, reqs).duration_s)
        out.calls_s.append(runner.execute(plan, reqs).duration_s)
    return out


def split_call(runner: ModelRunner, plan: BatchPlan, reqs) -> tuple[float, float, float]:
    """(linears, attention, total) seconds of one profiled call; the profiler's first call pays
    for its own start, so the second of two is the one measured. On CUDA the parts are kernels'
    device time: a linear's own (its GEMM), attention's inclusive (SDPA's math fallback runs its
    kernels under child ops)."""
    on_cuda = runner.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    for _ in range(2):
        with torch.profiler.profile(activities=activities) as prof:
            total = runner.execute(plan, reqs).duration_s
    linear = attention = 0.0
    for e in prof.key_averages():
        if on_cuda:
            if e.key in LINEAR_OPS:
                linear += e.self_device_time_total / 1e6
            elif e.key in CUDA_ATTENTION_OPS or e.key.startswith("flash_attn"):
                attention += e.device_time_total / 1e6
        elif e.key in LINEAR_OPS:
            linear += e.self_cpu_time_total / 1e6
        elif e.key in ATTENTION_OPS or "scaled_dot_product" in e.key:
            attention += e.self_cpu_time_total / 1e6
    return linear, attention, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or mps (model.device)")
    ap.add_argument("--pairs", type=int, default=15, help="(probe, call) pairs per shape")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names from: " + ", ".join(SHAPES))
    args = ap.parse_args()
    if args.pairs < 2:
        ap.error("--pairs must be at least 2 (the paired ratio has quartiles)")
    shapes = {n: SHAPES[n] for n in (s.strip() for s in args.shapes.split(",")) if n}
    torch.set_num_threads(args.threads)
    print(f"device={args.device}, threads={torch.get_num_threads()}; {args.pairs} (probe, call) pairs per shape")
    worst: dict[str, float] = {}
    for d in args.dtypes.split(","):
        dtype = getattr(torch, d)
        runner = ModelRunner(ModelConfig(name=args.model, dtype=d, num_threads=args.threads, device=args.device),
                             SchedulerConfig(max_num_seqs=32, max_model_len=1024))
        shape = ModelShape.of(runner.model)
        # the memory and the matmuls the calls use
        probe = BandwidthProbe(dtype, device=runner.device)
        matmul = MatmulProbe(dtype, runner.device)

        # the decode weights' own read rate beside a fresh buffer's of their dtype: on a VM a process's
        # weights can land in slower memory for its whole life, its decode calls with them (docs/architecture.md)
        weights = runner.decode_weights()
        placed = tensors_read_gb_s(weights, device=runner.device)
        print(f"\n{d}: this process's decode weights read at "
              + ("n/a (not stamped)" if placed is None else
                 f"{placed:.1f} GB/s, a fresh buffer of theirs at {fresh_like_gb_s(weights, runner.device):.1f}"),
              flush=True)
        issue = ISSUE_MACHINE.get(d) if runner.device.type == "cpu" else None  # a CPU's figures
        print(f"{d}: {'shape':12s} {'meas ms':>8s} {'probe GB/s':>11s} {'GFLOP/s':>8s} {'roof ms':>8s} {'bound':>7s} "
              f"{'paired [p25-p75]':>18s} {'best':>5s} {'1st':>5s}" + (f" {'issue roof':>10s} {'meas/issue':>10s}" if issue else ""),
              flush=True)
        splits = {}
        for name, (contexts, chunks) in shapes.items():
            plan, reqs = shape_plan(runner, contexts, chunks, name.replace(" ", "_"))
            for _ in range(2):
                runner.execute(plan, reqs)  # warm this shape
            pairs = time_pairs(runner, plan, reqs, probe, matmul, args.pairs)
            ratio, q1, q3 = pairs.paired(plan, shape)
            best = pairs.best(plan, shape)
            t = statistics.median(pairs.calls_s)
            m = Machine(statistics.median(p.bandwidth_bytes_s for p in pairs.machines),
                        statistics.median(p.matmul_flops_s for p in pairs.machines))
            nbytes, flops = call_work(plan, shape)
            bound = "memory" if nbytes / m.bandwidth_bytes_s >= flops / m.matmul_flops_s else "compute"
            bws = [p.bandwidth_bytes_s / 1e9 for p in pairs.machines]
            row = (f"{d}: {name:12s} {1e3 * t:8.1f} {min(bws):5.0f}-{max(bws):<5.0f} {m.matmul_flops_s / 1e9:8.0f} "
                   f"{1e3 * roofline_s(plan, shape, m):8.1f} {bound:>7s} {ratio:6.2f} [{q1:4.2f}-{q3:4.2f}] {best:5.2f} "
                   f"{pairs.first_after_probes(plan, shape):5.2f}")
            worst[f"paired_{d}"] = max(worst.get(f"paired_{d}", 0.0), ratio)
            worst[f"best_{d}"] = max(worst.get(f"best_{d}", 0.0), best)
            if issue:
                worst[f"issue_{d}"] = max(worst.get(f"issue_{d}", 0.0), t / roofline_s(plan, shape, issue))
                row += f" {1e3 * roofline_s(plan, shape, issue):10.1f} {t / roofline_s(plan, shape, issue):10.2f}"
            print(row, flush=True)
            if runner.device.type in ("cpu", "cuda"):  # MPS: the profiler's regions are logical
                splits[name] = (plan, split_call(runner, plan, reqs))
            runner.free(plan.request_ids)
        probe.close()
        del runner
        if not splits:
            continue
        print(f"\n{d}: where a call's time goes (one profiled call; the profiler adds a little to 'rest')")
        print(f"{d}: {'shape':12s} {'linears':>8s} {'attention':>10s} {'rest':>6s}   linears' own rate")
        for name, (plan, (linear, attention, total)) in splits.items():
            weight_bytes = shape.weight_bytes(plan.num_samples > 0)
            linear_flops = shape.linear_flops(plan.total_tokens, plan.num_samples)
            rest = max(0.0, total - linear - attention)
            print(f"{d}: {name:12s} {linear / total:8.0%} {attention / total:10.0%} {rest / total:6.0%}   "
                  + (f"{weight_bytes / linear / 1e9:5.1f} GB/s of weights, {linear_flops / linear / 1e9:5.0f} GFLOP/s"
                   if linear > 0 else "n/a (no linear op timed)"),
                  flush=True)
    print("\n" + " ".join(f"worst_meas_over_roofline_{k}={w:.3f}" for k, w in worst.items()))


if __name__ == "__main__":
    main()
