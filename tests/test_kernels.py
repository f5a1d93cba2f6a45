"""miniserve's kernels: gemv is the exact product up to rounding, at any row count and row block,
and the engine runs it where the dispatch table says; decode attention is exact attention up to rounding over each request's
own keys and the engine runs it once per layer for a step's decodes; bad input to either is refused
with a clear error.

Every test that runs a kernel is gated on what that kernel needs, read from the same masked feature
set the engine sees (``MINISERVE_CPU_FEATURES``), so the suite passes as-is on any CPU and under any
mask; ``MINISERVE_KERNELS=0`` turns them all off, and the build tests then expect None."""

import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import torch.nn.functional as F

from engine.model import kernels
from engine.model.kernels import dispatch
from engine.model.kernels.features import cpu_features, cpu_name, detected, has_bf16_arithmetic, parse_mask
from engine.core.config import ModelConfig, SchedulerConfig
from engine.model.runner import ModelRunner
from engine.core.plan import BatchPlan
from engine.core.request import Request
from tests.helpers import on_threads

FEATURES = cpu_features()  # this CPU's, less the MINISERVE_CPU_FEATURES mask
ENABLED = kernels.enabled()  # MINISERVE_KERNELS=0: none is built, whatever the CPU
WANTS_AVX512 = ENABLED and "avx512" in FEATURES
# what the build tests below expect to run: the fp32 gemv has an AVX2 form too; bf16 needs
# AVX512-BF16's dot products. Where the build failed (no compiler) they fail, naming it, and every
# test of a kernel's numbers skips rather than fail on the missing kernel.
EXPECTED = {torch.float32: ENABLED and "avx2" in FEATURES, torch.bfloat16: WANTS_AVX512 and "avx512_bf16" in FEATURES}
ON = ENABLED and kernels.built()
HAS_AVX512 = ON and "avx512" in FEATURES
BUILD_FAILED = "the kernels did not build here (see the warning 'could not be built')"


NEEDS_ONEDNN = pytest.mark.skipif(not dispatch.onednn_available(torch.float32),
                                  reason="this torch has no oneDNN (macOS arm64 builds)")


def needs(op: str, *dtypes: torch.dtype):
    """Skip unless kernel ``op`` runs here for every dtype given: the build tests below hold that
    the engine runs torch's own kernels instead."""
    ok = ON and all(kernels.can_run(op, d) for d in dtypes)
    return pytest.mark.skipif(not ok, reason=f"{op} ({', '.join(map(str, dtypes))}) needs "
                              f"{sorted(set().union(*(kernels.NEEDS[op][d] for d in dtypes)))}; "
                              f"this CPU (as masked) has {sorted(FEATURES)}, kernels {'on' if ON else 'not built' if ENABLED else 'off'}")


def test_a_cpu_is_named_where_cpuinfo_names_it_and_arm_cores_by_implementer_and_part():
    """Cached dispatch tables and bandwidth histories are keyed by it: two ARM cores must differ."""
    assert cpu_name("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t: fpu avx2\n", "Linux", "x86_64") == \
        "AMD EPYC 9R14"
    graviton2, graviton3 = ("processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\nCPU part\t: " + part
                            for part in ("0xd0c\n", "0xd40\n"))
    assert cpu_name(graviton2, "Linux", "aarch64") == "arm implementer 0x41 part 0xd0c"
    assert cpu_name(graviton2, "Linux", "aarch64") != cpu_name(graviton3, "Linux", "aarch64")
    assert cpu_name("", "Linux", "riscv64") == "riscv64"  # nothing to go by: what platform says


def test_without_cpuinfo_flags_torch_reads_the_cpu(monkeypatch):
    """macOS has no /proc/cpuinfo, and a cpuinfo may name no flags: torch's own reading decides."""
    from engine.model.kernels import features
    monkeypatch.setattr(features, "_cpuinfo_flags", lambda: None)
    capability = torch.backends.cpu.get_cpu_capability()
    assert detected() == {"AVX512": {"avx512", "avx2"}, "AVX2": {"avx2"}}.get(capability, set())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_builds_wherever_the_cpu_can_run_it(dtype):
    # a broken build must fail here, not fall back to oneDNN unnoticed
    assert (kernels.gemv(dtype) is not None) == EXPECTED[dtype], BUILD_FAILED


XEON_NO_BF16 = frozenset("fpu sse2 avx avx2 fma avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni".split())
ZEN5 = XEON_NO_BF16 | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN5 | {"amx_bf16", "amx_tile"}


@pytest.mark.parametrize("flags, mask, expected", [
    (ZEN5, "", {"avx2", "avx512", "avx512_bf16"}),
    (XEON_NO_BF16, "", {"avx2", "avx512"}),
    (SAPPHIRE_RAPIDS, "", {"avx2", "avx512", "avx512_bf16", "amx_bf16"}),
    (ZEN5, "avx512", {"avx2", "avx512"}),  # AVX-512 without bf16, as that Xeon
    (ZEN5, "avx2", {"avx2"}),
    (ZEN5, "AVX512_BF16", {"avx2", "avx512", "avx512_bf16"}),  # a feature brings what it builds on
    (XEON_NO_BF16, "avx512_bf16", {"avx2", "avx512"}),  # a mask never adds what the CPU lacks
    (ZEN5, "none", set()),
    (frozenset("fp asimd sve bf16".split()), "", set()),  # arm64's Features: none of ours
    (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}), "", set()),  # AVX-512 without AVX2's FMA
])
def test_cpu_features_are_the_cpus_less_the_mask(flags, mask, expected):
    assert cpu_features(mask, flags) == expected
    assert has_bf16_arithmetic(cpu_features(mask, flags)) == bool({"avx512_bf16", "amx_bf16"} & expected)


def test_a_mask_naming_an_unknown_feature_is_a_clear_error():
    with pytest.raises(ValueError, match="MINISERVE_CPU_FEATURES='avx512,sse9': unknown feature"):
        parse_mask("avx512,sse9")


def test_the_engine_sees_the_masked_features(monkeypatch):
    monkeypatch.setenv("MINISERVE_CPU_FEATURES", "avx2")
    assert cpu_features() == detected() & {"avx2"}
    assert kernels.can_run("gemv", torch.float32) == ("avx2" in detected())  # its AVX2 form
    assert not kernels.can_run("gemv", torch.bfloat16) and not kernels.can_run("argmax", torch.bfloat16)
    assert kernels.can_run("argmax", torch.float32) == ("avx2" in detected())  # its AVX2 form
    assert kernels.can_run("decode_attention", torch.float32) == ("avx2" in detected())  # its AVX2 form
    assert not kernels.can_run("decode_attention", torch.bfloat16)
    monkeypatch.setenv("MINISERVE_CPU_FEATURES", "none")
    assert not kernels.can_run("gemv", torch.float32)
    monkeypatch.setenv("MINISERVE_CPU_FEATURES", "avx512")
    assert not kernels.can_run("gemv", torch.bfloat16)
    assert kernels.can_run("argmax", torch.bfloat16) == ("avx512" in detected())


@needs("gemv", torch.float32)
def test_the_raw_ops_obey_the_features_the_engine_allows():
    kernels.gemv(torch.float32)  # built; the C++ checks were told FEATURES
    assert torch.ops.miniserve.gemv_supported(torch.bfloat16) == EXPECTED[torch.bfloat16]
    try:
        torch.ops.miniserve.allow_cpu_features("avx2" in FEATURES, "avx512" in FEATURES, False)
        assert not torch.ops.miniserve.gemv_supported(torch.bfloat16)
        assert torch.ops.miniserve.gemv_supported(torch.float32)
        torch.ops.miniserve.allow_cpu_features(True, False, False)  # AVX2 only: the fp32 gemv, layer ops and attention
        assert torch.ops.miniserve.gemv_supported(torch.float32)
        assert torch.ops.miniserve.decode_attention_supported(torch.float32, 64)
        assert not torch.ops.miniserve.decode_attention_supported(torch.bfloat16, 64)
        assert torch.ops.miniserve.argmax_supported(torch.float32)
        assert not torch.ops.miniserve.argmax_supported(torch.bfloat16)
        torch.ops.miniserve.allow_cpu_features(False, False, False)
        for supported in (torch.ops.miniserve.gemv_supported(torch.float32),
                          torch.ops.miniserve.argmax_supported(torch.float32),
                          torch.ops.miniserve.layer_ops_supported(torch.float32),
                          torch.ops.miniserve.decode_attention_supported(torch.float32, 64)):
            assert not supported
    finally:
        allow_the_engines_features()


