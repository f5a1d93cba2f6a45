"""Prefix caching in the real engine (tiny model): a hit skips the computation, changes no logit,
and the simulator, replaying the real run, makes the same hits and plans."""

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.config import ModelConfig, SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.core.request import Request
from engine.llm_engine import Engine
from engine.model.runner import ModelRunner
from engine.observe.workload import LengthDist, WorkloadConfig, generate, make_requests
from sim import ReplayExecutor, simulate

CACHING = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, long_prefill_token_threshold=16,
                          num_kv_blocks=48, block_size=8, max_model_len=128, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(ModelConfig(name="tiny"), replace(CACHING, num_kv_blocks=256))


class LogitsOf:
    """The runner as an executor, keeping each sampled row's logits by request."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.logits, self.plans = runner, {}, []

    def execute(self, plan, requests, start_s):
        result, logits = self.runner.execute(plan, requests, start_s, return_logits=True)
        self.plans.append(plan.materialize())
        sampled = [rid for rid, s in zip(plan.request_ids, plan.samples) if s]
        for rid, row in zip(sampled, logits):
            self.logits.setdefault(rid, []).append(row.clone())
        return result

    def free(self, request_ids):
        self.runner.free(request_ids)


def serve(runner: ModelRunner, config: SchedulerConfig, *batches: list[Request]) -> LogitsOf:
    """Each batch served to the end before the next arrives, through EngineCore and the runner."""
    core, executor = EngineCore(config), LogitsOf(runner)
    for batch in batches:
        for r in batch:
            core.add(r)
        while core.has_unfinished:
            assert core.step(0.0, executor) is not None
    runner.free(core.state.take_released())
    return executor


def test_a_prefix_hit_skips_the_prefix_and_leaves_logits_unchanged(runner):
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 512, (37,), generator=g).tolist()
    first = Request("first", shared + [1, 2, 3], 3)
    follow = [Request("b", shared + [4, 5, 6, 7, 8], 4), Request("c", shared[:20] + [9] * 30, 4)]
    hit = serve(runner, CACHING, [first], follow)
    cold = serve(runner, replace(CACHING, enable_prefix_caching=False),
                 [Request(r.request_id, list(r.prompt_token_ids), r.max_tokens) for r in follow])
    loads = {rid: len(ids) for p in hit.plans for rid, ids in p.kv_loads}
    assert loads == {"b": 4, "c": 2}  # 32 of b's and 16 of c's prompt tokens came from the cache
    first_chunk = {}
    for p in hit.plans:
        for rid, n, ctx in zip(p.request_ids, p.num_tokens, p.context_lens):
            first_chunk.setdefault(rid, (n, ctx))
    assert first_chunk["b"][1] == 32 and first_chunk["c"][1] == 16  # their first chunk starts past the hit
    computed = lambda ex: sum(p.total_tokens - p.num_decodes for p in ex.plans)  # noqa: E731
    assert computed(hit) == 40 + (42 - 32) + (50 - 16) and computed(cold) == 42 + 50
    for rid in ("b", "c"):
        assert len(hit.logits[rid]) == len(cold.logits[rid]) == 4
        for a, b in zip(hit.logits[rid], cold.logits[rid]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


MULTI_TURN = WorkloadConfig(arrival="poisson", rate=40.0, num_requests=14, content="multi_turn", turns=3,
                            turn_gap_s=0.05, prefix_tokens=16, seed=0,
                            prompt=LengthDist(kind="uniform", low=3, high=14, max=100),
                            output=LengthDist(kind="uniform", low=1, high=6))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1000), num_kv_blocks=st.sampled_from([14, 48]), name=st.sampled_from(["continuous", "static"]))
def test_the_simulator_makes_the_real_runs_hits_and_plans(runner, seed, num_kv_blocks, name):
    # few blocks: preemption, recompute and eviction too
    config = replace(CACHING, name=name, num_kv_blocks=num_kv_blocks)
    workload = replace(MULTI_TURN, seed=seed)
    engine = Engine(config, runner.model_config, runner=runner)
    real = engine.run(make_requests(generate(workload), vocab_size=512))
    engine.reset()  # frees the KV slots of the last step's requests
    sim = simulate(make_requests(generate(workload)), config, lambda: ReplayExecutor(real.steps), keep_steps=True)
    assert [s.plan for s in sim.steps] == [s.plan for s in real.steps]
    assert sum(len(s.plan.kv_loads) for s in real.steps) > 0
    by_id = {r.request_id: r for r in real.records}
    for rec in sim.records:
        ref = by_id[rec.request_id]
        assert (rec.cached_tokens, rec.lookup_tokens) == (ref.cached_tokens, ref.lookup_tokens)
    for key in ("prefix_cache_hits", "prefix_cache_queries", "prefix_hit_requests"):
        assert sim.metrics()[key] == real.metrics()[key]


def test_engines_sharing_a_runner_do_not_serve_each_others_cached_blocks(runner):
    """Each engine's pool numbers its blocks from 0 in the runner's one prefix store: B's run wrote
    over the blocks A had cached, and A then hit them with B's keys and values (a review: logits
    0.39 off). The engine that runs now owns the store; another's cache is dropped."""
    g = torch.Generator().manual_seed(5)
    p, q = (torch.randint(0, 512, (16,), generator=g).tolist() for _ in range(2))
    a, b = Engine(CACHING, runner.model_config, runner=runner), Engine(CACHING, runner.model_config, runner=runner)
    a.run([Request("a1", p, 1)])
    b.run([Request("b1", q, 1)])
    a2 = Request("a2", p + [7, 8, 9], 3)
    assert a.run([a2]).records[0].cached_tokens == 0  # dropped, not a hit on what b wrote
    plain = Request("f", p + [7, 8, 9], 3)
    Engine(replace(CACHING, enable_prefix_caching=False), runner.model_config, runner=runner).run([plain])
    assert a2.output_token_ids == plain.output_token_ids
    a3 = Request("a3", p + [7, 8, 9], 3)
    assert a.run([a3]).records[0].cached_tokens > 0  # a's own cache works again (the other engine cached nothing)
    assert a3.output_token_ids == plain.output_token_ids


def test_sliding_window_layers_are_refused_not_run_as_full_attention():
    from transformers import Qwen2Config

    from engine.model.runner import refuse_sliding_window

    with pytest.raises(ValueError, match="sliding_attention .*use_sliding_window"):
        refuse_sliding_window(Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
                                          max_window_layers=0))
    refuse_sliding_window(Qwen2Config(num_hidden_layers=2))  # full attention everywhere: served


def test_a_request_that_heeds_eos_gets_the_models_eos_id(runner):
    """Through the Python API a request with ignore_eos=False but no EOS id never stopped at EOS."""
    engine = Engine(replace(CACHING, enable_prefix_caching=False), runner.model_config, runner=runner)
    heeds, ignores = Request("e", [3, 4, 5], 4, ignore_eos=False), Request("i", [3, 4, 5], 4)
    engine.validate(heeds)
    engine.validate(ignores)
    assert heeds.eos_token_id == runner.eos_token_id is not None and ignores.eos_token_id is None
