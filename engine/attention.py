"""Packed ragged attention: one (1, T) batch of many requests, each seeing only its own KV.

Registered with transformers' AttentionInterface, so the stock Qwen2/Qwen3 layers call it. The
per-step layout (``RaggedBatch``) reaches it as the ``attention_mask`` value of the mask mapping
that Qwen2Model passes through unchanged, so no global state is involved.

Two backends, both exact:
- ``ragged``: one SDPA per request over its own KV slot (work ∝ Σ n_i·K_i).
- ``masked``: one SDPA over all requests' KV concatenated, with a block-diagonal causal mask
  (work ∝ T·ΣK; wasteful on long prompts, fewer calls for many tiny decodes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "miniserve_ragged"


@dataclass
class RaggedBatch:
    """Where each scheduled request's queries sit in the packed batch and where its KV lives."""

    slots: list[int]
    q_starts: list[int]
    q_lens: list[int]
    ctx_lens: list[int]  # tokens already cached before this step
    write_slots: torch.Tensor  # (T,) slot of every packed token
    write_positions: torch.Tensor  # (T,) position of every packed token
    backend: str = "ragged"
    chunk_masks: list[torch.Tensor | None] | None = None
    block_mask: torch.Tensor | None = None

    @classmethod
    def build(cls, slots: list[int], q_lens: list[int], ctx_lens: list[int], backend: str) -> RaggedBatch:
        q_starts, pos, write_slots = [], [], []
        start = 0
        for slot, n, ctx in zip(slots, q_lens, ctx_lens):
            q_starts.append(start)
            start += n
            pos.append(torch.arange(ctx, ctx + n))
            write_slots.append(torch.full((n,), slot, dtype=torch.long))
        batch = cls(slots, q_starts, q_lens, ctx_lens, torch.cat(write_slots), torch.cat(pos), backend)
        if backend == "ragged":
            batch.chunk_masks = [_chunk_mask(n, ctx) for n, ctx in zip(q_lens, ctx_lens)]
        else:
            batch.block_mask = _block_diagonal_mask(q_lens, ctx_lens)
        return batch

    @property
    def positions(self) -> torch.Tensor:
        return self.write_positions


def _chunk_mask(n: int, ctx: int) -> torch.Tensor | None:
    """Query j (at position ctx+j) sees keys 0..ctx+j; None where SDPA needs no mask."""
    if n == 1 or ctx == 0:
        return None
    return torch.ones(n, ctx + n, dtype=torch.bool).tril(diagonal=ctx)


def _block_diagonal_mask(q_lens: list[int], ctx_lens: list[int]) -> torch.Tensor:
    total_k = sum(ctx + n for n, ctx in zip(q_lens, ctx_lens))
    mask = torch.zeros(sum(q_lens), total_k, dtype=torch.bool)
    q0 = k0 = 0
    for n, ctx in zip(q_lens, ctx_lens):
        mask[q0:q0 + n, k0:k0 + ctx + n] = torch.ones(n, ctx + n, dtype=torch.bool).tril(diagonal=ctx)
        q0 += n
        k0 += ctx + n
    return mask


class SlotKVCache:
    """Per-request KV slots, one row per running request, for every layer.

    Quacks like a transformers Cache for what Qwen2Attention uses: ``update`` writes this
    step's keys/values into their slots and hands the whole layer store to the attention
    function, which reads only each request's own range. Storage is allocated once (untouched
    pages are not committed by the OS), so no step reallocates.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
        self.batch: RaggedBatch | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        b = self.batch
        k_store, v_store = self.keys[layer_idx], self.values[layer_idx]
        k_store[b.write_slots, :, b.write_positions] = key_states[0].transpose(0, 1)
        v_store[b.write_slots, :, b.write_positions] = value_states[0].transpose(0, 1)
        return k_store, v_store


def ragged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: RaggedBatch, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, H, T, D); key/value the layer's slot store. Returns (1, T, H, D)."""
    b = attention_mask
    if b.backend == "masked":
        k = torch.cat([key[s, :, :c + n] for s, n, c in zip(b.slots, b.q_lens, b.ctx_lens)], dim=1)
        v = torch.cat([value[s, :, :c + n] for s, n, c in zip(b.slots, b.q_lens, b.ctx_lens)], dim=1)
        out = F.scaled_dot_product_attention(query, k[None], v[None], attn_mask=b.block_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2), None
    outs = []
    for s, q0, n, c, mask in zip(b.slots, b.q_starts, b.q_lens, b.ctx_lens, b.chunk_masks):
        k = key[s:s + 1, :, :c + n]
        v = value[s:s + 1, :, :c + n]
        outs.append(F.scaled_dot_product_attention(
            query[:, :, q0:q0 + n], k, v, attn_mask=mask, is_causal=(mask is None and n > 1),
            scale=scaling, enable_gqa=True))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTN_IMPLEMENTATION, ragged_attention)
