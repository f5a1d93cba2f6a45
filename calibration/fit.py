"""Fit non-negative cost coefficients and score them on calls the fit never saw."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls


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