def allow_the_engines_features() -> None:
    torch.ops.miniserve.allow_cpu_features("avx2" in FEATURES, "avx512" in FEATURES, "avx512_bf16" in FEATURES,
                                           "amx_bf16" in FEATURES)


@contextmanager
def allowing(*features: bool) -> Iterator[None]:
    """The kernels' own checks told the CPU has only ``features`` (allow_cpu_features' order: AVX2,
    AVX-512, AVX512-BF16[, AMX]) for the block, then the engine's features again."""
    try:
        torch.ops.miniserve.allow_cpu_features(*features)
        yield
    finally:
        allow_the_engines_features()


AVX2_ONLY = (True, False, False)  # as an AVX2-only CPU


@needs("gemv", torch.float32)
@pytest.mark.skipif(not HAS_AVX512, reason="compares the AVX2 form with the AVX-512 one: needs AVX-512")
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), k=st.integers(1, 300), n=st.integers(1, 100), bias=st.booleans(),
       seed=st.integers(0, 2**16), k_block=st.sampled_from([2, 64, 170, 256, 384]))
def test_the_avx2_gemv_gives_the_avx512_ones_values(rows, k, n, bias, seed, k_block):
    """Each output is one FMA chain in k order in both forms (only the vector width and the row
    blocking differ), so an AVX2-only CPU computes the same logits bit for bit."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    panels = kernels.pack_panels(w)
    wide = kernels.gemv(torch.float32)(x, panels, b, 16, k_block)
    with allowing(*AVX2_ONLY):
        narrow = kernels.gemv(torch.float32)(x, panels, b, 16, k_block)
    assert torch.equal(wide, narrow)


@needs("gemv", torch.float32)
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([d for d, ok in EXPECTED.items() if ok] or [torch.float32]), rows=st.integers(1, 150),
       k=st.integers(1, 300), n=st.integers(1, 300), bias=st.booleans(), seed=st.integers(0, 2**16),
       block=st.sampled_from([8, 16, 64]), k_block=st.sampled_from([2, 6, 64, 170, 256, 384]))
# 21 panels: several runs a thread (parallel_panels), in one sweep and in blocks of K
@example(dtype=torch.float32, rows=8, k=300, n=650, bias=True, seed=3, block=8, k_block=64)
@example(dtype=torch.float32, rows=20, k=300, n=650, bias=False, seed=4, block=64, k_block=64)
def test_gemv_equals_the_exact_product_up_to_rounding(dtype, rows, k, n, bias, seed, block, k_block):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    y = kernels.gemv(dtype)(x, kernels.pack_panels(w), b, block, k_block)
    assert y.shape == (rows, n) and y.dtype == dtype
    # the row block changes which rows share a pass over the weights, the k block how much of K a
    # pass covers before the next rows' turn, never a row's sums
    assert torch.equal(y, kernels.gemv(dtype)(x, kernels.pack_panels(w), b, 64, 1 << 20))
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


@needs("gemv", torch.float32)
@pytest.mark.parametrize("make, message", [
    (lambda: _case(torch.randn(0, 8), torch.randn(4, 8)), "at least one row, got 0"),
    (lambda: (*_case(torch.randn(1, 8), torch.randn(4, 8)), 4), "row_block must be a multiple of 8, got 4"),
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 8).bfloat16()), "the panels are BFloat16"),
    (lambda: _case(torch.randn(8, 2).T, torch.randn(4, 8)), "contiguous"),
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 9)), "x has 8 columns, the panels were packed for 9"),
    (lambda: _case(torch.randn(1, 5).bfloat16(), torch.randn(4, 6).bfloat16()),
     "x has 5 columns, the panels were packed for 6" if EXPECTED[torch.bfloat16]  # same number of k pairs
     else "no kernel for BFloat16 on this CPU"),  # AVX-512 without AVX512-BF16 (or masked so)
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 8), n=40), "do not hold 40 outputs"),
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 8), k=9), "x has 8 columns, the panels were packed for 9"),
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 8), torch.randn(5)), "bias must be"),
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 8), torch.randn(8)[::2]), "bias must be"),
    (lambda: _case(torch.randn(1, 8), torch.randn(4, 8), torch.randn(4).bfloat16()), "bias must be"),
    (lambda: _case(torch.randn(8), torch.randn(4, 8)), "2-D"),
    (lambda: (*_case(torch.randn(1, 8), torch.randn(4, 8)), 64, 3), "k_block must be even"),
    (lambda: (*_case(torch.randn(1, 8), torch.randn(4, 8)), 64, 256, -128), "prefetch distances are bytes >= 0"),
    (lambda: (*_case(torch.randn(1, 8), torch.randn(4, 8)), 64, 256, 0, 16384, False, -1), "amx_rows must be >= 0"),
    (lambda: (*_case(torch.randn(1, 8), torch.randn(4, 8)), 64, 256, 0, 16384, False, 0, False, 17),
     "stream_rows must be in \\[3, 16\\], got 17"),
    (lambda: (*_case(torch.randn(1, 8), torch.randn(4, 8)), 64, 256, 0, 16384, False, 0, False, 2),
     "stream_rows must be in \\[3, 16\\], got 2"),
])
def test_bad_input_is_a_clear_error(make, message):
    kernels.gemv(torch.float32)  # built and registered
    with pytest.raises(RuntimeError, match=message):
        torch.ops.miniserve.gemv.default(*make())


@needs("gemv", torch.float32)
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([d for d, ok in EXPECTED.items() if ok] or [torch.float32]), rows=st.integers(1, 150),
       k=st.integers(1, 200), groups=st.integers(1, 9), seed=st.integers(0, 2**16),
       block=st.sampled_from([8, 16, 64]), k_block=st.sampled_from([2, 64, 256]), stream_rows=st.sampled_from([3, 8, 16]))
def test_gate_up_silu_gives_the_gemv_then_silu_mul_bits(dtype, rows, k, groups, seed, block, k_block, stream_rows):
    """The activation made in the gate/up product's finish (panels of 16 gate and 16 up outputs)
    equals the product over the weight as it is followed by the fused silu_mul, bit for bit: every
    sweep, block and row chunk of the gemv ends in the same finish."""
    inter = 16 * groups
    fused, expected = _gate_up_both_ways(dtype, rows, k, inter, seed, kernels.GemvTuning(stream_rows=stream_rows),
                                         block, k_block)
    assert fused.shape == (rows, inter) and torch.equal(fused, expected)


def _gate_up_both_ways(dtype, rows, k, inter, seed, tuning, block=64, k_block=256):
    """(gate_up_silu over the interleaved panels, the gemv over the weight then silu_mul)"""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g).to(dtype), torch.randn(2 * inter, k, generator=g).to(dtype)
    fused = kernels.gate_up_silu(dtype)(x, kernels.pack_panels(kernels.interleave_gate_up(w, inter)), block, k_block,
                                        tuning)
    return fused, kernels.layer_ops(dtype).silu_mul(kernels.gemv(dtype)(x, kernels.pack_panels(w), None, block,
                                                                       k_block, tuning), inter)


@needs("gemv", torch.float32)
@pytest.mark.parametrize("rows", [1, 5, 8, 70])
def test_gate_up_silu_in_the_avx2_form_gives_its_gemv_then_silu_mul_bits(rows):
    """An AVX2-only CPU's form (8-lane finish, 3-row passes) against its own two ops."""
    with allowing(*AVX2_ONLY):
        fused, expected = _gate_up_both_ways(torch.float32, rows, 200, 48, rows, kernels.GemvTuning(stream_rows=6))
    assert torch.equal(fused, expected)


