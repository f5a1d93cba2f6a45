"""The call shapes a calibration measures: pure decode, pure prefill chunks, and mixed steps.

A shape is torch-free and independent of request ids: decode contexts plus prefill chunks
``(tokens, prior context, samples)``. ``to_plan`` turns it into a BatchPlan over a pool of request
ids, decodes first, as the schedulers build them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from calibration.cost_model import PASS_EDGES
from engine.core.plan import BatchPlan

GRIDS = ("quick", "full")


@dataclass(frozen=True)
class Shape:
    kind: str  # "decode" | "prefill" | "mixed"; "engine" for calls timed inside engine runs
    decode_contexts: tuple[int, ...] = ()
    chunks: tuple[tuple[int, int, bool], ...] = ()  # (tokens, prior context, samples)

    @property
    def num_requests(self) -> int:
        return len(self.decode_contexts) + len(self.chunks)

    @property
    def num_tokens(self) -> int:
        """Tokens the call computes (its plan's total_tokens)."""
        return len(self.decode_contexts) + sum(n for n, _, _ in self.chunks)

    @property
    def max_len(self) -> int:
        """KV positions the shape touches (so the cache is big enough)."""
        return max([c + 1 for c in self.decode_contexts] + [c + n for n, c, _ in self.chunks])

    def to_plan(self, request_ids: list[str]) -> BatchPlan:
        nd = len(self.decode_contexts)
        return BatchPlan.of(
            "calibration",
            request_ids[:self.num_requests],
            (1,) * nd + tuple(n for n, _, _ in self.chunks),
            self.decode_contexts + tuple(c for _, c, _ in self.chunks),
            (True,) * nd + tuple(s for _, _, s in self.chunks),
            nd,
        )

    @classmethod
    def of_plan(cls, plan: BatchPlan, kind: str) -> Shape:
        """The shape of a plan some run made (the calibration's engine runs)."""
        nd = plan.num_decodes
        return cls(kind, tuple(plan.context_lens[:nd]),
                   tuple(zip(plan.num_tokens[nd:], plan.context_lens[nd:], plan.samples[nd:])))

    @property
    def name(self) -> str:
        dec = f"d{len(self.decode_contexts)}@{max(self.decode_contexts)}" if self.decode_contexts else ""
        pre = "+".join(f"p{n}@{c}" for n, c, _ in self.chunks)
        return "+".join(x for x in (dec, pre) if x)


@dataclass(frozen=True)
class GridSpec:
    """Axes of one grid. Mixed steps are drawn at random (seeded) the way the continuous scheduler
    fills a step: some decodes, then prefill chunks within the token budget."""

    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_chunks: tuple[int, ...]
    prefill_contexts: tuple[int, ...]
    multi_prefill: tuple[tuple[int, int], ...]  # (requests, tokens each) whole prompts in one call
    num_mixed: int
    max_batched_tokens: int
    max_seqs: int
    repeats: int
    # (idle seconds, rounds) at which a call after idle is timed against back to back
    # (calibration.profiler.measure_after_idle): what a serving loop's gaps between arrivals span at
    # low load; the longer idles get fewer rounds, as each costs its whole sleep
    idle_levels: tuple[tuple[float, int], ...] = ((0.1, 5), (0.5, 2), (1.5, 1), (4.0, 1))
    seed: int = 0
    # whole prompts (from 0) at these lengths besides prefill_chunks (never held out of the fit:
    # each is its knot's one shape): both sides of every step the
    # gemv's passes may take (cost_model.PASS_EDGES), a knot each, so the fit prices the steps; a
    # calibration keeps those of its machine's block (calibration.calibrate.with_pass_edges)
    edge_chunks: tuple[int, ...] = PASS_EDGES


GRID_SPECS: dict[str, GridSpec] = {
    # a decode at every row count up to max_seqs (a serving loop's decode tail steps through each,
    # and the gemv's cost is not monotone in its rows there: cost_model.py), and in both grids a
    # chunk beside each decode batch: only the two together tell the empirical model's tokens@K
    # from its samples@K (a decode samples every row, a chunk one)
    "quick": GridSpec(decode_batches=(1, 2, 3, 4, 5, 6, 7, 8), decode_contexts=(8, 64),
                      prefill_chunks=(1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48), prefill_contexts=(0, 32),
                      multi_prefill=((2, 12), (4, 12), (8, 12)), num_mixed=12,
                      max_batched_tokens=96, max_seqs=8, repeats=3, idle_levels=((0.1, 3), (0.5, 1), (2.0, 1))),
    # 9, 13, 17 (AVX2: 4, 7): just past each row count up to which the gemv may sweep the weights
    # once (GemvTuning.stream_rows), where a call's cost steps up (calibration/cost_model.py)
    "full": GridSpec(decode_batches=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 16, 17, 24, 32),
                     decode_contexts=(16, 128, 512, 1024),
                     prefill_chunks=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 16, 17, 24, 32, 64, 128, 256),
                     prefill_contexts=(0, 128, 512),
                     multi_prefill=((2, 12), (3, 12), (4, 12), (5, 12), (6, 12), (7, 12), (8, 12), (8, 32), (4, 64)),
                     num_mixed=40,
                     max_batched_tokens=256, max_seqs=32, repeats=3),
}


def edge_prompts(spec: GridSpec) -> list[Shape]:
    """A whole prompt at each of ``spec.edge_chunks``: the shapes that pin the pass-edge knots."""
    return [Shape("prefill", chunks=((n, 0, True),)) for n in spec.edge_chunks]


def build_grid(spec: GridSpec) -> list[Shape]:
    shapes: list[Shape] = []
    for b, c in itertools.product(spec.decode_batches, spec.decode_contexts):
        shapes.append(Shape("decode", decode_contexts=(c,) * b))
    for n, c in itertools.product(spec.prefill_chunks, spec.prefill_contexts):
        # a chunk that starts a prompt past 0 is a continuation; half of them end the prompt
        samples = c == 0 or (n + c) % 2 == 0
        shapes.append(Shape("prefill", chunks=((n, c, samples),)))
    shapes += [s for s in edge_prompts(spec) if s not in shapes]  # (a grid chunk from 0 may be one)
    for k, n in spec.multi_prefill:
        shapes.append(Shape("prefill", chunks=((n, 0, True),) * k))
    rng = np.random.default_rng(spec.seed)
    ctx_hi = max(spec.decode_contexts)
    while sum(s.kind == "mixed" for s in shapes) < spec.num_mixed:
        nd = int(rng.integers(1, min(spec.max_seqs, 16) + 1))
        decodes = tuple(int(x) for x in rng.integers(1, ctx_hi + 1, nd))
        budget = spec.max_batched_tokens - nd
        chunks = []
        for _ in range(int(rng.integers(1, 4))):
            if budget < 1 or nd + len(chunks) >= spec.max_seqs:
                break
            n = int(rng.integers(1, min(budget, max(spec.prefill_chunks)) + 1))
            c = int(rng.choice((0, 0, int(rng.integers(1, max(spec.prefill_contexts) + 1)))))
            chunks.append((n, c, bool(rng.random() < 0.7)))
            budget -= n
        if chunks:
            shapes.append(Shape("mixed", decode_contexts=decodes, chunks=tuple(chunks)))
    return shapes
