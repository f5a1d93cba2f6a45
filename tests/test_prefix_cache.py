"""Prefix caching in the shared core: hashes, the pool's cache, admission past a hit."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_pool import KVBlockPool, block_hashes
from engine.core.config import SchedulerConfig
from engine.core.request import Request
from engine.core.scheduler import make_scheduler
from engine.observe.workload import LengthDist, WorkloadConfig, generate, make_requests
from tests.helpers import drain

MULTI_TURN = WorkloadConfig(arrival="poisson", rate=20.0, num_requests=24, content="multi_turn", turns=3,
                            turn_gap_s=0.3, prefix_tokens=24, seed=2,
                            prompt=LengthDist(kind="uniform", low=4, high=20, max=200),
                            output=LengthDist(kind="uniform", low=1, high=8))


def test_block_hashes_chain_from_the_previous_block():
    a = list(range(40))
    assert len(block_hashes(a, 16)) == 2  # the partial third block has no hash
    assert block_hashes(a[:32] + [99] * 8, 16) == block_hashes(a, 16)  # equal prefixes, equal hashes
    changed = [1000] + a[1:]
    assert all(x != y for x, y in zip(block_hashes(changed, 16), block_hashes(a, 16)))  # the chain carries it
    # the same block after another prefix is another block
    assert block_hashes([5] * 16 + a[16:32], 16)[1] != block_hashes(a, 16)[1]


def test_blocks_whose_python_hashes_collide_get_different_keys():
    """Python's hash of a tuple of ints is public arithmetic: hash(2**61 - 1) == hash(0), so these
    two blocks had one key, and a prompt built to collide would have been served another's KV."""
    block, twin = [0] * 16, [2 ** 61 - 1] + [0] * 15
    assert hash(tuple(block)) == hash(tuple(twin))
    assert block_hashes(block, 16) != block_hashes(twin, 16)
    assert block_hashes(block + [7] * 16, 16)[1] != block_hashes(twin + [7] * 16, 16)[1]


def _cache_request(pool: KVBlockPool, rid: str, prompt: list[int]) -> list[int]:
    """Admit, compute and release a request whose prompt fills whole blocks: its blocks get cached."""
    hashes = block_hashes(prompt, pool.block_size)
    assert pool.grow(rid, len(prompt))
    pool.plan_saves(rid, len(hashes))
    pool.commit(rid, hashes)
    pool.check()
    pool.release(rid)
    pool.check()
    return hashes


def test_lru_eviction_only_under_pressure_oldest_and_tail_first():
    pool = KVBlockPool(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = _cache_request(pool, "a", list(range(8)))
    b = _cache_request(pool, "b", list(range(100, 108)))
    assert pool.num_free == 2 and len(pool.evictable) == 4 and pool.num_used == 0
    assert pool.grow("c", 8)  # the two free blocks: nothing evicted
    assert pool.num_evicted == 0 and len(pool.lookup(a)) == 2
    assert pool.grow("c", 12)  # one more: a's tail block, the least recently used
    assert pool.num_evicted == 1 and len(pool.lookup(a)) == 1 and len(pool.lookup(b)) == 2
    pool.check()


def test_a_cached_block_in_use_is_never_evicted_and_references_count():
    pool = KVBlockPool(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = _cache_request(pool, "a", list(range(8)))
    hit = pool.lookup(a)
    assert pool.grow("x", 10, shared=hit) and pool.grow("y", 9, shared=hit)
    assert [pool.ref[b] for b in hit] == [2, 2] and not pool.evictable
    assert pool.num_free == 0  # x and y each took one block of their own
    assert not pool.grow("z", 4)  # no free block, none evictable: refused rather than evicting a used one
    assert not pool.add_block_each([Request("x", range(10), 4)])
    pool.check()
    pool.release("x")
    assert [pool.ref[b] for b in hit] == [1, 1] and not pool.evictable
    pool.release("y")
    assert [pool.ref[b] for b in hit] == [0, 0] and len(pool.evictable) == 2
    pool.check()


def test_admission_skips_the_cached_prefix_and_keeps_one_token_to_compute():
    config = SchedulerConfig(max_num_seqs=2, block_size=4, enable_prefix_caching=True)
    first = Request("a", list(range(12)), 2)
    plans, state = drain(config, [first])
    again = Request("b", list(range(12)), 2)  # the whole prompt cached: 8 tokens hit, 4 computed
    longer = Request("c", list(range(12)) + [50, 51], 2, arrival_s=0.0)
    for r in (again, longer):
        state.add(r)
    plan = make_scheduler(config).schedule(state)
    assert plan.request_ids == ("b", "c") and plan.context_lens == (8, 12) and plan.num_tokens == (4, 2)
    assert [len(ids) for _, ids in plan.kv_loads] == [2, 3]
    assert state.prefix_hits == 20 and state.prefix_hit_requests == 2 and again.num_cached_tokens == 8


@pytest.mark.parametrize("name", ["serial", "static", "continuous"])
def test_caching_off_changes_nothing_and_on_saves_prefill(name):
    config = SchedulerConfig(name=name, max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=32,
                             num_kv_blocks=64, max_model_len=256)
    off, off_state = drain(config, make_requests(generate(MULTI_TURN)))
    on, on_state = drain(replace(config, enable_prefix_caching=True), make_requests(generate(MULTI_TURN)))
    assert off_state.prefix_hits == 0 and not any(p.kv_loads or p.kv_saves for p in off)
    assert on_state.prefix_hits > 0
    computed = lambda plans: sum(p.total_tokens - p.num_decodes for p in plans)  # noqa: E731
    assert computed(on) == computed(off) - on_state.prefix_hits


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), blocks=st.integers(6, 40), block_size=st.sampled_from([2, 4, 8]),
       name=st.sampled_from(["static", "continuous"]), turns=st.integers(1, 4), prefix=st.integers(0, 20))
def test_random_runs_keep_blocks_and_reference_counts_consistent(seed, blocks, block_size, name, turns, prefix):
    # drain() checks invariants after every step: blocks conserved, reference counts equal to the
    # requests holding each block (never negative), evictable blocks exactly those with none,
    # block ids never shared or lost; small pools preempt and evict
    workload = replace(MULTI_TURN, seed=seed, turns=turns, prefix_tokens=prefix,
                       prompt=LengthDist(kind="uniform", low=1, high=12, max=40))
    config = SchedulerConfig(name=name, max_num_seqs=4, max_num_batched_tokens=16, long_prefill_token_threshold=8,
                             num_kv_blocks=max(blocks, -(-48 // block_size)), block_size=block_size,
                             max_model_len=48, enable_prefix_caching=True)
    _, state = drain(config, make_requests(generate(workload)))
    assert len(state.finished) == len(generate(workload))
    assert state.kv.num_used == 0 and not state.kv.held