def test_interleaving_gate_and_up_alternates_groups_of_16_rows():
    w = torch.arange(64.0)[:, None].expand(64, 3)  # gate rows 0-31, up rows 32-63
    order = kernels.interleave_gate_up(w, 32)[:, 0].long().tolist()
    assert order == [*range(0, 16), *range(32, 48), *range(16, 32), *range(48, 64)]
    with pytest.raises(ValueError, match="inter a multiple of 16"):
        kernels.interleave_gate_up(torch.randn(48, 3), 24)
    with pytest.raises(ValueError, match="a gate/up weight of 64 rows"):
        kernels.interleave_gate_up(torch.randn(48, 3), 32)


@needs("gemv", torch.float32)
@pytest.mark.parametrize("make, message", [
    (lambda: (torch.randn(1, 8), kernels.pack_panels(torch.randn(48, 8)).data, 24, 8), "multiple of 16, got 24"),
    (lambda: (torch.randn(1, 8), kernels.pack_panels(torch.randn(64, 8)).data, 16, 8), "do not hold 32 outputs"),
    (lambda: (torch.randn(2, 9), kernels.pack_panels(torch.randn(64, 8)).data, 32, 8),
     "x has 9 columns, the panels were packed for 8"),
    (lambda: (torch.randn(0, 8), kernels.pack_panels(torch.randn(64, 8)).data, 32, 8), "at least one row, got 0"),
])
def test_gate_up_silu_bad_input_is_a_clear_error(make, message):
    kernels.gemv(torch.float32)  # built and registered
    with pytest.raises(RuntimeError, match="miniserve::gate_up_silu: .*" + message):
        torch.ops.miniserve.gate_up_silu.default(*make())


@needs("gemv", torch.float32)
@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from([d for d, ok in EXPECTED.items() if ok] or [torch.float32]), rows=st.integers(1, 40),
       k=st.integers(1, 200), n=st.integers(1, 700), seed=st.integers(0, 2**16))
@example(dtype=torch.float32, rows=5, k=200, n=40, seed=0)  # AVX2: blocks past a 3-row sweep against a 6-row sweep
# enough panels for several runs a thread (parallel_panels), an odd K's last pair at a run's end
@example(dtype=next((d for d, ok in EXPECTED.items() if ok), torch.float32), rows=8, k=37, n=650, seed=1)
@example(dtype=torch.float32, rows=1, k=200, n=650, seed=2)
def test_how_the_weights_are_asked_for_changes_no_value(dtype, rows, k, n, seed):
    """Each tuning dispatch.py may choose: where the weight stream is asked for and how many rows one
    sweep of it takes, not what is summed (every output's sum is one chain in k order either way)."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    panels, gemv = kernels.pack_panels(w), kernels.gemv(dtype)
    base = gemv(x, panels, None, 64, 256, kernels.GemvTuning(prefetch_one=0, prefetch=0))
    tunings = ([kernels.GemvTuning(prefetch_one=d, prefetch_one_l2=l2) for d, l2 in dispatch.PREFETCH_ONE]
               + [kernels.GemvTuning(prefetch=d, prefetch_l2=l2) for d, l2 in dispatch.PREFETCH]
               + [kernels.GemvTuning(stream_rows=n) for n in dispatch.STREAM_ROWS + dispatch.STREAM_ROWS_AVX2])
    for tuning in tunings:
        assert torch.equal(gemv(x, panels, None, 64, 256, tuning), base)


@pytest.mark.skipif(not (ON and shutil.which("objdump") and platform.machine().lower() in ("x86_64", "amd64")),
                    reason="reads the built x86-64 kernels with objdump (binutils)")
def test_the_gemv_asks_for_its_stream_into_l2_when_told():
    """The "into L2" tunings must issue prefetcht1: GCC 12 compiled _mm_prefetch(p, _MM_HINT_T1) to
    nothing once inlined into the vector loops, so dispatch.py timed "16 KiB into L2" as no prefetch
    at all. No value can show it (a prefetch changes none): the built library's code does."""
    from torch.utils.cpp_extension import _get_build_directory

    lib = Path(_get_build_directory(kernels.NAME, verbose=False)) / f"{kernels.NAME}.so"
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", str(lib)], capture_output=True, text=True,
                         check=True).stdout
    functions = [(f.splitlines()[0], f) for f in asm.split("\n\n") if re.match(r"[0-9a-f]+ <", f)]

    def vector_loops(kind: str, element: str) -> list[str]:  # the AVX-512 one-sweep loops, inlined or not
        return [f for head, f in functions if "avx2" not in head and "_amx" not in head
                and (f"{kind}<" in head or ("run_panels<" in head and element in head))]

    for kind, element in (("panel_f32", "float"), ("panel_bf16", "unsigned short")):
        loops = vector_loops(kind, element)
        assert loops, f"no {kind} loop found in the library"
        assert any("prefetcht1" in f for f in loops), f"no {kind} loop issues prefetcht1: 'into L2' would not prefetch"


# the CPU's flags (as masked) and a Linux that grants the process the tiles
NEEDS_AMX = pytest.mark.skipif(not (ON and kernels.can_run("gemv_amx", torch.bfloat16)
                                    and kernels.gemv_amx(torch.bfloat16)),
                               reason="the gemv's AMX tiles need AMX-BF16 (as masked) and the OS's grant")


@NEEDS_AMX
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 150), k=st.integers(1, 300), n=st.integers(1, 120), bias=st.booleans(),
       seed=st.integers(0, 2**16), block=st.sampled_from([8, 32, 64]))
