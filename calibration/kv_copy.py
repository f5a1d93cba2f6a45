"""The cost of prefix caching's copies: seconds per token moved between a KV slot and the
prefix store (engine/model/prefix_store.py), each way, on the runner's model shape.

The fit's features never see a copy (the grid has no prefix hits), so this is measured on its
own: store and load ``n`` tokens for a few ``n``, median of repeats, and the slope of a line
through them. The simulator charges ``kv_copy_s_per_token`` × the plan's ``kv_copy_tokens``.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import numpy as np
import torch

from engine.model.device import DeviceTimer
from engine.model.prefix_store import PrefixKVStore
from engine.model.runner import ModelRunner

SIZES = (64, 256, 1024)  # tokens per copy: a few blocks to a long prompt's worth


@dataclass(frozen=True)
class CopyCost:
    load_s_per_token: float  # store → slot (a prefix hit)
    save_s_per_token: float  # slot → store (a computed prompt block)
    load_fixed_s: float
    save_fixed_s: float
    block_size: int
    sizes: tuple[int, ...]

    @property
    def s_per_token(self) -> float:
        """What a plan's copied token (loaded or stored alike) is charged."""
        return (self.load_s_per_token + self.save_s_per_token) / 2

    def to_dict(self) -> dict:
        return {**asdict(self), "s_per_token": self.s_per_token}


def measure_kv_copy(runner: ModelRunner, block_size: int = 16, sizes: tuple[int, ...] = SIZES,
                    repeats: int = 7) -> CopyCost:
    """Time the store's ``load`` and ``save`` on the runner's own KV slots (slot 0)."""
    if max(sizes) > runner.cache.keys[0].shape[2]:
        sizes = tuple(n for n in sizes if n <= runner.cache.keys[0].shape[2]) or (block_size,)
    blocks = max(sizes) // block_size
    store = PrefixKVStore.like(runner.cache, blocks, block_size)
    with torch.no_grad():
        for layer in store.keys + store.values:  # touch every page once: a run's store is warm too
            layer.normal_()
    medians = {"load": [], "save": []}
    timer = DeviceTimer(runner.device)  # a GPU copy returns before it is done
    for n in sizes:
        ids = list(range(n // block_size))
        for kind in medians:
            times = []
            for _ in range(repeats + 1):  # the first is a warm-up
                timer.start()
                if kind == "load":
                    store.load(runner.cache, 0, ids)
                else:
                    store.save(runner.cache, 0, 0, ids)
                times.append(timer.stop())
            medians[kind].append(statistics.median(times[1:]))
    tokens = np.asarray([n // block_size * block_size for n in sizes], dtype=float)
    (load_slope, load_fixed), (save_slope, save_fixed) = (
        np.polyfit(tokens, medians[k], 1) if len(tokens) > 1 else (medians[k][0] / tokens[0], 0.0)
        for k in ("load", "save"))
    return CopyCost(max(0.0, float(load_slope)), max(0.0, float(save_slope)), float(load_fixed),
                    float(save_fixed), block_size, tuple(int(t) for t in tokens))
