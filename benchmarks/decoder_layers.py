"""A step's decoder layers as one C++ call (engine/model/kernels/decoder_layers.cpp) against the lean
forward's Python loop over the same kernels, in one process: whole model calls through ModelRunner with
the one-call layers switched off and on call by call (benchmarks/calls.py), decode B=1, 8, 32 at
context 256 and a 128-token prefill. The logits must be the same bits (max |Δlogit| 0).

    flock /tmp/miniserve-bench.lock python benchmarks/decoder_layers.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import torch
from calls import MODEL_CALL_SHAPES, alternate, bench_runner, kernel_bench_args


def main() -> None:
    args = kernel_bench_args(__doc__)
    last = []
    for d in args.dtypes.split(","):
        runner = bench_runner(args, d)
        lean = runner._lean
        stack = None if lean is None else lean.stack
        if stack is None:
            print(f"{d}: no one-call layers on this machine (they need the gemv, the layer ops and the attention "
                  "kernel for this dtype, as dispatched here)")
            continue

        def switch(on: bool) -> None:
            lean.stack = stack if on else None

        print(f"{d}: model calls, Python loop / one call alternating (threads={torch.get_num_threads()})")
        for name, contexts, chunks in MODEL_CALL_SHAPES:
            ab = alternate(runner, contexts, chunks, switch, args.repeats)
            print(ab.line(name, "loop", "one call"), flush=True)
            last.append(f"decoder_layers_speedup_{name.replace(' ', '_').replace('=', '')}_{d}={ab.speedup:.3f}")
        del runner, lean, stack
    print(" ".join(last))


if __name__ == "__main__":
    main()