def test_the_gemv_on_amx_tiles_equals_the_exact_product_up_to_rounding(rows, k, n, bias, seed, block):
    """Row counts off the 16-row tiles, K off the 32-wide ones and odd K take the tile path's edges."""
    assert kernels.gemv_amx(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = kernels.gemv(torch.bfloat16)(x, kernels.pack_panels(w), b, block, 256, kernels.GemvTuning(amx_rows=1))
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    scale = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    assert y.shape == (rows, n) and ((y.double() - ref).abs() <= 1e-5 * scale + 2 ** -8 * ref.abs()).all()


@NEEDS_AMX
@pytest.mark.parametrize("rows", [1, 16, 40, 130])
def test_gate_up_silu_on_amx_tiles_gives_their_gemv_then_silu_mul_bits(rows):
    fused, expected = _gate_up_both_ways(torch.bfloat16, rows, 300, 64, rows, kernels.GemvTuning(amx_rows=1))
    assert torch.equal(fused, expected)


@needs("gemv", torch.float32)
@pytest.mark.parametrize("dtype", [d for d, ok in EXPECTED.items() if ok] or [torch.float32])
@pytest.mark.parametrize("rows", [1, 8, 20])
def test_gemv_values_do_not_depend_on_how_the_threads_share_the_panels(dtype, rows):
    """The threads take runs of panels off a shared counter (gemv.cpp parallel_panels), so which
    thread multiplies a panel changes from call to call: 71 panels on 1, 2 and 3 threads, every
    path (one row, one sweep, blocks of K), give the same bits."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(32 * 70 + 7, 200, generator=g).to(dtype), torch.randn(rows, 200, generator=g).to(dtype)
    panels, gemv = kernels.pack_panels(w), kernels.gemv(dtype)
    ys = []
    for threads in (1, 2, 3):
        with on_threads(threads):
            ys.append(gemv(x, panels, None, 64, 64))
    assert all(torch.equal(ys[0], y) for y in ys[1:])
    ref = x.double() @ w.double().T
    tol = 1e-5 * (x.double().abs() @ w.double().abs().T) + (2 ** -8 * ref.abs() if dtype == torch.bfloat16 else 0)
    assert ((ys[0].double() - ref).abs() <= tol).all()


@NEEDS_AMX
@pytest.mark.parametrize("threads", [1, 2])
def test_the_tiles_asking_for_each_next_panel_change_no_value(threads):
    """Several panels per run a thread takes (gemv.cpp parallel_panels: 41 panels, runs of 20, 10,
    5, ... on one thread, 10, 7, 6, 4, ... on two), so every panel but a run's last asks for its
    successor while the tiles multiply (the request is a prefetch: the values are the
    one-panel-per-call values)."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(32 * 40 + 5, 300, generator=g).bfloat16(), torch.randn(37, 300, generator=g).bfloat16()
    panels, gemv = kernels.pack_panels(w), kernels.gemv(torch.bfloat16)
    with on_threads(threads):
        y = gemv(x, panels, None, 64, 256, kernels.GemvTuning(amx_rows=1))
    for p0 in range(0, w.shape[0], 32):  # each panel alone: no next panel to ask for
        one = gemv(x, kernels.pack_panels(w[p0:p0 + 32]), None, 64, 256, kernels.GemvTuning(amx_rows=1))
        assert torch.equal(y[:, p0:p0 + 32], one)


@NEEDS_AMX
def test_the_tiles_run_from_amx_rows_on_and_the_vector_loop_below():
    """A case where the two paths round a few outputs differently (a k pair's two products added in
    the other order, over 4864 inputs), so which path ran shows in the values."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(256, 4864, generator=g).bfloat16(), torch.randn(40, 4864, generator=g).bfloat16()
    panels, gemv = kernels.pack_panels(w), kernels.gemv(torch.bfloat16)
    tiles = gemv(x, panels, None, 64, 256, kernels.GemvTuning(amx_rows=1))
    vector = gemv(x, panels, None, 64, 256, kernels.GemvTuning(amx_rows=0))
    assert not torch.equal(tiles, vector)
    assert torch.equal(gemv(x, panels, None, 64, 256, kernels.GemvTuning(amx_rows=40)), tiles)
    assert torch.equal(gemv(x, panels, None, 64, 256, kernels.GemvTuning(amx_rows=41)), vector)


@NEEDS_AMX
def test_a_mask_without_amx_turns_the_tiles_off_with_a_clear_error():
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    with allowing(True, True, True, False):
        assert not torch.ops.miniserve.gemv_amx_supported()
        with pytest.raises(RuntimeError, match="no AMX bf16 tiles"):
            kernels.gemv(torch.bfloat16)(x, kernels.pack_panels(w), None, 64, 256, kernels.GemvTuning(amx_rows=1))
    assert torch.ops.miniserve.gemv_amx_supported()
    assert not kernels.can_run("gemv_amx", torch.bfloat16, parse_mask("avx512,avx512_bf16"))


def test_the_kernel_can_be_switched_off_and_is_not_built_without_avx2(monkeypatch, caplog):
    monkeypatch.setenv("MINISERVE_KERNELS", "0")
    assert kernels._load.__wrapped__() is False
    monkeypatch.delenv("MINISERVE_KERNELS")
    monkeypatch.setenv("MINISERVE_CPU_FEATURES", "none")
    with caplog.at_level("WARNING", logger="miniserve.kernels"):
        assert kernels._load.__wrapped__() is False
    assert len(caplog.records) == 1 and "no AVX2 on this CPU (masked by MINISERVE_CPU_FEATURES)" in caplog.text


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_running_build_keeps_its_own(monkeypatch, tmp_path):
    """torch's lock file has no timeout, so one left by a killed build is removed, but only inside
    the flock that every builder holds (a lock judged by its age had been removed under a slow
    build still running, and every process then fell back to torch)."""
    import subprocess
    import sys

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(kernels.NAME, verbose=False))
    torch_lock = folder / "lock"
    holder = subprocess.Popen(  # another process building: holds the flock, its lock file stands
        [sys.executable, "-c", "import sys, time; from engine.model import kernels\n"
         "with kernels._build_lock():\n    open(sys.argv[1], 'w').close(); print('in', flush=True); time.sleep(1.5)",
         str(torch_lock)], stdout=subprocess.PIPE, text=True, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    try:
        assert holder.stdout.readline().strip() == "in"
        waited = time.monotonic()
        with kernels._build_lock():  # waits for the holder; its lock file was left behind
            assert time.monotonic() - waited > 0.5 and not torch_lock.exists()
    finally:
        holder.wait(30)
    torch_lock.touch()  # a build killed midway (no flock holder): removed at once
    with kernels._build_lock():
        assert not torch_lock.exists()


def test_a_failed_build_names_its_cause():
    ninja = RuntimeError("Error building extension 'miniserve_kernels': [1/5] c++ -MMD -MF gemv.o.d -O3 -fopenmp "
                         "...\n/bin/sh: 1: c++: not found\nninja: build stopped: subcommand failed.")
    assert kernels._build_error(ninja) == "/bin/sh: 1: c++: not found"
    assert kernels._build_error(ImportError("No module named 'ninja'")) == "No module named 'ninja'"


@needs("gemv", torch.float32)
@NEEDS_ONEDNN
def test_the_engine_runs_each_row_count_on_the_candidate_the_table_chose(monkeypatch):
    choices = ["gemv"] * 7 + ["onednn", "torch", "torch"]  # gemv to 64 rows, oneDNN to 128, F.linear above
    monkeypatch.setattr(dispatch, "linear_choices", lambda dtype: choices)
    runner = ModelRunner(ModelConfig(name="tiny"), SchedulerConfig(max_num_seqs=4, max_model_len=256))
    lean = runner._lean
    lean.stack = None  # the Python loop's calls, one per product (the one-call layers: test_model_runner.py)
    assert all(p.panels is not None and p.packed is not None and p.plain is not None for p in lean.projections)
    calls = []
    for name in ("gemv", "gate_up", "onednn_linear", "linear"):
        owner = lean if name in ("gemv", "gate_up") else dispatch if name == "onednn_linear" else F
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda x, *rest, real=real, name=name: calls.append((name, x.shape[0]))
                            or real(x, *rest))
    layers = runner.model.config.num_hidden_layers
    per_token_rows = 4 * layers  # qkv, o, gate/up, down
    reqs = {f"r{i}": Request(f"r{i}", list(range(1, 200)), 4) for i in range(4)}
    ids = tuple(reqs)

    def run(n, ctx, samples, expected):
        calls.clear()
        runner.execute(BatchPlan("continuous", ids[:len(n)], n, ctx, samples, sum(1 for t in n if t == 1)), reqs)
        assert calls == expected

    # on the gemv, gate/up and its activation are one call (gate_up_silu over interleaved panels)
    run((1,), (0,), (True,), [("gemv", 1), ("gemv", 1), ("gate_up", 1), ("gemv", 1)] * layers + [("gemv", 1)])
    run((30, 30, 30), (0, 0, 0), (False, False, True), [("onednn_linear", 90)] * per_token_rows + [("gemv", 1)])
    run((1, 45, 45, 45), (1, 0, 0, 0), (True,) * 4, [("linear", 136)] * per_token_rows + [("gemv", 4)])


@NEEDS_ONEDNN
def test_the_engine_keeps_only_the_copies_its_choices_read(monkeypatch):
    monkeypatch.setattr(dispatch, "linear_choices", lambda dtype: ["onednn"] * len(dispatch.ROW_CLASSES))
    runner = ModelRunner(ModelConfig(name="tiny"), SchedulerConfig(max_num_seqs=2, max_model_len=64))
    lean, model = runner._lean, runner.model
    assert all(p.panels is None and p.plain is None and p.packed is not None for p in lean.projections)
    q = model.model.layers[0].self_attn.q_proj.weight  # released: its shape, no memory
    assert q.shape == (model.config.hidden_size, model.config.hidden_size) and q.stride() == (0, 0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied: the embedding stays
    with pytest.raises(RuntimeError, match="moved into the engine's lean forward"):
        model(input_ids=torch.tensor([[1, 2]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_builds_wherever_the_cpu_can_run_it(dtype):
    # bf16 keys and values are widened by hand: AVX-512 alone is enough; fp32 has an AVX2 form
    runs = EXPECTED[torch.float32] if dtype == torch.float32 else WANTS_AVX512
    assert (kernels.decode_attention(dtype, 64) is not None) == runs, BUILD_FAILED
    assert (kernels.argmax_rows(dtype) is not None) == runs, BUILD_FAILED  # the same holds for argmax
    assert kernels.decode_attention(dtype, 80) is None  # head dims 16, 32, 64, 128 only: SDPA for others


ATTENTION_DTYPES = [d for d in (torch.float32, torch.bfloat16) if ON and kernels.can_run("decode_attention", d)]


@needs("decode_attention", torch.float32)
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(ATTENTION_DTYPES or [torch.float32]), rows=st.integers(1, 6),
       heads=st.sampled_from([(4, 2), (14, 2), (7, 7), (16, 8), (8, 1), (10, 2), (5, 1), (6, 2), (8, 2), (22, 2)]),
       d=st.sampled_from([16, 32, 64, 128]),
       data=st.data())
def test_decode_attention_equals_exact_attention_over_each_requests_own_keys(dtype, rows, heads, d, data):
    num_heads, kv_heads = heads
    max_len, num_slots = 300, 8  # several of the AVX2 form's 16 KB value blocks at every head dim
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    k_store = torch.randn(num_slots, kv_heads, max_len, d, generator=g).to(dtype)
    v_store = torch.randn(num_slots, kv_heads, max_len, d, generator=g).to(dtype)
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), min_size=rows, max_size=rows, unique=True))
    lens = data.draw(st.lists(st.integers(1, max_len), min_size=rows, max_size=rows))  # tails of 0-15 keys
    q = torch.randn(rows, num_heads, d, generator=g).to(dtype)
    out = kernels.decode_attention(dtype, d)(q, k_store, v_store, torch.tensor(slots), torch.tensor(lens), d ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    group = num_heads // kv_heads
    for r, (s, n) in enumerate(zip(slots, lens)):
        qr = q[r].double().view(kv_heads, group, d)
        p = torch.softmax(qr @ k_store[s, :, :n].double().transpose(1, 2) * d ** -0.5, dim=-1)
        ref = (p @ v_store[s, :, :n].double()).reshape(num_heads, d)
        # fp32: summation order and exp's polynomial; bf16: also the one rounding of the output,
        # and with dot products that of the probabilities
        tol = 1e-5 if dtype == torch.float32 else 1e-5 + 2 ** -8 * ref.abs()
        if _rounds_probabilities(dtype, d):
            tol = tol + _probability_rounding(p, v_store[s, :, :n]).reshape(num_heads, d)
        assert ((out[r].double() - ref).abs() <= tol).all()


def _rounds_probabilities(dtype: torch.dtype, d: int) -> bool:
    """Whether the kernel rounds the probabilities to bf16 before the value pass, as SDPA's CPU flash
    kernel does: bf16 with AVX512-BF16 dot products (a head dim of a multiple of 32)."""
    return dtype == torch.bfloat16 and d % 32 == 0 and "avx512_bf16" in FEATURES


def _probability_rounding(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The most that rounding each probability to bf16 (relative error at most 2^-8) moves an
    output: 2^-8 · Σ_j p_j |v_j|, and its own rounding to bf16 on top (kv_heads, group, d)."""
    return (1 + 2 ** -8) * 2 ** -8 * (p @ v.double().abs())


@needs("decode_attention", torch.float32)
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES or [torch.float32])
def test_decode_attention_values_do_not_depend_on_how_the_threads_share_the_tasks(dtype):
    """The tasks go one at a time off a shared counter, each thread claiming its next one while
    tasks are left for the others (decode_attention.cpp attend), so which thread attends a row
    changes from call to call: a prefill chunk and decodes of very different lengths, and a lone
    decode (two tasks, fewer than three threads), on 1, 2 and 3 threads give the same bits, each
    row its exact attention."""
    q, k_store, v_store, slots, lens = _chunk_and_decodes(dtype, 64, 14, 1000)
    op = kernels.decode_attention(dtype, 64)
    for rows in (slice(None), slice(-2, -1)):  # all of them; the decode of 1000 keys alone
        outs = []
        for threads in (1, 2, 3):
            with on_threads(threads):
                outs.append(op(q[rows], k_store, v_store, slots[rows], lens[rows], 64 ** -0.5))
        assert all(torch.equal(outs[0], out) for out in outs[1:])
        _assert_exact_attention(outs[:1], q[rows], k_store, v_store, slots[rows], lens[rows], dtype == torch.bfloat16,
                                _rounds_probabilities(dtype, 64))


