"""Packed ragged attention: one (1, T) batch of many requests, each seeing only its own KV.

Registered with transformers' AttentionInterface, so the stock Qwen2/Qwen3 layers call it. The
per-step layout (``RaggedBatch``) reaches it as the ``attention_mask`` value of the mask mapping
that Qwen2Model passes through unchanged, so no global state is involved.

Two backends, both exact:
- ``ragged``: each of a step's two phases (its decodes; its prefill chunks) attends with what was
  measured faster for it on this CPU (engine/model/kernels/dispatch.py): miniserve's attention
  kernel (engine/model/kernels/decode_attention.cpp), where every packed token is a row of its
  request's slot that sees keys 0..position(t), a decode and each token of a chunk alike, all of a
  phase in ONE call; or SDPA: all single-token entries (decodes) in one SDPA over a view of their
  slots' KV (no copy: keys past each request's length are masked off), then one SDPA per prefill
  chunk over its own slot (work ∝ Σ n_i·K_i). Where both phases take the kernel, every packed token
  goes in one call. The phases can differ: on a CPU with AMX, SDPA runs a bf16 chunk's products on
  the tiles, which the kernel's per-row dot products do not match, while the kernel attends
  decodes faster than SDPA (figures in docs/architecture.md).
- ``masked``: one SDPA over all requests' KV concatenated, with a block-diagonal causal mask
  (work ∝ T·ΣK; wasteful on long prompts, fewer calls for many tiny decodes).

On a GPU the batch's index tensors and masks move to the device (``RaggedBatch.build(device=)``),
the KV slots are device memory (``SlotKVCache(device=)``), and the prefill chunks of a ``ragged``
step go through one ``flash_attn_varlen_func`` where flash-attn is installed (CUDA, fp16/bf16),
else SDPA per chunk as on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
import transformers
from transformers import AttentionInterface

from engine.model import kernels
from engine.model.kernels.dispatch import PHASES

ATTN_IMPLEMENTATION = "miniserve_ragged"
KERNEL_PHASES = frozenset(PHASES)  # a step's two phases, both by the kernel where it attends

try:  # optional, CUDA only: all of a step's prefill chunks in one varlen kernel
    from flash_attn import flash_attn_varlen_func
except ImportError:  # the usual case (and always on CPU): SDPA per chunk
    flash_attn_varlen_func = None


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
    kernel: Callable | None = None  # kernels.decode_attention, for the phases it attends; None: SDPA
    kernel_rows: tuple[int, int] = (0, 0)  # the packed rows [lo, hi) it attends, each a row of its slot
    kernel_slots: torch.Tensor | None = None  # (hi - lo,) each of those rows' slot
    kernel_lens: torch.Tensor | None = None  # (hi - lo,) keys each of those rows sees (its position + 1)
    first_chunk: int = 0  # entries [0, first_chunk) are single-token (decodes), the rest prefill chunks
    num_decodes: int = 0  # SDPA: leading single-token entries, attended in one batched call
    decode_range: tuple[int, int] = (0, 0)  # slots [lo, hi) viewed by that call
    decode_rows: torch.Tensor | None = None  # each decode's row in that view
    decode_mask: torch.Tensor | None = None  # (hi - lo, 1, 1, max K): key j visible to row r; None: all
    decode_k_len: int = 0  # keys viewed per slot (the longest decode's context + 1)
    decode_dense: bool = False  # decode i sits in slot lo + i: queries and outputs need no scatter/gather
    chunk_masks: list[torch.Tensor | None] | None = None
    block_mask: torch.Tensor | None = None

    def to(self, device: torch.device) -> RaggedBatch:
        """Every index tensor and mask on ``device`` (where the model and its KV slots are)."""
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        if self.chunk_masks is not None:
            self.chunk_masks = [None if m is None else m.to(device) for m in self.chunk_masks]
        return self

    @classmethod
    def build(cls, slots: list[int], q_lens: list[int], ctx_lens: list[int], backend: str,
              kernel: Callable | None = None, kernel_phases: frozenset[str] = KERNEL_PHASES,
              device: torch.device | None = None) -> RaggedBatch:
        """``kernel`` attends the phases in ``kernel_phases`` ("decode", "prefill"); SDPA the rest."""
        q_starts = list(accumulate(q_lens, initial=0))[:-1]
        # each packed token's position and KV slot, built as lists: torch's repeat_interleave costs
        # ~0.1 ms a call on CPU, more than the lists for any batch a step packs
        if all(n == 1 for n in q_lens):  # decodes only
            positions = torch.tensor(ctx_lens, dtype=torch.long)
            token_slots = torch.tensor(slots, dtype=torch.long)
        else:
            positions = torch.tensor([p for n, c in zip(q_lens, ctx_lens) for p in range(c, c + n)], dtype=torch.long)
            token_slots = torch.tensor([s for n, s in zip(q_lens, slots) for _ in range(n)], dtype=torch.long)
        batch = cls(slots, q_starts, q_lens, ctx_lens, token_slots, positions, backend)
        d = batch.first_chunk = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
        if backend == "ragged":
            decodes_by_kernel = kernel is not None and (d == 0 or "decode" in kernel_phases)
            chunks_by_kernel = kernel is not None and (d == len(q_lens) or "prefill" in kernel_phases)
            lo = 0 if decodes_by_kernel else d  # in rows, as entries [0, d) are one row each
            hi = len(positions) if chunks_by_kernel else d
            if lo < hi:
                batch.kernel, batch.kernel_rows = kernel, (lo, hi)
                batch.kernel_slots, batch.kernel_lens = token_slots[lo:hi], positions[lo:hi] + 1
            if not chunks_by_kernel:
                batch.chunk_masks = [_chunk_mask(n, ctx) for n, ctx in zip(q_lens, ctx_lens)]
            if d and not decodes_by_kernel:
                lo, hi = min(slots[:d]), max(slots[:d]) + 1
                rows = torch.tensor(slots[:d]) - lo
                visible = torch.ones(hi - lo, dtype=torch.long)  # rows of other slots: any finite key
                visible[rows] = torch.tensor(ctx_lens[:d]) + 1
                k_len = int(visible.max())
                batch.num_decodes, batch.decode_range, batch.decode_rows = d, (lo, hi), rows
                batch.decode_k_len = k_len
                batch.decode_dense = slots[:d] == list(range(lo, hi))
                if int(visible.min()) < k_len:  # all rows seeing all k_len keys need no mask
                    batch.decode_mask = (torch.arange(k_len)[None] < visible[:, None])[:, None, None]
        else:
            batch.block_mask = _block_diagonal_mask(q_lens, ctx_lens)
        return batch if device is None else batch.to(device)

    @property
    def kernel_attends_all(self) -> bool:
        """Whether the kernel attends every packed token (one call a layer, nothing for SDPA)."""
        return self.kernel is not None and self.kernel_rows == (0, len(self.write_positions))

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
    function, which reads only each request's own range. Storage is allocated once, so no step
    reallocates.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | None = None) -> None:
        shape = (2, num_layers, num_slots, num_kv_heads, max_len, head_dim)
        if device is None:
            # CPU: one mapping of transparent huge pages, written with zeros (every key a batched
            # decode reads past a request's length is finite, and nothing is cleared per step) and so
            # committed whole now. Why huge pages: the attention kernel reads each (request, KV head)'s
            # keys and values as fresh streams of tens of KB, and through 4 KiB pages each page is a
            # TLB miss whose walk goes to memory once a step's weights have swept the caches; 24
            # layers of 8 bf16 decodes at 257 keys attended in 0.88x the time, 32 decodes in 0.87x
            # (docs/architecture.md). Why now: a page first written mid-run stalls that step (a 2 MiB
            # page took 0.2-4.5 ms on one VM), which no simulated step has; a server commits its KV
            # cache when it starts.
            store = kernels.huge_page_arena([shape], dtype)[0]
            store.zero_()
        else:  # device memory, zeroed once (finite keys past each length, as above)
            store = torch.zeros(shape, dtype=dtype, device=device)
        self.keys, self.values = list(store[0]), list(store[1])
        self.batch: RaggedBatch | None = None
        self._written: set[int] = set()  # layers that wrote through update() in this step (the stock forward's)

    def start_step(self, batch: RaggedBatch) -> None:
        self.batch = batch
        self._written.clear()

    def check_written(self) -> None:
        """A stock forward that bypassed update() attended over its own keys alone: wrong logits
        with no error, so it is one."""
        if len(self._written) != len(self.keys):
            raise RuntimeError(
                f"the model's forward wrote {len(self._written)} of {len(self.keys)} layers' keys through the engine's "
                f"KV cache: transformers {transformers.__version__} passes the cache under a name this runner "
                "does not give it (engine/model/runner.py, _cache_arg)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        b = self.batch
        self._written.add(layer_idx)
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
    heads, dim = query.shape[1], query.shape[3]
    scale = scaling if scaling is not None else dim ** -0.5
    if b.kernel_attends_all:
        return _kernel_rows(query, key, value, b, scale), None
    outs = []
    d = b.first_chunk
    if b.kernel is not None and b.kernel_rows[0] == 0:  # the decodes by the kernel
        outs.append(_kernel_rows(query, key, value, b, scale))
    elif b.num_decodes:
        lo, hi = b.decode_range
        kv_heads = key.shape[1]
        # (1, H, d, D) -> (rows, KV heads, group, D): a decode's query heads that share a KV head
        # become that head's "query length", so SDPA needs neither GQA expansion nor a copy of K/V.
        q = query[0, :, :d].transpose(0, 1).reshape(d, kv_heads, heads // kv_heads, dim)
        if not b.decode_dense:  # slots with holes or out of order: scatter into the slot rows
            q_rows = query.new_zeros(hi - lo, kv_heads, heads // kv_heads, dim)
            q_rows[b.decode_rows] = q
            q = q_rows
        k_len = b.decode_k_len
        out = F.scaled_dot_product_attention(q, key[lo:hi, :, :k_len], value[lo:hi, :, :k_len],
                                             attn_mask=b.decode_mask, scale=scaling)
        outs.append((out if b.decode_dense else out[b.decode_rows]).reshape(1, d, heads, dim))
    if d == len(b.slots):
        pass
    elif b.kernel is not None and b.kernel_rows[0] > 0:  # the chunks by the kernel
        outs.append(_kernel_rows(query, key, value, b, scale))
    elif flash_attn_varlen_func is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        outs.append(_chunks_flash_varlen(query, key, value, b, d, scaling))
    else:
        for s, q0, n, c, mask in zip(b.slots[d:], b.q_starts[d:], b.q_lens[d:], b.ctx_lens[d:], b.chunk_masks[d:]):
            k = key[s:s + 1, :, :c + n]
            v = value[s:s + 1, :, :c + n]
            outs.append(F.scaled_dot_product_attention(
                query[:, :, q0:q0 + n], k, v, attn_mask=mask, is_causal=(mask is None and n > 1),
                scale=scaling, enable_gqa=True).transpose(1, 2))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


def _kernel_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, b: RaggedBatch,
                 scale: float) -> torch.Tensor:
    """The kernel over the packed rows it attends (one phase of the step): (1, rows, H, D)."""
    lo, hi = b.kernel_rows
    q = query[0, :, lo:hi].transpose(0, 1).contiguous()  # (rows, H, D)
    return b.kernel(q, key, value, b.kernel_slots, b.kernel_lens, scale)[None]


def _chunks_flash_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, b: RaggedBatch, d: int,
                         scaling: float | None) -> torch.Tensor:
    """The prefill chunks (entries d..) in one flash-attn varlen call: their queries are contiguous
    after the decodes; each chunk's keys (its slot's first ctx + n) are gathered into one packed run.
    Causal masking in flash-attn >= 2.1 aligns the last query with the last key, so query j of a
    chunk at context c sees keys 0..c+j, as SDPA with _chunk_mask does."""
    q = query[0, :, b.q_starts[d]:].transpose(0, 1).contiguous()  # (Tc, H, D)
    k = torch.cat([key[s, :, :c + n].transpose(0, 1) for s, n, c in zip(b.slots[d:], b.q_lens[d:], b.ctx_lens[d:])])
    v = torch.cat([value[s, :, :c + n].transpose(0, 1) for s, n, c in zip(b.slots[d:], b.q_lens[d:], b.ctx_lens[d:])])
    q_lens, k_lens = b.q_lens[d:], [c + n for n, c in zip(b.q_lens[d:], b.ctx_lens[d:])]
    cu_q = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, *accumulate(k_lens)], dtype=torch.int32, device=q.device)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), softmax_scale=scaling, causal=True)
    return out[None]  # (1, Tc, H, D)


AttentionInterface.register(ATTN_IMPLEMENTATION, ragged_attention)
