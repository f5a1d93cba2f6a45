"""miniserve's gemv kernel (engine/model/kernels/gemv.cpp) against oneDNN's pre-packed linear, in one process.

1. The model's weight matrices in order (24 layers' qkv, o, gate/up, down, then lm_head), each
   multiplied by 1-96 rows: ms per pass and GB/s of weights read, oneDNN then the kernel,
   alternating pass by pass so both see the same memory load.
2. Whole model calls through ModelRunner with every product on oneDNN and on the kernel, alternating call by
   call: decode B=1, 2, 4, 8, 16, 32 at context 256 and 64- and 128-token prefills (the kernel's arm
   makes SiLU·up inside its gate/up product, gate_up_silu; oneDNN's makes it after, silu_mul).
3. The same calls at B=1, 8 with the panels in the engine's huge-page buffer and in a copy on
   ordinary 4 KiB pages, alternating (kernels.in_huge_pages). Prints medians and the
   median per-pair speedup, and how far the logits moved.

    flock /tmp/miniserve-bench.lock python benchmarks/gemv_kernel.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import statistics

import torch
from calls import alternate, bench_runner, kernel_bench_args, time_alternating

from engine.model import kernels
from engine.model.kernels import dispatch
from engine.model.runner import ModelRunner


def both_copies(dtype: torch.dtype) -> list[str]:
    """Choices that make the engine keep panels and oneDNN's copy (the benchmark switches between them)."""
    return ["gemv"] * (len(dispatch.ROW_CLASSES) - 1) + ["onednn"]


def weight_sequence(runner: ModelRunner) -> list[list]:
    """[panels, oneDNN-packed, bias] of every projection the engine runs, in forward order."""
    return [[p.panels, p.packed, p.bias] for p in runner._lean.projections]


def kernel_rates(runner: ModelRunner, gemv, dtype, rows_list, passes: int) -> None:
    seq = weight_sequence(runner)
    esize = torch.empty((), dtype=dtype).element_size()
    nbytes = sum(panels.n * panels.k * esize for panels, _, _ in seq)
    for rows in rows_list:
        xs = {panels.k: torch.randn(rows, panels.k).to(dtype) for panels, _, _ in seq}

        def onednn():
            for panels, packed, _ in seq:
                dispatch.onednn_linear(xs[panels.k], packed, None)

        tuning = dispatch.gemv_tuning(dtype)  # as the engine runs it (prefetch, AMX tiles)

        def mine():
            for panels, _, _ in seq:
                gemv(xs[panels.k], panels, None, dispatch.row_block(panels.k, esize), dispatch.k_block(esize), tuning)

        times = time_alternating([onednn, mine], passes, warm=1)
        ta, tb = statistics.median(times[0]), statistics.median(times[1])
        print(f"  {rows} row(s): oneDNN {1e3 * ta:6.1f} ms {nbytes / ta / 1e9:5.1f} GB/s | gemv {1e3 * tb:6.1f} ms "
              f"{nbytes / tb / 1e9:5.1f} GB/s | speedup {ta / tb:.2f}", flush=True)


def model_calls(runner: ModelRunner, gemv, repeats: int) -> dict[str, float]:
    lean = runner._lean
    lean.stack = None  # the Python loop on both arms: the gemv's effect alone (decoder_layers.py: the one call's)

    def switch(on: bool) -> None:
        lean._by_rows = [("gemv" if on else "onednn")] * len(lean._by_rows)
        lean.choices = [("gemv" if on else "onednn")] * len(lean.choices)

    speedups = {}
    for name, contexts, chunks in [(f"decode B={b}", [256] * b, [1] * b) for b in (1, 2, 4, 8, 16, 32)] + [
            ("prefill 64", [0], [64]), ("prefill 128", [0], [128])]:
        ab = alternate(runner, contexts, chunks, switch, repeats)
        speedups[name] = ab.speedup
        print(ab.line(name, "oneDNN", "with gemv"), flush=True)
    return speedups


def page_calls(runner: ModelRunner, repeats: int) -> None:
    projections = runner._lean.projections
    runner._lean.stack = None  # it holds the huge-page panels it was built with: the loop reads the swapped ones
    huge = [p.panels for p in projections]
    small = [kernels.Panels(p.data.clone(), p.n, p.k) for p in huge]  # torch's allocator: 4 KiB pages

    def switch(on: bool) -> None:
        for p, h, s in zip(projections, huge, small):
            p.panels = h if on else s

    for b in (1, 8):
        print(alternate(runner, [256] * b, [1] * b, switch, repeats).line(f"decode B={b}", "4 KiB pages", "huge pages"),
              flush=True)


def main() -> None:
    args = kernel_bench_args(__doc__)
    last = []
    for d in args.dtypes.split(","):
        dtype = getattr(torch, d)
        gemv = kernels.gemv(dtype)
        if gemv is None:
            print(f"{d}: no gemv kernel on this machine (needs AVX-512{' and AVX512-BF16' if d == 'bfloat16' else ''}"
                  " and a C++ compiler); the engine runs oneDNN")
            continue
        dispatch.linear_choices = both_copies  # this benchmark's own A/B, not the measured table
        runner = bench_runner(args, d)
        print(f"{d}: the model's projections, one pass over all weights (threads={torch.get_num_threads()})")
        kernel_rates(runner, gemv, dtype, (1, 2, 4, 8, 16, 32, 64, 96), args.repeats)
        print(f"{d}: model calls, kernel off/on alternating")
        speedups = model_calls(runner, gemv, args.repeats)
        print(f"{d}: the panels in huge pages or 4 KiB pages, alternating")
        page_calls(runner, args.repeats)
        last += [f"gemv_speedup_decode_b{b}_{d}={speedups[f'decode B={b}']:.2f}" for b in (1, 8, 32)]
        del runner
    print(" ".join(last))


if __name__ == "__main__":
    main()
