"""Where cached prefix blocks keep their KV in the real engine: a store of blocks by block id.

KV lives in per-request slots (``SlotKVCache``), and a slot is reused as soon as its request
leaves, so a cached block cannot stay where it was computed. Instead, when a step completes a
full prompt block that the pool (engine/core/block_pool.py) will cache, the runner copies its KV
from the slot into this store at the block id the plan names (``BatchPlan.kv_saves``); when a
request is admitted with a prefix hit, the runner copies the hit blocks from the store into the
new slot (``kv_loads``) before the forward, which then computes only the rest of the prompt.
Each cached token costs two copies (in, out) instead of a block table in the attention kernels
(docs/architecture.md, "Prefix caching"). Storage is one anonymous mapping committed only where
written, unlike the slots' huge pages committed at start: a block is copied whole, never streamed
by the attention, and most of a large store may never be written.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

from engine.model.attention import SlotKVCache


class PrefixKVStore:
    """``num_blocks`` blocks of ``block_size`` tokens' keys and values, every layer."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (2, num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        if torch.device(device).type == "cpu":
            self._buffer = mmap.mmap(-1, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
            store = torch.frombuffer(self._buffer, dtype=dtype).view(shape)
        else:
            store = torch.zeros(shape, dtype=dtype, device=device)
        self.keys, self.values = list(store[0]), list(store[1])
        self.block_size = block_size

    @classmethod
    def like(cls, cache: SlotKVCache, num_blocks: int, block_size: int) -> PrefixKVStore:
        layer = cache.keys[0]  # (slots, KV heads, max_len, head dim)
        return cls(len(cache.keys), num_blocks, layer.shape[1], block_size, layer.shape[3], layer.dtype,
                   layer.device)

    def load(self, cache: SlotKVCache, slot: int, block_ids: Sequence[int]) -> None:
        """Blocks ``block_ids`` become positions ``[0, len × block_size)`` of ``slot``."""
        n, bs = len(block_ids), self.block_size
        index = torch.tensor(block_ids, device=cache.keys[0].device)
        for stores, slots in ((self.keys, cache.keys), (self.values, cache.values)):
            for store, layer in zip(stores, slots):
                dst = layer[slot, :, :n * bs].unflatten(1, (n, bs))  # (KV heads, n, bs, D), a view
                dst.copy_(store.index_select(0, index).transpose(0, 1))

    def save(self, cache: SlotKVCache, slot: int, first_block: int, block_ids: Sequence[int]) -> None:
        """Positions of ``slot``'s blocks ``first_block, first_block + 1, ...`` go to ``block_ids``."""
        n, bs = len(block_ids), self.block_size
        index = torch.tensor(block_ids, device=cache.keys[0].device)
        lo = first_block * bs
        for stores, slots in ((self.keys, cache.keys), (self.values, cache.values)):
            for store, layer in zip(stores, slots):
                src = layer[slot, :, lo:lo + n * bs].unflatten(1, (n, bs)).transpose(0, 1)  # (n, heads, bs, D)
                store.index_copy_(0, index, src)