def _chunk_and_decodes(dtype: torch.dtype, d: int, heads: int, max_len: int):
    """A prefill chunk's rows (one slot, lengths 1..37: tails of every length) and two decodes
    beside it: q, keys, values, slots, lens for the raw op, 2 KV heads."""
    g = torch.Generator().manual_seed(d)
    chunk, kv_heads = 37, 2
    k_store = torch.randn(3, kv_heads, max_len, d, generator=g).to(dtype)
    v_store = torch.randn(3, kv_heads, max_len, d, generator=g).to(dtype)
    slots = torch.tensor([0] * chunk + [1, 2])
    lens = torch.tensor(list(range(1, chunk + 1)) + [max_len, 17])
    return torch.randn(len(slots), heads, d, generator=g).to(dtype), k_store, v_store, slots, lens


def _assert_exact_attention(outs, q, k_store, v_store, slots, lens, bf16_rounding: bool,
                            rounded_probabilities: bool = False) -> None:
    """Every output equals float64 attention over its row's own keys, up to fp32 rounding (and the
    output's one bf16 rounding, and the probabilities' where the kernel rounds them)."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = k_store.shape[1]
    for r, (s, n) in enumerate(zip(slots.tolist(), lens.tolist())):
        qr = q[r].double().view(kv_heads, heads // kv_heads, d)
        p = torch.softmax(qr @ k_store[s, :, :n].double().transpose(1, 2) * d ** -0.5, dim=-1)
        ref = (p @ v_store[s, :, :n].double()).reshape(heads, d)
        tol = 1e-5 + (2 ** -8 * ref.abs() if bf16_rounding else 0)
        if rounded_probabilities:
            tol = tol + _probability_rounding(p, v_store[s, :, :n]).reshape(heads, d)
        for out in outs:
            assert ((out[r].double() - ref).abs() <= tol).all()


@needs("decode_attention", torch.float32)
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES or [torch.float32])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_decode_attention_reads_nothing_past_a_rows_keys(dtype, d):
    """A slot's keys and values past a row's length are another request's or garbage: NaN there
    leaves every output as it was (the bf16 value pass pairs an odd length's last key with zeros,
    not with the store's next key)."""
    q, k_store, v_store, slots, lens = _chunk_and_decodes(dtype, d, 14, 81)  # a decode of all 81 keys
    op = kernels.decode_attention(dtype, d)
    clean = op(q, k_store, v_store, slots, lens, d ** -0.5)
    for r in range(len(slots)):  # each row alone, its own keys the only finite ones of its slot
        s, n = int(slots[r]), int(lens[r])
        k_row, v_row = k_store.clone(), v_store.clone()
        k_row[s, :, n:], v_row[s, :, n:] = float("nan"), float("nan")
        out = op(q[r:r + 1], k_row, v_row, slots[r:r + 1], lens[r:r + 1], d ** -0.5)
        assert torch.equal(out, clean[r:r + 1])


@needs("decode_attention", torch.bfloat16)
@pytest.mark.skipif("avx512_bf16" not in FEATURES, reason="the bf16 dot-product scores need AVX512-BF16")
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_bf16_attention_with_and_without_bf16_dot_products(d):
    # where the CPU has AVX512-BF16 the bf16 scores and value sums are dot products of bf16 pairs
    # (D a multiple of 32; the probabilities rounded to bf16 first, as SDPA's CPU kernel rounds
    # them), else widened FMAs over fp32 probabilities (as under MINISERVE_CPU_FEATURES=avx512):
    # both are exact attention up to their rounding, on a prefill chunk's rows (every length
    # 1..37: odd ones pair their last key with zeros) and on decodes beside it
    case = _chunk_and_decodes(torch.bfloat16, d, 14, 80)
    op = kernels.decode_attention(torch.bfloat16, d)
    for dot_products in (True, False):
        with allowing(True, True, dot_products):
            out = op(*case, d ** -0.5)
        _assert_exact_attention([out], *case, bf16_rounding=True,
                                rounded_probabilities=dot_products and _rounds_probabilities(torch.bfloat16, d))


@needs("decode_attention", torch.float32)
@pytest.mark.parametrize("d", [16, 32, 64, 128])
# groups of 7, 5, 11, 6, 8, 9, 10: every remainder of the AVX2 score blocks (3 heads) and value blocks (3; 6 at d=16)
@pytest.mark.parametrize("heads", [14, 10, 22, 12, 16, 18, 20])
def test_fp32_attention_in_avx2_and_avx512_forms(d, heads):
    # the AVX2 form (8 lanes: scores of 3 heads × 4 keys, 12 value accumulators, 16 KB value blocks) runs on
    # AVX2-only CPUs and, switched to, on AVX-512 ones: exact attention up to rounding on a prefill
    # chunk's rows and on decodes beside it (300 keys: several value blocks at every head dim)
    case = _chunk_and_decodes(torch.float32, d, heads, 300)
    op = kernels.decode_attention(torch.float32, d)
    outs = []
    for avx512 in ([False, True] if HAS_AVX512 else [False]):
        with allowing(True, avx512, False):
            outs.append(op(*case, d ** -0.5))
    _assert_exact_attention(outs, *case, bf16_rounding=False)


def _attention_case(rows=2, heads=4, kv_heads=2, d=16, num_slots=8, max_len=10, **override):
    """Arguments of the raw op: q, keys, values, slots, lens, scale; any of them overridden."""
    store = (num_slots, kv_heads, max_len, d)
    args = dict(q=torch.randn(rows, heads, d), k=torch.randn(store), v=torch.randn(store), slots=torch.arange(rows),
                lens=torch.full((rows,), 3), scale=0.25)
    args.update(override)
    return tuple(args.values())


@needs("decode_attention", torch.float32)
@pytest.mark.parametrize("make, message", [
    (lambda: _attention_case(d=80), "no kernel for Float and head dim 80"),
    (lambda: _attention_case(q=torch.randn(2, 64)), "q must be"),
    (lambda: _attention_case(v=torch.randn(8, 2, 11, 16)), "do not match"),
    (lambda: _attention_case(k=torch.randn(8, 2, 10, 16).bfloat16()), "share one dtype"),
    (lambda: _attention_case(heads=5), "5 query heads cannot share 2 KV heads"),
    (lambda: _attention_case(q=torch.randn(4, 2, 16).transpose(0, 1)), "contiguous"),
    (lambda: _attention_case(slots=torch.tensor([0, 8])), "row 1 reads slot 8 of 8"),
    (lambda: _attention_case(slots=torch.tensor([-1, 0])), "row 0 reads slot -1 of 8"),
    (lambda: _attention_case(lens=torch.tensor([3, 0])), "row 1 sees 0 keys"),
    (lambda: _attention_case(lens=torch.tensor([11, 3])), "row 0 sees 11 keys; a slot holds 1 to 10"),
    (lambda: _attention_case(lens=torch.tensor([3, 3], dtype=torch.int32)), "int64"),
    (lambda: _attention_case(slots=torch.tensor([0])), "int64 \\(rows,\\)"),
])
def test_decode_attention_bad_input_is_a_clear_error(make, message):
    kernels.decode_attention(torch.float32, 16)  # built and registered
    with pytest.raises(RuntimeError, match=message):
        torch.ops.miniserve.decode_attention.default(*make())


@needs("decode_attention", torch.float32)
def test_the_engine_attends_every_token_of_a_step_in_one_kernel_call_per_layer(monkeypatch):
    monkeypatch.setenv("MINISERVE_DISPATCH", "attention=kernel")  # what is tested, whatever this machine measured
    runner = ModelRunner(ModelConfig(name="tiny"), SchedulerConfig(max_num_seqs=4, max_model_len=64))
    real, calls = runner.attention_kernel, []
    assert runner.kernel_phases == {"decode", "prefill"}
    runner.attention_kernel = lambda q, k, v, slots, lens, scale: (
        calls.append((q.shape[0], slots.tolist(), lens.tolist())) or real(q, k, v, slots, lens, scale))
    layers = runner.model.config.num_hidden_layers
    reqs = {f"r{i}": Request(f"r{i}", list(range(1, 20)), 4) for i in range(4)}
    ids = tuple(reqs)

    def run(ids, n, ctx, expected):
        calls.clear()
        runner.execute(BatchPlan("continuous", ids, n, ctx, (True,) * len(n), sum(1 for t in n if t == 1)), reqs)
        assert calls == expected(*[runner._slot_of[r] for r in ids])

    chunk = list(range(1, 9))  # token j of a chunk at context 0 sees keys 0..j: causal
    run(("r0", "r1"), (8, 8), (0, 0), lambda a, b: [(16, [a] * 8 + [b] * 8, chunk * 2)] * layers)
    # each decode sees its 8 keys and its own
    run(("r0", "r1"), (1, 1), (8, 8), lambda a, b: [(2, [a, b], [9, 9])] * layers)
    run(("r0", "r2"), (1, 6), (9, 0), lambda a, c: [(7, [a] + [c] * 6, [10, 1, 2, 3, 4, 5, 6])] * layers)
    run(("r0", "r1", "r2"), (1, 1, 4), (10, 9, 6),  # decodes and a chunk after its context
        lambda a, b, c: [(6, [a, b] + [c] * 4, [11, 10, 7, 8, 9, 10])] * layers)


@needs("decode_attention", torch.float32)
@pytest.mark.parametrize("kernel_phase", ["decode", "prefill"])
def test_a_step_split_between_kernel_and_sdpa_gives_the_kernel_only_its_phase_rows(kernel_phase, monkeypatch):
    """Where the table has the kernel attend one phase, it gets that phase's rows in one call a
    layer and SDPA the rest; the logits stay those of the kernel attending every row."""
    other = {"decode": "prefill", "prefill": "decode"}[kernel_phase]
    monkeypatch.setenv("MINISERVE_DISPATCH", f"{kernel_phase}_attention=kernel,{other}_attention=sdpa")
    runner = ModelRunner(ModelConfig(name="tiny"), SchedulerConfig(max_num_seqs=4, max_model_len=64))
    assert runner.kernel_phases == {kernel_phase}
    real, calls = runner.attention_kernel, []
    runner.attention_kernel = lambda q, k, v, slots, lens, scale: (
        calls.append((q.shape[0], slots.tolist(), lens.tolist())) or real(q, k, v, slots, lens, scale))
    layers = runner.model.config.num_hidden_layers
    reqs = {f"r{i}": Request(f"r{i}", list(range(1, 20)), 4) for i in range(3)}
    runner.execute(BatchPlan("continuous", ("r0", "r1"), (8, 8), (0, 0), (True, True), 0), reqs)
    calls.clear()
    plan = BatchPlan("continuous", ("r0", "r1", "r2"), (1, 1, 4), (8, 8, 0), (True,) * 3, 2)
    _, logits = runner.execute(plan, reqs, return_logits=True)
    a, b, c = (runner._slot_of[r] for r in ("r0", "r1", "r2"))
    expected = (2, [a, b], [9, 9]) if kernel_phase == "decode" else (4, [c] * 4, [1, 2, 3, 4])
    assert calls == [expected] * layers
    monkeypatch.setenv("MINISERVE_DISPATCH", "attention=kernel")
    whole = ModelRunner(ModelConfig(name="tiny"), SchedulerConfig(max_num_seqs=4, max_model_len=64))
    fresh = {f"r{i}": Request(f"r{i}", list(range(1, 20)), 4) for i in range(3)}
    whole.execute(BatchPlan("continuous", ("r0", "r1"), (8, 8), (0, 0), (True, True), 0), fresh)
    _, reference = whole.execute(plan, fresh, return_logits=True)
    assert (logits - reference).abs().max().item() <= 1e-5


def test_layer_ops_build_wherever_the_cpu_can_run_them():
    assert (kernels.layer_ops(torch.float32) is not None) == EXPECTED[torch.float32], BUILD_FAILED  # an AVX2 form too
    assert (kernels.layer_ops(torch.bfloat16) is not None) == WANTS_AVX512, BUILD_FAILED


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the dtype's spacing at b (1 = one rounding apart)."""
    return (a.double() - b.double()).abs() / (torch.finfo(b.dtype).eps * b.double().abs().clamp_min(1e-30))


LAYER_OPS_DTYPES = [d for d in (torch.float32, torch.bfloat16) if ON and kernels.can_run("layer_ops", d)]


@needs("layer_ops", torch.float32)
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(LAYER_OPS_DTYPES or [torch.float32]), t=st.integers(1, 20), n=st.integers(1, 70),
       heads=st.sampled_from([(4, 2), (14, 2), (2, 2)]), d=st.sampled_from([2, 16, 34, 64]), seed=st.integers(0, 2**16))
