"""KV-block accounting, and the prefix cache: freed full prompt blocks kept by content hash.

The pool is the budget that decides admission and preemption; the model runner's KV slots have
the same capacity. Without prefix caching it only counts blocks per request. With it (vLLM's
automatic prefix caching), every full prompt block a request computes is registered under a hash
chained from the previous block's (``block_hashes``), gets a block id (where the real engine keeps
its KV: ``engine/model/prefix_store.py``) and a reference count. When no running request uses a
cached block any more it stays cached, and is evicted, least recently used first, only when a
request needs a block and none is free. Admission looks up the longest cached prefix
(``lookup``) and takes references on it (``grow(..., shared=...)``) instead of computing it.

Accounting: ``num_free`` blocks are neither held nor cached; a request holds ``held[id]`` blocks,
of which ``prefix[id]`` are cached ones it references; cached blocks count once however many
requests reference them. So ``num_free + Σ (held − |prefix|) + |cached| == num_blocks``
(``check``), and a request may take ``num_free + |evictable|`` new blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (request.py imports this module)
    from engine.core.request import Request


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Content keys of the full blocks of ``token_ids``: block i's is a digest of every token up to
    its end (vLLM's chained block hash), so equal keys mean equal prefixes, and a cached block's KV
    is reused only by a prompt that starts with the very tokens it was computed from. The digest
    is cryptographic (BLAKE2b, 128 bits), as vLLM's: Python's ``hash`` of a tuple of token ids is
    a fixed, public function whose 64-bit collisions a client can search for, and a colliding
    prompt would be served another request's KV. The same in every process."""
    out: list[int] = []
    full = len(token_ids) // block_size
    if not full:
        return out
    try:
        data, width = array("q", token_ids[:full * block_size]).tobytes(), 8
    except OverflowError:  # an id past 64 bits (the simulator's placeholder prompts, at millions of requests)
        data, width = b"".join(t.to_bytes(16, "little", signed=True) for t in token_ids[:full * block_size]), 16
    step = width * block_size
    digest = hashlib.blake2b(digest_size=16)
    for start in range(0, full * step, step):
        digest.update(data[start:start + step])
        out.append(int.from_bytes(digest.copy().digest(), "little"))
    return out


