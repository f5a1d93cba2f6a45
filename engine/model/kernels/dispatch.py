"""The kernel-or-torch choice for each op, made once per machine by measuring, not assuming.

Why: a row threshold or a kernel that was right on the CPU it was tuned on lost by up to 2.2x on
another (issue 14). So at first use on a machine, each candidate is timed on this CPU, alternating
call by call (the memory bandwidth a shared host leaves moves within minutes), and the engine
dispatches to the faster:

- a linear's product, per row class (``ROW_CLASSES``: a product of ``rows`` takes the smallest class
  ≥ rows): ``gemv`` (miniserve's kernel over panel-packed weights), ``onednn`` (oneDNN's linear over
  its pre-packed copy), ``torch`` (stock ``F.linear`` over the plain weight);
- a step's attention, per phase (``PHASES``: its decodes, its prefill chunks): ``kernel``
  (miniserve's attention kernel, all of the phase's tokens in one call) or ``sdpa`` (SDPA for the
  decodes together, per prefill chunk); the phases are timed apart, as they differ (on a CPU with
  AMX a bf16 chunk attends faster in SDPA, on the tiles, and decodes in the kernel);
- the gemv's own tuning (``kernels.GemvTuning``): how far ahead, into L1 or L2, it asks for its
  weight stream at one row (``PREFETCH_ONE``'s candidates, timed at 1 row) and at more
  (``PREFETCH``'s, timed at 8 rows, an AVX2-only CPU's 6, on all threads and on one), up to how many rows one sweep of the weights takes them all
  (``STREAM_ROWS``, timed at 12 and 16 rows; an AVX2-only CPU's ``STREAM_ROWS_AVX2``, at 4 and 6,
  and where it chooses 3, ``PREFETCH`` again at 3 rows, the most that then read it) and, for bf16 on a CPU with AMX, from which row class
  its tiles beat its vector loop (``fold_amx``).

Each linear candidate reads its own layout of the weights, and a second layout costs a whole
model's worth of memory (issue 16: the 1.5B shape in fp32 barely fitted a 24 GB machine with
three), so the table gives every row class the same candidate: the one whose slowest row class,
against that class's fastest candidate, loses least. The engine then keeps each weight in that one
layout. The table is cached as JSON beside the compiled
kernels, under a name hashed from ``machine_key()`` (CPU model, its flags, the
``MINISERVE_CPU_FEATURES`` mask, threads, torch and the kernels' sources); a file whose key differs
is measured again, never reused. ``MINISERVE_DISPATCH=linear=onednn,attention=sdpa,amx=off`` forces a
candidate (tests run every path through it; benchmarks compare them); ``decode_attention=`` and
``prefill_attention=`` force one phase's attention (over ``attention=``).

The private ``torch.ops.mkldnn`` calls live here and nowhere else.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model import kernels
from engine.model.kernels import GemvTuning
from engine.model.kernels.features import ENV, cache_sizes, cpu_features, cpu_model, detected

LINEAR = ("gemv", "onednn", "torch")
ATTENTION = ("kernel", "sdpa")
PHASES = ("decode", "prefill")  # a step's two phases, attended apart (engine.model.attention)
FORCEABLE = {"linear": LINEAR, "attention": ATTENTION, "decode_attention": ATTENTION,
             "prefill_attention": ATTENTION, "amx": ("on", "off")}
ROW_CLASSES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# how far ahead (bytes) and into which cache (L2: True) the gemv asks for its weight stream, at one
# row and at more: the distances that won on the CPUs measured so far (docs/architecture.md), timed
# against each other on this one
PREFETCH_ONE = ((0, False), (1 << 10, False), (2 << 10, False), (8 << 10, False), (32 << 10, True))
PREFETCH = ((2 << 10, False), (4 << 10, False), (16 << 10, False), (8 << 10, True), (16 << 10, True), (32 << 10, True))
ONE_THREAD = ", one thread"  # tune_gemv's timings of PREFETCH on one thread: "8, one thread" (AVX2: "6, ...", "3, ...")
SWEEPS = ", sweeps"  # its timings of STREAM_ROWS: "12, sweeps" (AVX2: "6, sweeps", apart from PREFETCH's "6")
# up to how many rows the gemv sweeps the weights once for all rows (past that: 8-row passes over
# blocks of K in cache): 16 rows' sums fill every AVX-512 register, so the compiler spills
STREAM_ROWS = (8, 12, 16)
# the same for AVX2's loop, whose passes take 3 rows: a sweep of one pass or of two (past that:
# 3-row passes over blocks of K, each asking for a share of the next block into L1). On one AVX2
# EPYC the blocks beat the 6-row sweep by 10-21% at 4-6 rows (docs/architecture.md)
STREAM_ROWS_AVX2 = (3, 6)
# a decoder layer's four products (qkv, o, gate+up, down) as (outputs, inputs), Qwen2.5-0.5B's: the
# candidates are timed on layers of these, as a model call runs them (a product's own overhead
# counts: ~0.1 ms per oneDNN call at one row on one CPU, a fifth of a decode's linears)
PROBE_LAYER = ((1152, 896), (896, 896), (9728, 896), (896, 4864))
PROBE_BYTES = (64 << 20, 512 << 20)  # the probe: twice the last-level cache within these, rounded up to a layer
FORCE_ENV = "MINISERVE_DISPATCH"
VERSION = 12  # bump when what is measured or how it is chosen changes
log = logging.getLogger("miniserve.dispatch")


# -- oneDNN (torch's private ops) --------------------------------------------------------------

def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's linear runs ``dtype`` on this CPU: its bf16 path needs AVX-512 (or
    AVX-NE-CONVERT) and refuses an AVX2-only CPU with an error at packing time. A
    ``MINISERVE_CPU_FEATURES`` mask without AVX-512 makes this CPU such a one here too."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype != torch.bfloat16:
        return True
    masked_out = bool(os.environ.get(ENV, "").strip()) and "avx512" not in cpu_features()
    return torch.ops.mkldnn._is_mkldnn_bf16_supported() and not masked_out


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) re-laid for oneDNN's linear: packing on every call is what makes stock bf16
    F.linear slow on CPU."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (rows, K) times a weight packed by ``onednn_pack``."""
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")


