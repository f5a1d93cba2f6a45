"""bf16 against fp32 model calls on this CPU, timed call by call (benchmarks/calls.py): what
``model.dtype=auto`` decides from.

To see a CPU without AVX512-BF16 on one that has it, mask both users of bf16 instructions:
``MINISERVE_CPU_FEATURES=avx512`` (miniserve's kernels: no bf16 gemv) and
``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` (oneDNN's own dispatch: AVX-512 without its bf16 extensions,
so its bf16 linears widen to fp32). torch's other ops keep what its AVX-512 build does.

    flock /tmp/miniserve-bench.lock env MINISERVE_CPU_FEATURES=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE \\
        python benchmarks/bf16_vs_fp32.py
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from calls import shape_plan, time_alternating
from engine.core.config import ModelConfig, SchedulerConfig
from engine.model.kernels.features import cpu_features
from engine.model.runner import ModelRunner

SHAPES = {  # name: (contexts, chunks)
    "decode B=1": ([128], [1]),
    "decode B=8": ([128] * 8, [1] * 8),
    "prefill 128": ([0], [128]),
    "prefill 512": ([0], [512]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"cpu features (masked): {sorted(cpu_features())}; ONEDNN_MAX_CPU_ISA="
          f"{os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}")
    scheduler = SchedulerConfig(max_num_seqs=8, max_model_len=1024)
    runners = {d: ModelRunner(ModelConfig(name=args.model, dtype=d, device="cpu", num_threads=args.threads),
                              scheduler) for d in ("float32", "bfloat16")}
    print("kernels: " + "; ".join(f"{d} {r.kernels_used()}" for d, r in runners.items()))
    print(f"{'call':12s} {'fp32 ms':>9s} {'bf16 ms':>9s} {'fp32/bf16':>9s}")
    ratios = {}
    for name, (contexts, chunks) in SHAPES.items():
        plans = {d: shape_plan(r, contexts, chunks, f"{d}{name.replace(' ', '')}_") for d, r in runners.items()}
        fns = [lambda d=d: runners[d].execute(*plans[d]) for d in runners]
        fp32, bf16 = time_alternating(fns, args.repeats, warm=2)
        ratio = statistics.median(a / b for a, b in zip(fp32, bf16))
        ratios[name] = ratio
        print(f"{name:12s} {1e3 * statistics.median(fp32):9.1f} {1e3 * statistics.median(bf16):9.1f} {ratio:9.2f}")
        for d, r in runners.items():
            r.free(plans[d][0].request_ids)
    print("bf16_faster=" + ",".join(f"{n.replace(' ', '_')}:{r:.2f}" for n, r in ratios.items()))


if __name__ == "__main__":
    main()