class KVBlockPool:
    """Fixed-size KV blocks: counted per request, and (``enable_prefix_caching``) cached by content."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.num_free = num_blocks  # neither held by a request nor cached
        self.held: dict[str, int] = {}  # blocks covering each request's positions, shared ones included
        # --- the prefix cache (empty unless caching) ---
        self.cached: dict[int, int] = {}  # content hash -> block id
        self.hash_of: dict[int, int] = {}  # block id -> content hash (cached blocks)
        self.ref: dict[int, int] = {}  # block id -> requests referencing it (cached blocks only)
        self.evictable: OrderedDict[int, int] = OrderedDict()  # block id -> hash, ref 0, least recent first
        self.prefix: dict[str, list[int]] = {}  # request -> cached block ids it references, in order
        self.pending: dict[str, list[tuple[int, int]]] = {}  # request -> (block index, id) being computed
        self._free_ids = list(range(num_blocks - 1, -1, -1)) if enable_prefix_caching else []
        self.num_evicted = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_used(self) -> int:
        """Blocks some request holds (cached blocks no request uses are free to take)."""
        return self.num_blocks - self.num_free - len(self.evictable)

    # --- allocation -----------------------------------------------------------------------------
    def grow(self, request_id: str, num_tokens: int, shared: Sequence[int] = ()) -> bool:
        """Make ``request_id`` hold enough blocks for ``num_tokens``; False (and no change) if short.
        ``shared``: cached block ids (``lookup``) a request being admitted takes as its first
        blocks instead of new ones."""
        if shared:
            return self._grow_shared(request_id, num_tokens, shared)
        have = self.held.get(request_id, 0)
        need = -(-num_tokens // self.block_size) - have  # blocks_for, inlined: called per request per step
        if need <= 0:
            return True
        if need > self.num_free and not self._evict(need - self.num_free):
            return False
        self.num_free -= need
        self.held[request_id] = have + need
        return True

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - self.held.get(request_id, 0) <= self.num_free + len(self.evictable)

    def add_block_each(self, requests: Sequence[Request]) -> bool:
        """One more block for each request (all holding some already), or False (and no change)
        if the pool is short. (Requests, not ids: the decode lane's calendar files its members.)"""
        n = len(requests)
        if n > self.num_free and not self._evict(n - self.num_free):
            return False
        held = self.held
        for request in requests:
            held[request.request_id] += 1
        self.num_free -= n
        return True

    def _grow_shared(self, request_id: str, num_tokens: int, shared: Sequence[int]) -> bool:
        if request_id in self.held:
            raise ValueError(f"request {request_id} already holds blocks; shared blocks come at admission")
        need = self.blocks_for(num_tokens) - len(shared)
        reviving = sum(1 for b in shared if self.ref[b] == 0)  # they stop being evictable
        if need > self.num_free + len(self.evictable) - reviving:
            return False
        for b in shared:
            if self.ref[b] == 0:
                del self.evictable[b]
            self.ref[b] += 1
        self.prefix[request_id] = list(shared)
        self.held[request_id] = len(shared)
        return self.grow(request_id, num_tokens)  # cannot fail now (evicts only other blocks)

    def _evict(self, n: int) -> bool:
        """Free ``n`` cached blocks no request uses, least recently used first; False (and no
        change) if there are fewer."""
        evictable = self.evictable
        if n > len(evictable):
            return False
        for _ in range(n):
            block_id, h = evictable.popitem(last=False)
            del self.cached[h], self.ref[block_id], self.hash_of[block_id]
            self._free_ids.append(block_id)
        self.num_free += n
        self.num_evicted += n
        return True

    def release(self, request_id: str) -> None:
        """A request finished or was preempted: its own blocks are free, its cached ones lose a
        reference (evictable at zero, the prompt's last block first: a prefix stays reachable)."""
        held = self.held.pop(request_id, 0)
        if not self.caching:
            self.num_free += held
            return
        shared = self.prefix.pop(request_id, ())
        for _, block_id in self.pending.pop(request_id, ()):
            self._free_ids.append(block_id)
        self.num_free += held - len(shared)
        for block_id in reversed(shared):
            self.ref[block_id] -= 1
            if self.ref[block_id] == 0:
                self.evictable[block_id] = self.hash_of[block_id]

    # --- the prefix cache -----------------------------------------------------------------------
    def drop_cached(self) -> None:
        """Forget every cached block (their KV is no longer where the ids say: another engine's run
        on a shared runner wrote there). Only idle blocks can be: a referenced one is an error."""
        if len(self.evictable) != len(self.cached):
            raise RuntimeError("cached blocks are in use by requests in flight; they cannot be dropped")
        evicted = self.num_evicted
        self._evict(len(self.evictable))
        self.num_evicted = evicted  # not evictions: no request needed the room

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of a prompt's block hashes."""
        out = []
        cached = self.cached
        for h in hashes:
            block_id = cached.get(h)
            if block_id is None:
                break
            out.append(block_id)
        return out

    def plan_saves(self, request_id: str, end_block: int) -> list[tuple[int, int]]:
        """Block ids for the request's full prompt blocks before ``end_block`` that the step being
        planned computes (those it neither references nor computes already): the executor
        stores their KV there, and ``commit`` makes them cached once the step ran."""
        first = len(self.prefix.get(request_id, ())) + len(self.pending.get(request_id, ()))
        if first >= end_block:
            return []
        saves = [(i, self._free_ids.pop()) for i in range(first, end_block)]
        self.pending.setdefault(request_id, []).extend(saves)
        return saves

    def commit(self, request_id: str, hashes: Sequence[int]) -> None:
        """The request's pending blocks are computed: cache them under their hashes. A block some
        other request cached meanwhile (same content, computed in the same step) is referenced
        instead, and this request's copy freed."""
        pending = self.pending.pop(request_id, None)
        if not pending:
            return
        prefix = self.prefix.setdefault(request_id, [])
        for i, block_id in pending:
            h = hashes[i]
            existing = self.cached.get(h)
            if existing is None:
                self.cached[h] = block_id
                self.hash_of[block_id] = h
                self.ref[block_id] = 1
                prefix.append(block_id)
                continue
            self._free_ids.append(block_id)
            if self.ref[existing] == 0:
                del self.evictable[existing]
            self.ref[existing] += 1
            prefix.append(existing)
            self.num_free += 1  # its own copy of the block is no longer needed

    def check(self) -> None:
        """Conservation of blocks and reference counts; tests call it after every step."""
        assert self.num_free >= 0
        private = sum(n - len(self.prefix.get(r, ())) for r, n in self.held.items())
        assert self.num_free + private + len(self.cached) == self.num_blocks, "blocks not conserved"
        refs: dict[int, int] = {}
        for r, ids in self.prefix.items():
            assert r in self.held and len(ids) <= self.held[r]
            for b in ids:
                refs[b] = refs.get(b, 0) + 1
        assert set(self.ref) == set(self.cached.values()) == set(self.hash_of)
        for b, n in self.ref.items():
            assert n >= 0 and n == refs.get(b, 0), "reference count off"
            assert (n == 0) == (b in self.evictable)
        pending_ids = [b for saves in self.pending.values() for _, b in saves]
        all_ids = list(self.cached.values()) + pending_ids + self._free_ids
        assert not self.caching or sorted(all_ids) == list(range(self.num_blocks)), "block ids lost or shared"