# -- blocking from the cache -------------------------------------------------------------------

def row_block(k: int, element_size: int) -> int:
    """Rows of x per pass of the gemv over the weights: as many as fit in half this core's L2 (x
    is read again for every panel), at least 64 (a decode step in one pass: at 64 rows a weight
    byte feeds 32-64 FLOPs, past any CPU's FLOP/byte balance) and a multiple of 8 (the register block)."""
    l2 = cache_sizes().get("L2", 1 << 20)
    return max(64, (l2 // 2) // max(1, k * element_size) // 8 * 8)


def k_block(element_size: int) -> int:
    """k steps of a panel the gemv multiplies into every 8 rows of a pass before moving on: as many
    as fill two thirds of this core's L1 (32 outputs' weights per step), so the later row blocks read
    them from L1 while the next block streams in beside them (a block the size of the whole L1 was
    0.80x as fast at 32 bf16 rows); even (bf16 steps are k pairs) and at least 64. The AVX2 fp32
    gemv rounds it down to its whole 128-step sub-blocks (gemv.cpp)."""
    l1 = cache_sizes().get("L1", 32 << 10)
    return max(64, l1 * 2 // 3 // (kernels.PANEL * element_size) // 2 * 2)


# -- the table ---------------------------------------------------------------------------------

@dataclass
class Table:
    """What this machine dispatches to, per dtype, with the timings that chose it."""

    key: dict
    linear: dict[str, list[str]] = field(default_factory=dict)  # dtype -> choice per ROW_CLASSES
    attention: dict[str, dict[str, str]] = field(default_factory=dict)  # dtype -> phase -> "kernel" | "sdpa"
    timings: dict[str, dict] = field(default_factory=dict)  # dtype -> {"linear": {rows: {cand: s}}, "attention": {...}}
    gemv: dict[str, dict] = field(default_factory=dict)  # dtype -> GemvTuning's fields

    def linear_choices(self, dtype: torch.dtype) -> list[str]:
        force = forced("linear")
        if force is None:
            return self.linear[_name(dtype)]
        if force not in linear_candidates(dtype):
            raise ValueError(f"{FORCE_ENV} forces linear={force}, which this machine cannot run for {dtype}")
        return [force] * len(ROW_CLASSES)

    def attention_choice(self, dtype: torch.dtype, phase: str) -> str:
        """How ``phase`` ("decode" or "prefill") of a step attends."""
        return forced(f"{phase}_attention") or forced("attention") or self.attention[_name(dtype)][phase]

    def gemv_tuning(self, dtype: torch.dtype) -> GemvTuning:
        tuning = GemvTuning(**self.gemv.get(_name(dtype), {}))
        if tuning.amx_rows and not kernels.gemv_amx(dtype):
            # the key does not cover the OS's grant of the tiles (a kernel, a sandbox that refuses it)
            log.warning("cached dispatch runs %s on AMX tiles, which this process cannot; the vector loop", dtype)
            tuning = replace(tuning, amx_rows=0)
        amx = forced("amx")
        if amx == "on" and not kernels.gemv_amx(dtype):
            raise ValueError(f"{FORCE_ENV} forces amx=on, which this machine cannot run for {dtype}")
        return tuning if amx is None else replace(tuning, amx_rows=1 if amx == "on" else 0)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def forced(op: str) -> str | None:
    """The candidate ``MINISERVE_DISPATCH`` forces for ``op`` (``linear=onednn,attention=sdpa,amx=off``),
    or None."""
    text = os.environ.get(FORCE_ENV, "").strip()
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, value = item.partition("=")
        if value not in FORCEABLE.get(name, ()):
            raise ValueError(f"{FORCE_ENV}={text!r}: use " + " and/or ".join(
                f"{n}={'|'.join(vals)}" for n, vals in FORCEABLE.items()) + ", comma-separated")
        if name == op:
            return value
    return None


def machine_key() -> dict:
    """What a cached table is valid for: another CPU, mask, thread count, torch or kernel source is
    another machine. The mask is kept as written: on a CPU with no features it reads to nothing,
    masked or not, yet oneDNN's bf16 answers differently with one set. ``kernels`` is whether they
    built here: a table measured while the build failed (no compiler yet) timed no kernel, and
    reused once they build it kept the engine off them."""
    sources = hashlib.sha256(b"".join(p.read_bytes() for p in kernels.SOURCES + kernels.HEADERS)).hexdigest()[:16]
    return {"version": VERSION, "cpu": cpu_model(), "detected": sorted(detected()), "allowed": sorted(cpu_features()),
            "mask": os.environ.get(ENV, "").strip(), "kernels": kernels.built(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "sources": sources,
            "onednn": onednn_available(torch.float32), "onednn_bf16": onednn_available(torch.bfloat16)}


def table_path(key: dict) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(_get_build_directory(kernels.NAME, verbose=False)) / f"dispatch-{digest}.json"


def load_table(path: Path, key: dict) -> Table | None:
    """The table cached at ``path`` if it was measured on this machine (same key), else None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key:
        return None
    return Table(data["key"], data.get("linear", {}), data.get("attention", {}), data.get("timings", {}),
                 data.get("gemv", {}))


def save_table(path: Path, table: Table) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(vars(table), indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one


def choose_rows(timings: dict[int, dict[str, float]]) -> list[str]:
    """One candidate for every row class from measured seconds ({rows: {candidate: s}}): each
    candidate reads its own layout of the weights and the engine keeps one, so the choice is the
    candidate whose worst ratio to a row class's fastest is least (on a tie, the faster at one row)."""
    cands = [c for c in timings[ROW_CLASSES[0]] if all(c in timings[r] for r in ROW_CLASSES)]

    def worst(c: str) -> tuple[float, float]:
        return max(timings[r][c] / min(timings[r].values()) for r in ROW_CLASSES), timings[ROW_CLASSES[0]][c]

    return [min(cands, key=worst)] * len(ROW_CLASSES)


def choose(timings: dict[str, float]) -> str:
    """The fastest candidate."""
    return min(timings, key=timings.get)


def choice_for_rows(choices: list[str], rows: int) -> str:
    """The candidate for a product of ``rows`` rows: its row class's (the largest class's beyond it)."""
    for bound, choice in zip(ROW_CLASSES, choices):
        if rows <= bound:
            return choice
    return choices[-1]


# -- measuring ---------------------------------------------------------------------------------

def _fastest_alternating(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each function's fastest of ``repeats`` calls, called in turn (after one warm round).

    Why the fastest, not the median: on a shared 2-core VM a neighbour's thread takes a core for a
    scheduler slice now and then, and a call that lost one is 4-8 ms slower whatever the kernel
    (a median of a few calls caught that and picked F.linear for a 1-row product); noise here only
    adds time, so the least time is each candidate's own."""
    times: dict[str, list[float]] = {n: [] for n in fns}
    for i in range(repeats + 1):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            if i:  # the first round warms
                times[name].append(time.perf_counter() - t)
    return {n: min(ts) for n, ts in times.items()}


def linear_candidates(dtype: torch.dtype) -> list[str]:
    """The linear candidates this machine runs for ``dtype``."""
    return [c for c in LINEAR if (c != "gemv" or kernels.gemv(dtype) is not None)
            and (c != "onednn" or onednn_available(dtype))]


@dataclass
class ProbeWeights:
    """The weights the linear candidates are timed on: decoder layers' products (``PROBE_LAYER``),
    as many as make twice this CPU's last-level cache (held within ``PROBE_BYTES``, then rounded up
    to a whole layer: a 2-vCPU guest may be told of a host's whole 480 MiB L3), so small row counts
    stream them from memory as a model's weights do; each in the layout its candidate reads, as the
    engine holds it (the gemv's panels in huge pages)."""

    plain: list[torch.Tensor]
    panels: list[kernels.Panels]
    packed: list[torch.Tensor]

    @classmethod
    @torch.inference_mode()
    def build(cls, dtype: torch.dtype, candidates: list[str]) -> ProbeWeights:
        esize = torch.empty((), dtype=dtype).element_size()
        lo, hi = PROBE_BYTES
        target = min(max(2 * cache_sizes().get("L3", 32 << 20), lo), hi)
        layer_bytes = sum(n * k for n, k in PROBE_LAYER) * esize
        g = torch.Generator().manual_seed(0)
        plain = [(torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
                 for _ in range(max(1, -(-target // layer_bytes))) for n, k in PROBE_LAYER]
        panels = kernels.in_huge_pages([kernels.pack_panels(w) for w in plain]) if "gemv" in candidates else []
        packed = [onednn_pack(w) for w in plain] if "onednn" in candidates else []
        return cls(plain, panels, packed)

    def inputs(self, rows: int) -> dict[int, torch.Tensor]:
        """x for ``rows`` rows, per input width."""
        g = torch.Generator().manual_seed(rows)
        return {k: torch.randn(rows, k, generator=g).to(self.plain[0].dtype) for k in {w.shape[1] for w in self.plain}}

    def gemv(self, xs: dict[int, torch.Tensor], tuning: GemvTuning) -> None:
        gemv = kernels.gemv(self.plain[0].dtype)
        esize = self.plain[0].element_size()
        for p in self.panels:
            gemv(xs[p.k], p, None, row_block(p.k, esize), k_block(esize), tuning)

    def onednn(self, xs: dict[int, torch.Tensor]) -> None:
        for w, packed in zip(self.plain, self.packed):
            onednn_linear(xs[w.shape[1]], packed, None)

    def stock(self, xs: dict[int, torch.Tensor]) -> None:
        for w in self.plain:
            F.linear(xs[w.shape[1]], w)


@torch.inference_mode()
def tune_gemv(dtype: torch.dtype, probe: ProbeWeights, repeats: int = 5) -> tuple[GemvTuning, dict]:
    """The gemv's fastest weight stream here, on its vector loop (the tiles' row count is chosen
    after): ``PREFETCH_ONE``'s distance timed at 1 row, ``PREFETCH``'s at 8 rows (6 on an AVX2-only
    CPU, whose default sweep takes 6: timed at 8 its rows ran in blocks that ignore the distance, and
    the choice was noise) on all threads and on one (the least summed ratio to each one's best), then
    ``STREAM_ROWS`` at 12 and 16 rows (the same; AVX2: ``STREAM_ROWS_AVX2`` at 4 and 6), and where
    the sweep chosen is shorter than the rows the distance was timed at (AVX2's 3 rows: past them the
    rows go in blocks that ignore it), the distance again at that many rows; with the seconds that
    chose them (per row count, row count + ``ONE_THREAD`` and row count + ``SWEEPS``, per
    ``"distance,l2"`` or ``"stream_rows"``).

    Why 8 rows (AVX2: 6) on one thread too: there a product needs its weights and its arithmetic at once (one
    core's stream reads at most its share of the bandwidth while it multiplies at a core's full
    rate), as 8 rows do on all threads only in a fast memory spell, and that is where how far ahead
    the stream is asked for decides the most (one Zen 4: 16-32 KiB into L2 96% of the matmul
    probe, 4 KiB into L1 83%; docs/architecture.md). Timed on all threads alone in a slow spell every
    candidate waits on memory, and the one chosen then can lose 15% in the next fast one."""
    timings: dict[str, dict[str, float]] = {}

    def fastest(rows: int, tunings: dict[str, GemvTuning], key: str | None = None) -> dict[str, float]:
        xs = probe.inputs(rows)
        timings[key or str(rows)] = t = _fastest_alternating(
            {name: (lambda tuning=tuning: probe.gemv(xs, tuning)) for name, tuning in tunings.items()}, repeats)
        return t

    def least_summed(tunings: dict[str, GemvTuning], *runs: dict[str, float]) -> GemvTuning:
        score = {name: sum(t[name] / min(t.values()) for t in runs) for name in tunings}
        return tunings[min(score, key=score.get)]

    one = {f"{d},{int(l2)}": GemvTuning(prefetch_one=d, prefetch_one_l2=l2) for d, l2 in PREFETCH_ONE}
    t = fastest(1, one)
    tuning = one[min(t, key=t.get)]
    # rows one sweep of the weights takes on every machine at the default stream_rows: 8 with
    # AVX-512; AVX2's loop sweeps 6 (gemv.cpp kSweepRowsAvx2), and past that its rows go in blocks
    # that use no stream distance
    avx512 = "avx512" in cpu_features()
    rows = 8 if avx512 else 6
    threads = torch.get_num_threads()

    def distance(base: GemvTuning, rows: int) -> GemvTuning:  # PREFETCH at `rows`, all threads and one
        several = {f"{d},{int(l2)}": replace(base, prefetch=d, prefetch_l2=l2) for d, l2 in PREFETCH}
        runs = [fastest(rows, several)]
        if threads > 1:
            torch.set_num_threads(1)
            try:
                runs.append(fastest(rows, several, f"{rows}{ONE_THREAD}"))
            finally:
                torch.set_num_threads(threads)
        return least_summed(several, *runs)

    tuning = distance(tuning, rows)
    candidates, at_rows = (STREAM_ROWS, (12, 16)) if avx512 else (STREAM_ROWS_AVX2, (4, 6))
    sweeps = {str(n): replace(tuning, stream_rows=n) for n in candidates}
    tuning = least_summed(sweeps, *(fastest(rows, sweeps, f"{rows}{SWEEPS}") for rows in at_rows))
    if tuning.stream_rows < rows:  # AVX2's 3-row sweep: only 2-3 rows read the distance now, so time it there
        tuning = distance(tuning, tuning.stream_rows)
    return tuning, timings


@torch.inference_mode()
def measure_linear(dtype: torch.dtype, probe: ProbeWeights, tuning: GemvTuning = GemvTuning(), repeats: int = 5
                   ) -> dict[int, dict[str, float]]:
    """Seconds per pass over ``probe`` at each row class, per candidate; where the gemv can run on
    AMX tiles, also ``gemv_amx`` (the gemv with them), for ``fold_amx``."""
    cands = linear_candidates(dtype)
    amx = replace(tuning, amx_rows=1) if "gemv" in cands and kernels.gemv_amx(dtype) else None
    vector = replace(tuning, amx_rows=0)
    out: dict[int, dict[str, float]] = {}
    for rows in ROW_CLASSES:
        xs = probe.inputs(rows)
        fns = {"gemv": lambda: probe.gemv(xs, vector), "onednn": lambda: probe.onednn(xs),
               "torch": lambda: probe.stock(xs)}
        fns = {c: fns[c] for c in cands}
        if amx is not None:
            fns["gemv_amx"] = lambda: probe.gemv(xs, amx)
        out[rows] = _fastest_alternating(fns, repeats if rows <= 64 else 3)
    return out


def fold_amx(timings: dict[int, dict[str, float]]) -> tuple[int, dict[int, dict[str, float]]]:
    """From which row class the gemv runs on AMX tiles (0: never), and the timings with ``gemv``
    the gemv so tuned: the smallest class from which the tiles were faster at every larger one
    (one threshold, not a choice per class: a busy moment must not flip one row count alone)."""
    if not timings or not all("gemv_amx" in t for t in timings.values()):  # none timed, or no tiles here
        return 0, timings
    amx_rows = 0
    for rows in reversed(ROW_CLASSES):
        if timings[rows]["gemv_amx"] >= timings[rows]["gemv"]:
            break
        amx_rows = rows
    folded = {}
    for rows, t in timings.items():
        t = dict(t)
        tiled = t.pop("gemv_amx")
        if amx_rows and rows >= amx_rows:
            t["gemv"] = tiled
        folded[rows] = t
    return amx_rows, folded


@torch.inference_mode()
def measure_attention(dtype: torch.dtype, repeats: int = 9) -> dict[str, dict[str, float]]:
    """Seconds per call of each phase's attention with miniserve's kernel and with SDPA: 8 decodes
    × 256 keys; a 128-token prefill chunk after 128 tokens of context (14 query heads over 2 KV heads
    of 64, the 0.5B model's layout)."""
    from engine.model.attention import RaggedBatch, ragged_attention
    decodes, ctx, chunk, heads, kv_heads, d = 8, 256, 128, 14, 2, 64
    kernel = kernels.decode_attention(dtype, d)
    if kernel is None:
        return {phase: {"sdpa": 0.0} for phase in PHASES}
    g = torch.Generator().manual_seed(0)
    k_store = torch.randn(decodes, kv_heads, 1024, d, generator=g).to(dtype)
    v_store = torch.randn(decodes, kv_heads, 1024, d, generator=g).to(dtype)
    shapes = {"decode": ([1] * decodes, [ctx] * decodes), "prefill": ([chunk], [chunk])}
    timings = {}
    for phase, (q_lens, ctxs) in shapes.items():
        q = torch.randn(1, heads, sum(q_lens), d, generator=g).to(dtype)
        slots = list(range(len(q_lens)))
        with_kernel = RaggedBatch.build(slots, q_lens, ctxs, "ragged", kernel)
        with_sdpa = RaggedBatch.build(slots, q_lens, ctxs, "ragged", None)
        timings[phase] = _fastest_alternating({
            "kernel": lambda q=q, b=with_kernel: ragged_attention(None, q, k_store, v_store, b, scaling=d ** -0.5),
            "sdpa": lambda q=q, b=with_sdpa: ragged_attention(None, q, k_store, v_store, b, scaling=d ** -0.5)},
            repeats)
    return timings


def agreed_choices(measure_once: Callable[[], dict[int, dict[str, float]]], tries: int = 3
                   ) -> tuple[list[str], dict[int, dict[str, float]], bool]:
    """Row-class choices that two measurements agree on: a neighbour taking a core for a scheduler
    slice during one measurement can make any candidate look fastest (a cached table chose F.linear
    for one row that way, halving serial decode), but rarely the same wrong one twice. Measures
    up to ``tries`` times and keeps each row class's majority; ``settled`` is False when no two
    measurements agreed on every row (the table is then used, not cached)."""
    return _agreed(measure_once, choose_rows, tries)


def agreed_attention(measure_once: Callable[[], dict[str, dict[str, float]]], tries: int = 3
                     ) -> tuple[dict[str, str], dict[str, dict[str, float]], bool]:
    """Each phase's attention choice by the same rule as the linears' (agreed_choices): one
    measurement, under a neighbour's scheduler slice, had timed the kernel at 15.4 ms against
    SDPA's 4.1 for a bf16 prefill chunk, where again it took 0.55 ms against 1.41, and the choice
    was cached."""
    picks, timings, settled = _agreed(measure_once, lambda t: [choose(t[phase]) for phase in PHASES], tries)
    return dict(zip(PHASES, picks)), timings, settled


def _agreed(measure_once: Callable[[], dict], pick: Callable[[dict], list[str]], tries: int
            ) -> tuple[list[str], dict, bool]:
    """``pick`` of up to ``tries`` measurements, until one equals an earlier one (settled); else
    each position's majority, from the last measurement's timings (not settled)."""
    runs: list[tuple[list[str], dict]] = []
    for _ in range(tries):
        timings = measure_once()
        choice = pick(timings)
        if any(earlier == choice for earlier, _ in runs):
            return choice, timings, True
        runs.append((choice, timings))
    votes = [max(set(col), key=col.count) for col in zip(*(c for c, _ in runs))]
    return votes, runs[-1][1], False


def measure(dtype: torch.dtype, table: Table) -> bool:
    """Time every candidate for ``dtype`` on this machine and record the choices in ``table``;
    False when the measurements never agreed (the machine was too busy to trust them)."""
    t0 = time.perf_counter()
    candidates = linear_candidates(dtype)
    tuning, prefetch, linear, probe_mib = GemvTuning(), {}, {}, 0
    if len(candidates) == 1:  # nothing to choose between (a torch without oneDNN and no kernels: macOS)
        choices, settled = candidates * len(ROW_CLASSES), True
    else:
        probe = ProbeWeights.build(dtype, candidates)
        probe_mib = sum(w.numel() * w.element_size() for w in probe.plain) >> 20
        if "gemv" in candidates:
            tuning, prefetch = tune_gemv(dtype, probe)

        def once() -> dict[int, dict[str, float]]:
            nonlocal linear  # the last measurement, unfolded: kept with the tiles' own column
            linear = measure_linear(dtype, probe, tuning)
            return fold_amx(linear)[1]

        choices, _, settled = agreed_choices(once)
        del probe
    attention_choices, attention, attention_settled = agreed_attention(lambda: measure_attention(dtype))
    settled = settled and attention_settled
    name = _name(dtype)
    table.linear[name] = choices
    table.attention[name] = attention_choices
    table.gemv[name] = asdict(replace(tuning, amx_rows=fold_amx(linear)[0]))  # as the last measurement had it
    table.timings[name] = {"linear": {str(r): t for r, t in linear.items()}, "attention": attention,
                           "gemv_prefetch": prefetch, "probe_mib": probe_mib}
    log.info("dispatch for %s measured on this CPU in %.1f s: linears %s by rows %s, attention %s, gemv %s",
             name, time.perf_counter() - t0, table.linear[name], list(ROW_CLASSES), table.attention[name],
             table.gemv[name])
    if not settled:
        log.warning("dispatch for %s: no two measurements agreed (a busy machine); using the majority "
                    "for this process and measuring again next time", name)
    return settled


_TABLES: dict[str, Table] = {}


def table(dtype: torch.dtype) -> Table:
    """This machine's table with ``dtype`` in it: read from the cache, measured where it lacks it."""
    key = machine_key()
    cache_id = json.dumps(key, sort_keys=True)
    t = _TABLES.get(cache_id)
    path = table_path(key)
    if t is None:
        t = load_table(path, key) or Table(key)
        _TABLES[cache_id] = t
    name, runnable = _name(dtype), set(linear_candidates(dtype))
    if name in t.linear and not set(t.linear[name]) <= runnable:
        # a table from a shared cache, or a kernel build that failed since: measure what runs now
        log.warning("cached dispatch for %s chose %s, which does not run here now (candidates %s); measuring "
                    "again", name, sorted(set(t.linear[name])), sorted(runnable))
        for entry in (t.linear, t.attention, t.timings):
            entry.pop(name, None)
    if name not in t.linear:
        fresh = load_table(path, key)  # another process may have measured it meanwhile
        if fresh is not None and name in fresh.linear and set(fresh.linear[name]) <= runnable:
            t = _TABLES[cache_id] = fresh
        elif measure(dtype, t):
            save_table(path, t)
    return t


def linear_choices(dtype: torch.dtype) -> list[str]:
    """The linear candidate per ROW_CLASSES for ``dtype`` on this machine."""
    return table(dtype).linear_choices(dtype)


def gemv_tuning(dtype: torch.dtype) -> GemvTuning:
    """How the gemv runs ``dtype`` on this machine (prefetch, AMX from which row count)."""
    return table(dtype).gemv_tuning(dtype)


def attention_kernel(dtype: torch.dtype, head_dim: int) -> tuple[Callable | None, frozenset[str]]:
    """miniserve's attention kernel and the phases of a step ("decode", "prefill") it attends on
    this machine: those where it runs and was measured faster than SDPA; (None, nothing) where it
    attends none."""
    kernel = kernels.decode_attention(dtype, head_dim)
    if kernel is None:
        return None, frozenset()
    t = table(dtype)
    phases = frozenset(p for p in PHASES if t.attention_choice(dtype, p) == "kernel")
    return (kernel if phases else None), phases