def test_fused_layer_ops_round_where_the_stock_ops_round(dtype, t, n, heads, d, seed):
    check_fused_against_stock(dtype, t, n, heads, d, seed)


@needs("layer_ops", torch.float32)
@pytest.mark.skipif(not HAS_AVX512, reason="runs the AVX2 form on an AVX-512 CPU (an AVX2-only one runs it above)")
@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 20), n=st.integers(1, 70), heads=st.sampled_from([(4, 2), (14, 2), (2, 2)]),
       d=st.sampled_from([2, 16, 34, 64]), seed=st.integers(0, 2**16))
def test_the_avx2_layer_ops_round_where_the_stock_ops_round(t, n, heads, d, seed):
    kernels.layer_ops(torch.float32)  # built and registered before its features are switched
    with allowing(*AVX2_ONLY):
        check_fused_against_stock(torch.float32, t, n, heads, d, seed)


def check_fused_against_stock(dtype, t, n, heads, d, seed):
    fused, stock = kernels.layer_ops(dtype), kernels.TORCH_LAYER_OPS
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    # residual add + RMSNorm: h after the add is bit-identical; the norm differs only by the order
    # of the sum of squares (a rounding or two of the scale, then one of the output)
    h, delta, w = randn(t, n), randn(t, n), randn(n)
    h1, h2 = h.clone(), h.clone()
    x1, x2 = fused.add_rms_norm(h1, delta, w, 1e-6), stock.add_rms_norm(h2, delta, w, 1e-6)
    assert torch.equal(h1, h2)
    assert (_ulps(x1, x2) <= (4 if dtype == torch.float32 else 1)).all()
    assert torch.equal(fused.add_rms_norm(h1, None, w, 1e-6), x1)  # no delta: h as it is
    # SiLU·up: only exp's polynomial differs
    gu = randn(t, 2 * n) * 4
    assert (_ulps(fused.silu_mul(gu, n), stock.silu_mul(gu, n)) <= (8 if dtype == torch.float32 else 1)).all()
    # rotary + KV write: the same products and sums, rounded at the same points: bit-identical
    nh, nkv = heads
    qkv, cos, sin = randn(t, (nh + 2 * nkv) * d), randn(t, d), randn(t, d)
    slots, positions = torch.randint(0, 3, (t,), generator=g), torch.randperm(t + 5, generator=g)[:t]
    stores = [torch.zeros(3, nkv, t + 5, d, dtype=dtype) for _ in range(4)]
    q1 = fused.rotary_kv(qkv, cos, sin, nh, nkv, stores[0], stores[1], slots, positions)
    q2 = stock.rotary_kv(qkv, cos, sin, nh, nkv, stores[2], stores[3], slots, positions)
    assert q1.shape == (t, nh, d) and torch.equal(q1, q2)
    assert torch.equal(stores[0], stores[2]) and torch.equal(stores[1], stores[3])
    # with Qwen3's per-head q/k RMSNorm first: v bit-identical; q and k move only by the norm's
    # order of the sum of squares, carried through the rotation (an ulp or two of the largest term)
    qn, kn = randn(d), randn(d)
    stores = [torch.zeros(3, nkv, t + 5, d, dtype=dtype) for _ in range(4)]
    q1 = fused.rotary_kv(qkv, cos, sin, nh, nkv, stores[0], stores[1], slots, positions, qn, kn, 1e-6)
    q2 = stock.rotary_kv(qkv, cos, sin, nh, nkv, stores[2], stores[3], slots, positions, qn, kn, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    for a, b in ((q1, q2), (stores[0], stores[2])):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol * (1 + b.float().abs().max().item()))
    assert torch.equal(stores[1], stores[3])
    assert not torch.equal(q1, fused.rotary_kv(qkv, cos, sin, nh, nkv, *stores[:2], slots, positions))


