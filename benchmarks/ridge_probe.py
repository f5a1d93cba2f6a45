"""This machine's own limit for a product that needs its memory and its arithmetic at once (the
roofline's ridge), against miniserve's gemv on the same weights.

At a few rows a decode's products sit near the ridge: streaming the weights and multiplying them
take about as long as each other (a B=8 decode in a fast memory spell: benchmarks/roofline_calls.py),
so the roofline's max(bytes / bandwidth, FLOPs / peak) asks for both probes' peaks at once. Whether
a machine can do that is measured here, not assumed: the ridge loop (benchmarks/ridge_probe.cpp)
streams the model's packed weights once, each thread a contiguous share, and multiplies every
weight vector into R rows' accumulators with the multiplier in a register, the arithmetic of an
R-row product and nothing else. Beside it, in alternation, the engine's gemv passes over the same
panels at R rows (random x; the gate/up products make their SiLU·up, as the engine's do), and the
two probes. One thread and all threads: one core's own
stream is a ridge in any memory spell (it reads at most its share of the machine's bandwidth), so
the one-thread row shows the kernel against the limit even when two threads are memory-bound.

Prints per dtype, threads and rows: the probes, the roofline of the pass, the ridge loop's and the
gemv's time, GFLOP/s (share of the matmul probe) and GB/s, and gemv / ridge (1.0: the kernel at the
machine's limit). Needs AVX2 (fp32, in AVX-512 vectors where the CPU as allowed has them, as the
gemv runs) or AVX512-BF16 (bf16); elsewhere it says so.

    flock /tmp/miniserve-bench.lock python benchmarks/ridge_probe.py [--dtypes float32,bfloat16] [--rows 1,8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.roofline import BandwidthProbe, MatmulProbe
from engine.core.config import ModelConfig, SchedulerConfig
from engine.model.kernels.features import cpu_features
from engine.model.runner import ModelRunner

NEEDS = {"float32": "avx2", "bfloat16": "avx512_bf16"}


def build_probe():
    from torch.utils.cpp_extension import load

    src = Path(__file__).with_name("ridge_probe.cpp")
    return load("miniserve_ridge_probe", [str(src)], extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2, help="the most threads (one thread is measured too)")
    ap.add_argument("--rows", default="1,8", help="rows of the product: from 1, 8, 16")
    ap.add_argument("--repeats", type=int, default=5, help="alternating rounds (ridge, gemv, probes)")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    if any(r not in (1, 8, 16) for r in rows_list) or args.repeats < 1:
        ap.error("--rows from 1, 8, 16; --repeats at least 1")
    unknown = [d for d in args.dtypes.split(",") if d not in NEEDS]
    if unknown:
        ap.error(f"--dtypes from {', '.join(NEEDS)}; got {', '.join(unknown)}")
    features = cpu_features()
    wide = "avx512" in features  # fp32's loop in the vectors the gemv runs in
    probe_mod = None
    ratios = {}
    for d in args.dtypes.split(","):
        if NEEDS[d] not in features:
            print(f"{d}: n/a (the ridge loop needs {NEEDS[d]}; this CPU, as allowed, has {sorted(features)})")
            continue
        dtype = getattr(torch, d)
        torch.set_num_threads(args.threads)
        runner = ModelRunner(ModelConfig(name=args.model, dtype=d, num_threads=args.threads),
                             SchedulerConfig(max_num_seqs=1, max_model_len=64))
        lean = runner._lean
        if lean is None or lean._projector is None:
            print(f"{d}: n/a (the engine does not run every product on its gemv here)")
            continue
        probe_mod = probe_mod or build_probe()
        panels = [p.panels.data for p in lean.projections]
        nbytes = sum(t.numel() * t.element_size() for t in panels)
        for threads in sorted({1, args.threads}):
            torch.set_num_threads(threads)
            memory, matmul = BandwidthProbe(dtype), MatmulProbe(dtype)
            for rows in rows_list:
                g = torch.Generator().manual_seed(rows)
                xs = {p.panels.k: torch.randn(rows, p.panels.k, generator=g).to(dtype) for p in lean.projections}
                flops = sum(2 * rows * p.n * p.panels.k for p in lean.projections)

                def gemv_pass() -> None:  # each product as the engine runs it (gate/up with its SiLU·up)
                    for p in lean.projections:
                        if p.gate_up_inter:
                            lean._gate_up_silu(xs[p.panels.k], p, p.gate_up_inter)
                        else:
                            lean._projector(xs[p.panels.k], p)

                fns = {"ridge": lambda: probe_mod.stream_fma(panels, rows, wide), "gemv": gemv_pass}
                for fn in fns.values():
                    fn()  # warm
                t: dict[str, list[float]] = {"ridge": [], "gemv": [], "bw": [], "peak": []}
                for i in range(args.repeats):
                    t["bw"].append(memory.measure(1))
                    t["peak"].append(matmul.measure(1))
                    for name in (("ridge", "gemv") if i % 2 == 0 else ("gemv", "ridge")):
                        start = time.perf_counter()
                        fns[name]()
                        t[name].append(time.perf_counter() - start)
                m = {k: statistics.median(v) for k, v in t.items()}
                roof = max(nbytes / m["bw"], flops / m["peak"])
                ratio = statistics.median(a / b for a, b in zip(t["gemv"], t["ridge"]))
                line = (f"{d} {threads} thread{'s' if threads > 1 else ''}, {rows:2d} rows: probes "
                        f"{m['bw'] / 1e9:4.1f} GB/s, {m['peak'] / 1e9:4.0f} GFLOP/s; roofline {1e3 * roof:7.1f} ms")
                for name in ("ridge", "gemv"):
                    s = m[name]
                    line += (f"; {name} {1e3 * s:7.1f} ms {flops / s / 1e9:5.0f} GFLOP/s "
                             f"({flops / s / m['peak']:4.0%}) {nbytes / s / 1e9:4.1f} GB/s")
                print(line + f"; gemv/ridge {ratio:.2f}", flush=True)
                ratios[f"gemv_over_ridge_{d}_{threads}t_{rows}r"] = ratio
            memory.close()
        del runner
    print("\n" + " ".join(f"{k}={v:.3f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
