"""miniserve's fused layer ops (engine/model/kernels/layer_ops.cpp) against the stock torch ops they
replace, in one process: whole model calls through ModelRunner with the fused ops switched off and
on call by call (benchmarks/calls.py), decode B=1, 8, 32 at context 256 and a 128-token prefill.
Where the gemv runs the gate/up product, SiLU·up is made inside it on both arms (gate_up_silu), so
the arms differ by the norms and the rotary there.

    flock /tmp/miniserve-bench.lock python benchmarks/layer_ops.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations


import torch
from calls import MODEL_CALL_SHAPES, alternate, bench_runner, kernel_bench_args

from engine.model import kernels
from engine.model.runner import ModelRunner



def model_calls(runner: ModelRunner, fused: kernels.LayerOps, dtype_name: str, repeats: int) -> list[str]:
    lean = runner._lean
    lean.stack = None  # the Python loop on both arms: the fused ops' effect alone

    def switch(on: bool) -> None:
        lean.ops = fused if on else kernels.TORCH_LAYER_OPS

    last = []
    for name, contexts, chunks in MODEL_CALL_SHAPES:
        ab = alternate(runner, contexts, chunks, switch, repeats)
        print(ab.line(name, "torch ops", "fused"), flush=True)
        if name in ("decode B=1", "decode B=32"):
            last.append(f"layer_ops_speedup_{name.replace('decode ', '').replace('=', '')}_{dtype_name}={ab.speedup:.2f}")
    return last


def main() -> None:
    args = kernel_bench_args(__doc__)
    last = []
    for d in args.dtypes.split(","):
        fused = kernels.layer_ops(getattr(torch, d))
        if fused is None:
            print(f"{d}: no fused layer ops on this machine (needs AVX-512 and a C++ compiler); the engine runs torch's")
            continue
        runner = bench_runner(args, d)
        print(f"{d}: model calls, torch ops / fused ops alternating (threads={torch.get_num_threads()})")
        last += model_calls(runner, fused, d, args.repeats)
        del runner
    print(" ".join(last))


if __name__ == "__main__":
    main()