def _rotary_case(**override):
    """Arguments of rotary_kv for 3 tokens, 4 query and 2 KV heads of 16 (two slots of 8 positions);
    any of them overridden."""
    args = dict(qkv=torch.randn(3, 128), cos=torch.randn(3, 16), sin=torch.randn(3, 16), heads=4, kv_heads=2,
                k_store=torch.zeros(2, 2, 8, 16), v_store=torch.zeros(2, 2, 8, 16), slots=torch.tensor([0, 1, 1]),
                positions=torch.tensor([0, 1, 2]))
    args.update(override)
    return tuple(args.values())


@needs("layer_ops", torch.float32)
@pytest.mark.parametrize("make, message", [
    (lambda o: o.add_rms_norm(torch.randn(2, 8).T, None, torch.randn(2), 1e-6), "h must be a contiguous"),
    (lambda o: o.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-6), "delta has 3 rows, h 2"),
    (lambda o: o.add_rms_norm(torch.randn(2, 8), torch.randn(2, 8).bfloat16(), torch.randn(8), 1e-6),
     "delta is BFloat16, expected Float"),
    (lambda o: o.add_rms_norm(torch.randn(2, 8), None, torch.randn(7), 1e-6), "weight must be a contiguous \\(8,\\)"),
    (lambda o: o.add_rms_norm(torch.randn(2, 8).half(), None, torch.randn(8).half(), 1e-6), "no kernel for Half"),
    (lambda o: o.silu_mul(torch.randn(2, 9), 4), "gate/up must be a contiguous \\(rows, 8\\)"),
    (lambda o: o.rotary_kv(*_rotary_case(slots=torch.tensor([0, 1, 2]))),
     "token 2 writes slot 2 position 2; the stores hold 2 slots of 8"),
    (lambda o: o.rotary_kv(*_rotary_case(positions=torch.tensor([0, 1, 8]))), "token 2 writes slot 1 position 8"),
    (lambda o: o.rotary_kv(*_rotary_case(qkv=torch.randn(3, 120))), "qkv must be a contiguous \\(rows, 128\\)"),
    (lambda o: o.rotary_kv(*_rotary_case(cos=torch.randn(2, 16), sin=torch.randn(2, 16))), "one row per token"),
    (lambda o: o.rotary_kv(*_rotary_case(slots=torch.tensor([0, 1]))), "int64 \\(tokens,\\)"),
    (lambda o: o.rotary_kv(*_rotary_case(), torch.randn(16), None, 1e-6), "q_norm and k_norm come together"),
    (lambda o: o.rotary_kv(*_rotary_case(), torch.randn(16), torch.randn(8), 1e-6),
     "q_norm and k_norm must be contiguous \\(16,\\)"),
])
def test_layer_ops_bad_input_is_a_clear_error(make, message):
    with pytest.raises(RuntimeError, match=message):
        make(kernels.layer_ops(torch.float32))


