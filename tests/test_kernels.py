"""miniserve's gemv: the exact product up to rounding, the engine runs it for up to eight rows and
oneDNN above, and bad input is refused with a clear error."""

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import kernels
from engine.config import ModelConfig, SchedulerConfig
from engine.model_runner import ModelRunner
from engine.plan import BatchPlan
from engine.request import Request

CPU_FLAGS = set(next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), []))
HAS_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= CPU_FLAGS  # torch's "AVX512" capability
EXPECTED = {torch.float32: HAS_AVX512, torch.bfloat16: HAS_AVX512 and "avx512_bf16" in CPU_FLAGS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_builds_wherever_the_cpu_can_run_it(dtype):
    # a broken build must fail here, not fall back to oneDNN unnoticed
    assert (kernels.gemv(dtype) is not None) == EXPECTED[dtype]


NEEDS_KERNEL = pytest.mark.skipif(not EXPECTED[torch.float32],
                                  reason="no AVX-512 here: test_the_kernel_builds_... holds that oneDNN runs instead")


@NEEDS_KERNEL
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([d for d, ok in EXPECTED.items() if ok]), rows=st.integers(1, kernels.MAX_ROWS),
       k=st.integers(1, 300), n=st.integers(1, 300), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_gemv_equals_the_exact_product_up_to_rounding(dtype, rows, k, n, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    y = kernels.gemv(dtype)(x, kernels.pack_panels(w), b)
    assert y.shape == (rows, n) and y.dtype == dtype
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    # fp32: summation order only; bf16: also the one rounding of the fp32 sum to bf16 (2^-8 relative)
    scale = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    tol = 1e-5 * scale + (2 ** -8 * ref.abs() if dtype == torch.bfloat16 else 0)
    assert ((y.double() - ref).abs() <= tol).all()


def test_panels_hold_each_weight_once_with_zero_padding():
    w = torch.arange(1.0, 1.0 + 40 * 3).view(40, 3)  # 40 outputs: two panels, the second 8/32 full
    p = kernels.pack_panels(w)
    assert (p.n, p.k, p.data.shape) == (40, 3, (2, 3, kernels.PANEL))
    assert torch.equal(p.data[1, :, :8], w[32:].T) and not p.data[1, :, 8:].any()
    pb = kernels.pack_panels(w.bfloat16())  # k in pairs, an odd K padded with a zero column
    assert pb.data.shape == (2, 2, kernels.PANEL, 2)
    assert torch.equal(pb.data[0, 1, 5], torch.tensor([w[5, 2], 0.0]).bfloat16())


def _case(x, w, bias=None, n=None, k=None):
    """Arguments of the raw op, as the engine's wrapper would pass them unless overridden."""
    p = kernels.pack_panels(w)
    return x, p.data, bias, p.n if n is None else n, p.k if k is None else k


@NEEDS_KERNEL
@pytest.mark.parametrize("make, message", [
    (lambda: _case(torch.randn(9, 8), torch.randn(4, 8)), "1 to 8 rows, got 9"),
    (lambda: _case(torch.randn(0, 8), torch.randn(4, 8)), "1 to 8 rows, got 0"),
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 8).bfloat16()), "the panels are BFloat16"),
    (lambda: _case(torch.randn(8, 2).T, torch.randn(4, 8)), "contiguous"),
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 9)), "x has 8 columns, the panels were packed for 9"),
    (lambda: _case(torch.randn(1, 5).bfloat16(), torch.randn(4, 6).bfloat16()),
     "x has 5 columns, the panels were packed for 6"),  # same number of bf16 k pairs
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 8), n=40), "do not hold 40 outputs"),
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 8), k=9), "x has 8 columns, the panels were packed for 9"),
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 8), torch.randn(5)), "bias must be"),
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 8), torch.randn(8)[::2]), "bias must be"),
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 8), torch.randn(4).bfloat16()), "bias must be"),
    (lambda: _case(torch.randn(8), torch.randn(4, 8)), "2-D"),
])
def test_bad_input_is_a_clear_error(make, message):
    kernels.gemv(torch.float32)  # built and registered
    with pytest.raises(RuntimeError, match=message):
        torch.ops.miniserve.gemv.default(*make())


def test_the_kernel_can_be_switched_off_and_is_not_built_without_avx512(monkeypatch, caplog):
    monkeypatch.setenv("MINISERVE_GEMV", "0")
    assert kernels._load.__wrapped__() is False
    monkeypatch.delenv("MINISERVE_GEMV")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with caplog.at_level("WARNING", logger="miniserve.kernels"):
        assert kernels._load.__wrapped__() is False
    assert "no AVX-512" in caplog.text


def test_a_build_lock_left_by_a_killed_build_is_removed(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(kernels.NAME, verbose=False)) / "lock"
    lock.touch()
    kernels._clear_stale_lock()
    assert lock.exists()  # a build may be running now
    old = lock.stat().st_mtime - kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    kernels._clear_stale_lock()
    assert not lock.exists()


@NEEDS_KERNEL
def test_the_engine_runs_the_kernel_up_to_eight_rows_and_onednn_above():
    runner = ModelRunner(ModelConfig(name="tiny"), SchedulerConfig(max_num_seqs=4, max_model_len=64))
    lean = runner._lean
    real, calls = lean.gemv, []
    lean.gemv = lambda x, *rest: calls.append(x.shape[0]) or real(x, *rest)
    per_token_rows = 4 * runner.model.config.num_hidden_layers  # qkv, o, gate/up, down
    reqs = {f"r{i}": Request(f"r{i}", list(range(1, 20)), 4) for i in range(4)}
    ids = tuple(reqs)

    def run(n, ctx, samples, expected):
        calls.clear()
        runner.execute(BatchPlan("continuous", ids[:len(n)], n, ctx, samples, sum(1 for t in n if t == 1)), reqs)
        assert calls == expected

    run((8, 8, 8), (0, 0, 0), (False, False, True), [1])  # prefill: 24 rows on oneDNN, lm_head's 1 row here
    run((1,), (8,), (True,), [1] * (per_token_rows + 1))  # a decode of one request: every projection
    run((1, 1, 1), (9, 8, 8), (True, True, True), [3] * (per_token_rows + 1))  # of three: every projection
    run((1, 8), (10, 0), (True, True), [2])  # 9 rows on oneDNN; two sampled rows here
