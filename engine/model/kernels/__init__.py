"""The engine's own CPU kernels, compiled once per machine at first use.

- ``gemv(dtype)`` (gemv.cpp): a function (x, Panels, bias, row_block, k_block, GemvTuning) -> y, made for
  decode-sized linears (it reads the weights at memory speed); ``pack_panels`` lays a weight out for it,
  ``panel_rows`` reads rows of it back (a tied embedding); ``gemv_amx(dtype)`` says whether it can
  run on AMX tiles here (bf16).
- ``gate_up_silu(dtype)`` (gemv.cpp): the MLP's gate/up product with silu(gate) · up made in it, over
  the panels of ``interleave_gate_up``'s weight (16 gate and 16 up outputs a panel): the same bits as
  the gemv then the layer ops' silu_mul.
- ``decode_attention(dtype, head_dim)`` (decode_attention.cpp): rows of one query each against
  keys 0..len-1 of their own KV slot, in one call: a step's decodes and every token of its prefill
  chunks alike.
- ``layer_ops(dtype)`` (layer_ops.cpp): a decoder layer's work between its products (residual add
  + RMSNorm, SiLU·up, rotary + KV write, with Qwen3's per-head q/k RMSNorm before the rotary) in
  three fused calls; ``TORCH_LAYER_OPS`` is the same
  three in stock torch ops, what machines without the kernels run.
- ``argmax_rows(dtype)`` (argmax.cpp): each row's greedy token, rows in parallel, bf16 read as is.
- ``decoder_layers()`` (decoder_layers.cpp): every decoder layer of a step in one call through
  the gemv, layer ops and attention above (no trip to Python per op).

Each returns None where this CPU cannot run it (``decoder_layers``: where the kernels are not
built; the lean forward builds one only where it runs the others), and the engine keeps oneDNN's
linear, SDPA or torch's ops for those calls. Whether the engine runs a kernel that this CPU can run is measured
per machine (``dispatch.py``). ``MINISERVE_KERNELS=0`` in the environment turns them all off.
What each needs is ``NEEDS`` (``can_run`` asks it), against ``features.cpu_features()``: this CPU's
features less any ``MINISERVE_CPU_FEATURES`` mask. The C++ ops' own ``*_supported`` checks are told
the same masked set after the build (``miniserve::allow_cpu_features``), so a masked feature is
absent to the raw ops too.

The build (~10 s with g++ and ninja) is cached by torch.utils.cpp_extension under
``$TORCH_EXTENSIONS_DIR`` (default ~/.cache/torch_extensions) and redone only when a source or
the build command changes; concurrent processes take turns under an flock there, which the OS
releases when its holder dies, so a killed build leaves nothing to wait on (``_build_lock``;
torch's own lock file has no timeout and is cleared inside it). A CPU without AVX2
skips the build (one with AVX2 but no AVX-512 runs only the fp32 gemv, layer ops and attention); a machine without a compiler gets a warning. Either way the engine runs, on
torch's own kernels.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import mmap
import os
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model.kernels.features import cpu_features

PANEL = 32  # output columns per panel (kPanel in gemv.cpp)
SOURCES = [Path(__file__).with_name(n) for n in ("gemv.cpp", "decode_attention.cpp", "layer_ops.cpp", "argmax.cpp",
                                                       "decoder_layers.cpp")]
HEADERS = [Path(__file__).with_name(n) for n in ("simd.h", "ops.h")]
NAME = "miniserve_kernels"
log = logging.getLogger("miniserve.kernels")


# the CPU features each kernel needs, by op and dtype (bf16 keys, values and activations are
# widened by hand, so only gemv's bf16 dot products need AVX512-BF16; the attention's bf16 scores
# use them where the CPU has them, and widen the keys where it does not). The fp32 gemv, layer ops,
# attention and argmax also have an AVX2 form: an AVX2-only CPU runs fp32 (oneDNN's linear reached 10 GB/s of
# weights at 8 rows on one, and ~30 torch ops per layer cost a fifth of a decode call there;
# docs/architecture.md).
NEEDS: dict[str, dict[torch.dtype, frozenset[str]]] = {
    "gemv": {torch.float32: frozenset({"avx2"}), torch.bfloat16: frozenset({"avx512", "avx512_bf16"})},
    "gemv_amx": {torch.bfloat16: frozenset({"avx512", "avx512_bf16", "amx_bf16"})},  # the bf16 gemv on tiles
    "decode_attention": {torch.float32: frozenset({"avx2"}), torch.bfloat16: frozenset({"avx512"})},
    "layer_ops": {torch.float32: frozenset({"avx2"}), torch.bfloat16: frozenset({"avx512"})},
    "argmax": {torch.float32: frozenset({"avx2"}), torch.bfloat16: frozenset({"avx512"})},
}
ATTENTION_HEAD_DIMS = (16, 32, 64, 128)  # decode_attention.cpp's


def enabled() -> bool:
    """False when ``MINISERVE_KERNELS=0`` turns the kernels off."""
    return os.environ.get("MINISERVE_KERNELS", "1") != "0"


def can_run(op: str, dtype: torch.dtype, features: frozenset[str] | None = None) -> bool:
    """Whether this CPU (as masked) has what kernel ``op`` needs for ``dtype``; not whether it is
    built (``MINISERVE_KERNELS=0``, no compiler)."""
    need = NEEDS[op].get(dtype)
    return need is not None and need <= (cpu_features() if features is None else features)


@dataclass(frozen=True)
class GemvTuning:
    """How the gemv runs on this machine (dispatch.py measures it): how far ahead of its arithmetic a
    one-row and a several-row product ask for the weights (bytes; 0 leaves it to the hardware
    prefetcher), each into L2 or L1, from how many rows a bf16 product runs on AMX tiles (0: never),
    and up to how many rows one sweep of the weights multiplies them all (past that, rows are taken
    8 at a time over blocks of K held in cache)."""

    prefetch_one: int = 0
    prefetch: int = 16 << 10
    prefetch_l2: bool = False  # the several-row distance's level
    amx_rows: int = 0
    prefetch_one_l2: bool = False  # the one-row distance's level
    stream_rows: int = 8  # AVX-512 8-16, AVX2 3-6 (each loop clamps it to its range)

    def op_args(self) -> tuple[int, int, bool, int, bool, int]:
        """The fields in the order the gemv.cpp ops take them (after row_block and k_block)."""
        return (self.prefetch_one, self.prefetch, self.prefetch_l2, self.amx_rows, self.prefetch_one_l2,
                self.stream_rows)


@dataclass(frozen=True)
class Panels:
    """A weight (n outputs × k inputs) laid out for the kernel."""

    data: torch.Tensor
    n: int
    k: int


def panel_shape(n: int, k: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The shape ``pack_panels`` gives a (n, k) weight of ``dtype``."""
    panels = -(-n // PANEL)
    return (panels, (k + 1) // 2, PANEL, 2) if dtype == torch.bfloat16 else (panels, k, PANEL)


def pack_panels(w: torch.Tensor, out: torch.Tensor | None = None) -> Panels:
    """w (N, K) in the kernel's layout: panels of PANEL output columns, k-major inside a panel,
    so a panel's weights for one k (fp32) or one pair of k (bf16, for its pairwise dot product)
    are one contiguous 128 bytes. Zero-padded past N (and past an odd K in bf16). Written into
    ``out`` (of ``panel_shape``) when given: no second temporary copy of a large weight."""
    n, k = w.shape
    shape = panel_shape(n, k, w.dtype)
    data = torch.empty(shape, dtype=w.dtype) if out is None else out
    if tuple(data.shape) != shape or data.dtype != w.dtype:
        raise ValueError(f"panels for a {tuple(w.shape)} {w.dtype} weight are {shape}, got {tuple(data.shape)} {data.dtype}")
    w = w.detach()
    full, rest = n // PANEL, n % PANEL
    if w.dtype == torch.bfloat16:
        pairs = k // 2
        body = w[:full * PANEL, :2 * pairs].reshape(full, PANEL, pairs, 2).permute(0, 2, 1, 3)
        data[:full, :pairs].copy_(body)
        if k % 2:  # an odd K's last pair holds its last column and a zero
            data[:full, pairs, :, 0].copy_(w[:full * PANEL, k - 1].view(full, PANEL))
            data[:full, pairs, :, 1].zero_()
        if rest:
            tail = F.pad(w[full * PANEL:], (0, k % 2, 0, PANEL - rest))
            data[full:].copy_(tail.view(1, PANEL, (k + 1) // 2, 2).permute(0, 2, 1, 3))
    else:
        data[:full].copy_(w[:full * PANEL].view(full, PANEL, k).permute(0, 2, 1))
        if rest:
            data[full:].copy_(F.pad(w[full * PANEL:], (0, 0, 0, PANEL - rest)).view(1, PANEL, k).permute(0, 2, 1))
    return Panels(data, n, k)


def panel_rows(panels: Panels, rows: torch.Tensor) -> torch.Tensor:
    """``w[rows]`` (len(rows), k) read back out of ``pack_panels(w)``, value for value, ``rows``
    int64 (gemv.cpp's panel_rows: several rows' strided reads in flight at once).

    Why: a tied embedding is its lm_head's weight, so the embedding lookup reads the lm_head's
    panels instead of keeping the weight a second time in its plain layout. Only where the gemv
    runs, the one place panels are made."""
    if not _load():
        raise RuntimeError("panel_rows reads panels with miniserve's kernels, which are not built here")
    return torch.ops.miniserve.panel_rows(panels.data, rows, panels.n, panels.k)


def huge_page_arena(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Uninitialised tensors of these shapes in one buffer of transparent huge pages, each on a
    cache line.

    Why: the gemv streams its panels from memory, and on this VM a 272 MB panel set read through
    4 KiB pages at 52-54 GB/s and through 2 MiB pages at 60-65 GB/s, alternating in one process
    (fewer TLB misses, each a page walk through the host's tables too). One buffer for all, so
    matrices smaller than a huge page get them as well. Where the kernel has no THP (or it is
    "never") this is an ordinary private anonymous mapping; either way a page is committed only
    when written, so packing into it weight by weight never holds two copies of the model."""
    if not shapes:
        return []
    esize = torch.empty((), dtype=dtype).element_size()
    align = 64 // esize
    sizes = [math.prod(s) for s in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // align) * align
    buf = mmap.mmap(-1, total * esize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared: no THP
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(buf, dtype=dtype)  # the tensor keeps the mapping alive
    return [arena[at:at + size].view(shape) for at, size, shape in zip(offsets, sizes, shapes)]


def in_huge_pages(panels: list[Panels]) -> list[Panels]:
    """The same panels, moved into one buffer of transparent huge pages (``huge_page_arena``)."""
    if not panels:
        return []
    views = huge_page_arena([tuple(p.data.shape) for p in panels], panels[0].data.dtype)
    return [Panels(v.copy_(p.data), p.n, p.k) for p, v in zip(panels, views)]


@contextmanager
def _build_lock() -> Iterator[None]:
    """One build at a time per build folder, under an flock: the OS drops it when its holder exits or
    is killed, so no lock outlives a build. torch's own lock file (made and removed by its loader,
    waited on with no timeout) can be left by a killed build; inside this lock no one else is
    building, so one found there is such a leftover and is removed. (The lock had been judged by
    its age, which removed a slow build's own lock at 300 s and failed every waiting process.)"""
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(NAME, verbose=False))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock alone
        yield
        return
    with open(folder / "miniserve-build.lock", "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's build of miniserve's kernels (%s)", folder)
            fcntl.flock(held, fcntl.LOCK_EX)
        except OSError as err:  # no locks on this file system (NFS without lockd): torch's lock alone
            log.warning("no build lock in %s (%s): concurrent builds rely on torch's own", folder, err)
            yield
            return
        leftover = folder / "lock"
        if leftover.exists():
            leftover.unlink(missing_ok=True)
            log.warning("removed %s, left by a build that was killed midway", leftover)
        yield  # the flock goes with the file


def _build_error(e: Exception) -> str:
    """What a failed build says about its cause: ninja's error names the whole compile command on its
    first line and the cause (``c++: not found``, a compiler error) after it."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    causes = [line for line in lines[1:] if "error" in line.lower() or "not found" in line.lower()]
    return "; ".join((causes or lines[-1:])[:3])[:500]


def built() -> bool:
    """Whether miniserve's kernels are built and loaded in this process (building them at first
    call): False where they are switched off, the CPU lacks AVX2, or the build failed."""
    return _load()


@functools.cache
def _load() -> bool:
    if not enabled():
        log.info("MINISERVE_KERNELS=0: the engine runs torch's own kernels (oneDNN, SDPA, stock ops)")
        return False
    features = cpu_features()
    if "avx2" not in features:
        masked = " (masked by MINISERVE_CPU_FEATURES)" if os.environ.get("MINISERVE_CPU_FEATURES") else ""
        x86 = platform.machine().lower() in ("x86_64", "amd64")  # elsewhere (arm64) this is expected
        log.log(logging.WARNING if x86 else logging.INFO,
                "no AVX2 on this CPU%s: miniserve's kernels are not built; the engine runs torch's own", masked)
        return False
    if "avx512" not in features:
        log.info("no AVX-512 on this CPU: of miniserve's kernels only the fp32 gemv, layer ops and attention (AVX2) run")
    try:
        import ninja  # the build tool torch's extension loader runs; on PATH even without an activated venv
        from torch.utils.cpp_extension import load

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        # -fopenmp: at::parallel_for then runs on torch's own OpenMP pool (the libgomp torch has
        # loaded); without it the kernels would run on one core. -ffp-contract=off: a product and
        # a sum written apart stay apart (no fused multiply-add), so the layer ops round where
        # torch rounds. torch rebuilds when a source or a flag changes, not a header, so the
        # headers' hash is a flag.
        headers = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
        with _build_lock():
            load(NAME, [str(p) for p in SOURCES], extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off",
                                                               f"-DMINISERVE_HEADERS={headers}"],
                 extra_ldflags=["-fopenmp"], is_python_module=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the engine still runs, on torch's kernels
        log.warning("miniserve's kernels could not be built (%s); the engine runs torch's own", _build_error(e))
        return False
    # the raw ops' *_supported checks see the masked features, as the engine does
    torch.ops.miniserve.allow_cpu_features("avx2" in features, "avx512" in features, "avx512_bf16" in features,
                                           "amx_bf16" in features)
    return True


def _agree(op: str, supported: bool) -> None:
    """The C++ op's own check must agree with ``NEEDS``: a disagreement is a bug, not a fallback."""
    if not supported:
        raise RuntimeError(f"miniserve's {op} kernel refuses a case NEEDS says this CPU runs ({sorted(cpu_features())})")


@functools.cache
def gemv(dtype: torch.dtype):
    """x (rows, k) · panels' weightᵀ + bias for ``dtype`` on this CPU, or None."""
    if not _load():
        return None
    if not can_run("gemv", dtype):
        log.warning("this CPU has no %s kernel for miniserve's gemv (bf16 needs AVX512-BF16); decode "
                    "linears run on oneDNN where it runs %s, else F.linear", dtype, dtype)
        return None
    _agree("gemv", torch.ops.miniserve.gemv_supported(dtype))
    op = torch.ops.miniserve.gemv.default

    def run(x: torch.Tensor, panels: Panels, bias: torch.Tensor | None, row_block: int = 64,
            k_block: int = 256, tuning: GemvTuning = GemvTuning()) -> torch.Tensor:
        return op(x, panels.data, bias, panels.n, panels.k, row_block, k_block, *tuning.op_args())

    return run


def gate_up_silu(dtype: torch.dtype):
    """x (rows, k) -> silu(x · gateᵀ) · (x · upᵀ) (rows, inter) for ``dtype`` on this CPU, from one
    product over ``pack_panels(interleave_gate_up(w, inter))`` (w: gate's rows then up's, as the
    MLP's fused gate/up weight; no bias), or None where the gemv does not run. The same bits as the
    gemv over ``pack_panels(w)`` then ``silu_mul``; each panel's 16 outputs are made where they were
    summed (gemv.cpp gate_up_silu)."""
    if gemv(dtype) is None:
        return None
    op = torch.ops.miniserve.gate_up_silu.default

    def run(x: torch.Tensor, panels: Panels, row_block: int = 64, k_block: int = 256,
            tuning: GemvTuning = GemvTuning()) -> torch.Tensor:
        return op(x, panels.data, panels.n // 2, panels.k, row_block, k_block, *tuning.op_args())

    return run


GATE_UP_GROUP = 16  # gate and up outputs alternate in groups of this many (gemv.cpp finish_silu)


def interleave_gate_up(w: torch.Tensor, inter: int) -> torch.Tensor:
    """The fused gate/up weight (2·inter, k) with its rows reordered so that every PANEL of
    ``pack_panels`` holds 16 gate outputs and the same 16 up outputs: what ``gate_up_silu`` reads."""
    if w.shape[0] != 2 * inter or inter % GATE_UP_GROUP:
        raise ValueError(f"a gate/up weight of {2 * inter} rows with inter a multiple of {GATE_UP_GROUP} "
                         f"interleaves, got {tuple(w.shape)} and inter {inter}")
    groups = inter // GATE_UP_GROUP
    gate, up = w[:inter].view(groups, GATE_UP_GROUP, -1), w[inter:].view(groups, GATE_UP_GROUP, -1)
    return torch.stack([gate, up], dim=1).reshape(2 * inter, -1)


@functools.cache
def gemv_pass_rows() -> int:
    """Rows per pass of the gemv past its one sweep: gemv.cpp's kBlockRows with AVX-512 (8; the bf16
    tiles' 16-row blocks step at multiples of it too), two of kPassRowsAvx2 on an AVX2-only CPU (6:
    its passes take 3 rows, and the cost model keeps a knot pair at every second pass's edge). A call's
    cost steps up just past each multiple (calibration.cost_model.PASS_EDGES)."""
    return 8 if "avx512" in cpu_features() else 6


@functools.cache
def gemv_amx(dtype: torch.dtype) -> bool:
    """Whether the gemv can run ``dtype`` on AMX tiles here (bf16, a CPU with AMX as masked, and a
    Linux that grants the process the tiles' state)."""
    if dtype != torch.bfloat16 or gemv(dtype) is None or not can_run("gemv_amx", dtype):
        return False
    return bool(torch.ops.miniserve.gemv_amx_supported())


@functools.cache
def decode_attention(dtype: torch.dtype, head_dim: int):
    """(q (rows, heads, D), k_store, v_store, slots, lens, scale) -> (rows, heads, D): each row's
    query against keys 0..lens[r]-1 of its slot, for ``dtype`` and ``head_dim`` on this CPU, or None."""
    if not _load():
        return None
    if not can_run("decode_attention", dtype) or head_dim not in ATTENTION_HEAD_DIMS:
        log.info("no attention kernel for %s, head dim %d on this CPU; every step attends with SDPA",
                 dtype, head_dim)
        return None
    _agree("decode_attention", torch.ops.miniserve.decode_attention_supported(dtype, head_dim))
    return torch.ops.miniserve.decode_attention.default


@functools.cache
def decoder_layers():
    """``torch.classes.miniserve.DecoderLayers`` (decoder_layers.cpp): a step's decoder layers in one
    call through the kernels above, or None where they are not built. Its constructor and ``run``
    are described there; engine/model/lean_qwen2.py builds one per model."""
    if not _load():
        return None
    return torch.classes.miniserve.DecoderLayers


@dataclass(frozen=True)
class LayerOps:
    """What a decoder layer does between its matrix products, as three calls."""

    add_rms_norm: Callable  # (h (T, n), delta (T, n) | None, weight, eps) -> RMSNorm(h += delta) · weight
    silu_mul: Callable  # (gu (T, 2I), I) -> silu(gu[:, :I]) · gu[:, I:]
    # (qkv, cos (T, D), sin, heads, kv_heads, k_store, v_store, slots, positions[, q_norm, k_norm, eps])
    # -> q (T, H, D); with q_norm / k_norm (Qwen3) each q and k head is RMS-normalised before its rotation
    rotary_kv: Callable


def _torch_add_rms_norm(h, delta, weight, eps):
    """h += delta, then Qwen2RMSNorm.forward op for op."""
    if delta is not None:
        h.add_(delta)
    x = h.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(h.dtype)


def _torch_silu_mul(gu, inter):
    return F.silu(gu[:, :inter]) * gu[:, inter:]


def _torch_rotary_kv(qkv, cos, sin, heads, kv_heads, k_store, v_store, slots, positions,
                     q_norm=None, k_norm=None, eps=0.0):
    """Qwen2's apply_rotary_pos_emb over the q and k heads side by side in qkv (elementwise, so the
    same values as rotating each), k and v written into their slots; with q_norm and k_norm,
    Qwen3Attention's per-head RMSNorm of q and k first (the same op for op as add_rms_norm's)."""
    t, d = qkv.shape[0], k_store.shape[-1]
    qk = qkv[:, :(heads + kv_heads) * d].view(t, heads + kv_heads, d)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    if q_norm is not None:
        qk = torch.cat((_torch_add_rms_norm(qk[:, :heads], None, q_norm, eps),
                        _torch_add_rms_norm(qk[:, heads:], None, k_norm, eps)), dim=1)
    half = d // 2
    qk = (qk * cos[:, None]) + (torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin[:, None])
    k_store[slots, :, positions] = qk[:, heads:]
    v_store[slots, :, positions] = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    return qk[:, :heads]


TORCH_LAYER_OPS = LayerOps(_torch_add_rms_norm, _torch_silu_mul, _torch_rotary_kv)


@functools.cache
def layer_ops(dtype: torch.dtype) -> LayerOps | None:
    """miniserve's fused layer ops for ``dtype`` on this CPU, or None (then TORCH_LAYER_OPS)."""
    if not _load() or not can_run("layer_ops", dtype):
        return None
    _agree("layer_ops", torch.ops.miniserve.layer_ops_supported(dtype))
    ops = torch.ops.miniserve
    return LayerOps(ops.add_rms_norm.default, ops.silu_mul.default, ops.rotary_kv.default)


@functools.cache
def argmax_rows(dtype: torch.dtype):
    """logits (rows, vocab) -> each row's first index of its largest value, as torch.argmax, or None."""
    if not _load() or not can_run("argmax", dtype):
        return None
    _agree("argmax", torch.ops.miniserve.argmax_supported(dtype))
    return torch.ops.miniserve.argmax_rows.default