@needs("layer_ops", torch.float32)
def test_the_engine_makes_three_fused_calls_per_layer_and_the_activation_in_the_gate_up_product():
    """Two norms and the rotary per layer through the fused layer ops; silu(gate) · up inside the
    gate/up product where the gemv runs it (gate_up_silu), else one silu_mul after it."""
    runner = ModelRunner(ModelConfig(name="tiny"), SchedulerConfig(max_num_seqs=4, max_model_len=64))
    lean, calls = runner._lean, []
    real = lean.ops

    def counted(name):
        fn = getattr(real, name)
        return lambda *a: calls.append(name) or fn(*a)

    lean.ops = kernels.LayerOps(*(counted(n) for n in ("add_rms_norm", "silu_mul", "rotary_kv")))
    layers = runner.model.config.num_hidden_layers
    reqs = {f"r{i}": Request(f"r{i}", list(range(1, 20)), 4) for i in range(2)}
    runner.execute(BatchPlan("continuous", tuple(reqs), (8, 1), (0, 0), (True, True), 0), reqs)
    fused = lean.gate_up is not None and lean._by_rows[9] == "gemv"
    per_layer = ["add_rms_norm", "rotary_kv", "add_rms_norm"] + ([] if fused else ["silu_mul"])
    assert calls == per_layer * layers + ["add_rms_norm"]  # and the final norm, of the sampled rows
    assert (lean.gate_up is not None) == (lean.gemv is not None)  # tiny's MLP width (128) interleaves


ARGMAX_DTYPES = [d for d in (torch.float32, torch.bfloat16) if ON and kernels.can_run("argmax", d)]


@needs("argmax", torch.float32)
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(ARGMAX_DTYPES or [torch.float32]), rows=st.integers(1, 5), n=st.integers(1, 300),
       ties=st.booleans(), seed=st.integers(0, 2**16))
def test_argmax_rows_is_torchs_argmax(dtype, rows, n, ties, seed):
    check_argmax(dtype, rows, n, ties, seed)


@needs("argmax", torch.float32)
@pytest.mark.skipif(not HAS_AVX512, reason="runs the AVX2 form on an AVX-512 CPU (an AVX2-only one runs it above)")
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), n=st.integers(1, 300), ties=st.booleans(), seed=st.integers(0, 2**16))
def test_the_avx2_argmax_is_torchs_argmax(rows, n, ties, seed):
    kernels.argmax_rows(torch.float32)  # built and registered before its features are switched
    with allowing(*AVX2_ONLY):
        check_argmax(torch.float32, rows, n, ties, seed)


ARGMAX_FORMS = ["as built"] + (["avx2"] if HAS_AVX512 else [])  # an AVX-512 CPU runs the AVX2 form too


@needs("argmax", torch.float32)
@pytest.mark.parametrize("form", ARGMAX_FORMS)
@pytest.mark.parametrize("case", ["all -inf", "max in the tail", "tie across chains", "nan in the tail",
                                  "nan in the body", "-inf among finite", "+inf ties", "short row"])
def test_argmax_edges(case, form):
    """Where the vector chains and a ragged tail meet (n = 37: four chains of 8, five left; a short
    row has no whole vector), against torch.argmax."""
    x = torch.full((1, 37), -float("inf"))
    if case == "max in the tail":
        x[0, :] = 1.0
        x[0, 35] = 2.0
    elif case == "tie across chains":
        x[0, :] = 0.0
        x[0, 30] = x[0, 9] = x[0, 36] = 3.0
    elif case == "nan in the tail":
        x[0, 34] = float("nan")
    elif case == "nan in the body":
        x[0, :] = 1.0
        x[0, 20] = x[0, 12] = float("nan")
    elif case == "-inf among finite":
        x[0, 10:] = -5.0
        x[0, 25] = -4.0
    elif case == "+inf ties":
        x[0, :] = 2.0
        x[0, 17] = x[0, 3] = x[0, 35] = float("inf")
    elif case == "short row":
        x = torch.tensor([[1.0, 3.0, -2.0, 3.0, 0.5]])
    kernels.argmax_rows(torch.float32)  # built and registered before its features are switched
    with allowing(*AVX2_ONLY) if form == "avx2" else nullcontext():
        assert torch.equal(kernels.argmax_rows(torch.float32)(x), x.argmax(-1))


def check_argmax(dtype, rows, n, ties, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    if ties:  # few distinct values: the first index of the largest must win
        x = x.round()
    x = x.to(dtype)
    if seed % 3 == 0:
        x[0, n // 2] = float("nan")  # a row with a NaN answers its first NaN
    assert torch.equal(kernels.argmax_rows(dtype)(x), x.float().argmax(-1))


@needs("argmax", torch.float32)
def test_argmax_rows_bad_input_is_a_clear_error():
    op = kernels.argmax_rows(torch.float32)
    with pytest.raises(RuntimeError, match="contiguous \\(rows, vocab\\)"):
        op(torch.randn(8, 4).T)
    with pytest.raises(RuntimeError, match="no kernel for Half"):
        op(torch.randn(2, 4).half())


@needs("argmax", torch.float32)
def test_the_engine_samples_with_the_argmax_kernel():
    runner = ModelRunner(ModelConfig(name="tiny"), SchedulerConfig(max_num_seqs=2, max_model_len=64))
    real, calls = runner.greedy, []
    runner.greedy = lambda logits: calls.append(logits.shape) or real(logits)
    reqs = {f"r{i}": Request(f"r{i}", list(range(1, 9)), 4) for i in range(2)}
    result, logits = runner.execute(BatchPlan("continuous", tuple(reqs), (8, 8), (0, 0), (True, True), 0), reqs,
                                    return_logits=True)
    assert calls == [(2, runner.vocab_size)] and list(result.token_ids) == logits.argmax(-1).tolist()


def test_panels_move_into_one_huge_page_buffer_unchanged():
    ws = [torch.randn(40, 3), torch.randn(7, 5), torch.randn(33, 64)]
    packed = [kernels.pack_panels(w) for w in ws]
    moved = kernels.in_huge_pages(packed)
    for p, m in zip(packed, moved):
        assert (m.n, m.k) == (p.n, p.k) and torch.equal(m.data, p.data)
        assert m.data.data_ptr() % 64 == 0  # each on a cache line, in one mapping
    assert moved[0].data.untyped_storage().data_ptr() == moved[2].data.untyped_storage().data_ptr()
    assert kernels.in_huge_pages([]) == []


@needs("gemv", torch.float32)
def test_the_engines_panels_sit_in_one_huge_page_buffer(monkeypatch):
    monkeypatch.setenv("MINISERVE_DISPATCH", "linear=gemv")  # what is tested, whatever this machine measured
    runner = ModelRunner(ModelConfig(name="tiny"), SchedulerConfig(max_num_seqs=2, max_model_len=64))
    storages = {p.panels.data.untyped_storage().data_ptr() for p in runner._lean.projections}
    assert len(storages) == 1 and len(runner._lean.projections) == 4 * runner.model.config.num_hidden_layers + 1
