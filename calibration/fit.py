"""Fit non-negative cost coefficients and score them on calls the fit never saw."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.linalg import block_diag
from scipy.optimize import nnls

from calibration.physical import hats


def fit_nnls(X: np.ndarray, y: np.ndarray, relative: bool = True) -> np.ndarray:
    """Non-negative least squares; ``relative`` minimises Σ((pred − y)/y)², the error MAPE counts,
    so a 50 ms decode weighs as much as a 1 s prefill. Columns are scaled for conditioning."""
    X = np.asarray(X, dtype=float)
    y = np.asarray(y, dtype=float)
    w = 1.0 / y if relative else np.ones_like(y)
    A = X * w[:, None]
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(A / scale, y * w, maxiter=50 * X.shape[1])
    return coef / scale


def supported_knots(xs: Iterable[float], knots: Sequence[int]) -> list[bool]:
    """Which knots of a hat basis the data pins down: those carrying at least one call's worth of
    hat weight summed over the calls (an x beyond either end weighs on that end). A knot no
    measured call comes near carries no information, and least squares gives it any value (0,
    with non-negativity): a grid with no call near 12 tokens predicted a 12-token prefill at a
    quarter of its time. One call halfway between two knots does not pin either: the fit could
    trade them, doubling that call's noise into the curve."""
    weight = [0.0] * len(knots)
    for x in xs:
        for i, w in hats(x, knots):
            weight[i] += w
    return [w >= 1.0 - 1e-9 for w in weight]


def knot_map(knots: Sequence[int], supported: Sequence[bool], proportional: bool) -> np.ndarray:
    """(all knots × supported knots) map from a curve's values at the supported knots to its values
    at every knot: linear between supported neighbours; past the outermost ones constant, or, for
    a ``proportional`` curve (a cost that grows with its rows), scaled by the knot over the
    outermost. The curve through every knot is then the curve through the supported ones."""
    keep = [i for i, s in enumerate(supported) if s]
    if not keep:
        return np.eye(len(knots))
    kept = [knots[i] for i in keep]
    M = np.zeros((len(knots), len(keep)))
    for j, k in enumerate(knots):
        b = bisect_right(kept, k)  # supported knots at or below k
        if b and knots[keep[b - 1]] == k:
            M[j, b - 1] = 1.0
        elif b == 0 or b == len(keep):
            edge = 0 if b == 0 else len(keep) - 1
            M[j, edge] = k / knots[keep[edge]] if proportional else 1.0
        else:
            lo, hi = knots[keep[b - 1]], knots[keep[b]]
            t = (k - lo) / (hi - lo)
            M[j, b - 1], M[j, b] = 1.0 - t, t
    return M


def fit_nnls_on_knots(X: np.ndarray, y: np.ndarray, groups: Sequence[tuple[int, np.ndarray]]) -> np.ndarray:
    """fit_nnls where some columns are hat bases: ``groups`` gives, per basis, its first column and
    its knot_map; only the supported knots are fitted, the others follow from their neighbours
    (every coefficient stays non-negative: the maps are)."""
    blocks, col = [], 0
    for start, M in sorted(groups, key=lambda g: g[0]):
        blocks += [np.eye(start - col), M]
        col = start + M.shape[0]
    full = block_diag(*blocks, np.eye(X.shape[1] - col))
    return full @ fit_nnls(np.asarray(X, dtype=float) @ full, y)


@dataclass(frozen=True)
class Errors:
    """Per-call relative errors |pred − meas| / meas, summarised."""

    mape: float
    median: float
    max_error: float
    r2: float
    n: int

    @classmethod
    def of(cls, predicted: Sequence[float], measured: Sequence[float]) -> Errors:
        p, m = np.asarray(predicted, float), np.asarray(measured, float)
        rel = np.abs(p - m) / m
        ss_res = float(((p - m) ** 2).sum())
        ss_tot = float(((m - m.mean()) ** 2).sum())
        return cls(float(rel.mean()), float(np.median(rel)), float(rel.max()),
                   1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"), len(m))

    def to_dict(self) -> dict:
        return {"mape": self.mape, "median_error": self.median, "max_error": self.max_error, "r2": self.r2,
                "n": self.n}


def split_heldout(kinds: Sequence[str], fraction: float, seed: int = 0) -> np.ndarray:
    """Boolean mask of held-out rows, the same fraction of every kind (decode, prefill, mixed)."""
    rng = np.random.default_rng(seed)
    kinds = np.asarray(kinds)
    held = np.zeros(len(kinds), dtype=bool)
    for kind in np.unique(kinds):
        idx = np.flatnonzero(kinds == kind)
        k = int(round(fraction * len(idx)))
        if len(idx) - k >= 1:
            held[rng.choice(idx, size=k, replace=False)] = True
    return held
