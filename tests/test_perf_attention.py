"""The fast paths stay exact: batched decodes over fragmented KV slots, and the vectorized layout."""

import pytest
import torch

from engine.model import kernels
from engine.model.attention import KERNEL_PHASES, RaggedBatch
from engine.core.config import ModelConfig, SchedulerConfig
from engine.model.runner import ModelRunner
from engine.core.plan import BatchPlan
from engine.core.request import Request
from tests.test_model_runner import reference_logits, sdpa_twin


def test_layout_matches_per_token_loop():
    b = RaggedBatch.build([3, 0, 5], [1, 4, 2], [7, 0, 9], "ragged")
    assert b.q_starts == [0, 1, 5]
    assert b.write_slots.tolist() == [3, 0, 0, 0, 0, 5, 5]
    assert b.positions.tolist() == [7, 0, 1, 2, 3, 9, 10]
    assert b.num_decodes == 1 and b.decode_range == (3, 4)


@pytest.mark.parametrize("decode_attention", ["kernel", "sdpa"])
def test_batched_decodes_over_fragmented_slots_match_reference(decode_attention):
    model_config = ModelConfig(name="tiny")
    runner = ModelRunner(model_config, SchedulerConfig(max_num_seqs=6))
    if decode_attention == "sdpa":  # one SDPA over the slots' view, with the decodes scattered into it
        runner.attention_kernel = None
    else:  # the kernel for both phases, whether or not this machine's dispatch table chose it
        cfg = runner.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        runner.attention_kernel = kernels.decode_attention(torch.float32, head_dim)
        runner.kernel_phases = KERNEL_PHASES
        if runner.attention_kernel is None:
            pytest.skip("no decode attention kernel on this machine (as masked)")
    ref = sdpa_twin(model_config)
    g = torch.Generator().manual_seed(5)
    reqs = {f"r{i}": Request(f"r{i}", torch.randint(0, 512, (4 + 3 * i,), generator=g).tolist(), 8)
            for i in range(6)}
    ids = tuple(reqs)
    lens = tuple(reqs[r].num_prompt_tokens for r in ids)
    result = runner.execute(BatchPlan("continuous", ids, lens, (0,) * 6, (True,) * 6, 0), reqs)
    for rid, tok in zip(ids, result.token_ids):
        reqs[rid].append_output(tok, 0.0)
    runner.free(["r1", "r3"])  # holes between the decoding requests' slots
    new = Request("new", torch.randint(0, 512, (5,), generator=g).tolist(), 2)
    reqs["new"] = new
    order = ("r5", "r0", "r4", "r2")  # decodes in an order unrelated to their slots
    plan = BatchPlan("continuous", order + ("new",), (1, 1, 1, 1, 5),
                     tuple(reqs[r].num_prompt_tokens for r in order) + (0,), (True,) * 5, 4)
    result, logits = runner.execute(plan, reqs, return_logits=True)
    for k, rid in enumerate(plan.request_ids):
        r = reqs[rid]
        expected = reference_logits(ref, r.token_ids(0, r.num_tokens))
        assert (expected - logits[k]).abs().max().item() <= 1e-5
        assert result.token_ids[k] == int(expected.argmax())


def test_dense_equal_context_decodes_need_no_mask_and_match_reference():
    model_config = ModelConfig(name="tiny")
    runner = ModelRunner(model_config, SchedulerConfig(max_num_seqs=4))
    runner.attention_kernel = None  # the SDPA path, as machines without the kernel run it
    ref = sdpa_twin(model_config)
    g = torch.Generator().manual_seed(7)
    reqs = {f"e{i}": Request(f"e{i}", torch.randint(0, 512, (6,), generator=g).tolist(), 4) for i in range(3)}
    ids = tuple(reqs)
    result = runner.execute(BatchPlan("continuous", ids, (6,) * 3, (0,) * 3, (True,) * 3, 0), reqs)
    for rid, tok in zip(ids, result.token_ids):
        reqs[rid].append_output(tok, 0.0)
    batch = RaggedBatch.build([0, 1, 2], [1, 1, 1], [6, 6, 6], "ragged")
    assert batch.decode_dense and batch.decode_mask is None  # slots 0..2 in order, all 7 keys visible
    result, logits = runner.execute(BatchPlan("continuous", ids, (1,) * 3, (6,) * 3, (True,) * 3, 3), reqs,
                                    return_logits=True)
    for k, rid in enumerate(ids):
        expected = reference_logits(ref, reqs[rid].token_ids(0, 7))
        assert (expected - logits[k]).abs().max().item() <= 1e-5
        assert result.token_ids[k] == int(expected.argmax())



@pytest.mark.parametrize("phases", [frozenset(), frozenset({"decode"}), frozenset({"prefill"}),
                                    frozenset({"decode", "prefill"})])
@pytest.mark.parametrize("q_lens, ctx_lens", [([1, 1, 1], [4, 9, 2]),  # decodes only
                                              ([5, 3], [0, 6]),  # chunks only
                                              ([1, 1, 4, 1], [7, 3, 0, 2])])  # decodes, then chunks (one of 1 token)
def test_the_kernel_gets_exactly_the_rows_of_its_phases(phases, q_lens, ctx_lens):
    """Pure layout, on any machine (the kernel is any callable): the packed rows the kernel attends,
    their slots and key counts, and what is left to SDPA (the batched decodes, the chunks' masks)."""
    kernel = object()
    b = RaggedBatch.build([2, 0, 3, 1][:len(q_lens)], q_lens, ctx_lens, "ragged", kernel, phases)
    expected = {  # (q_lens, phases) -> the kernel's rows, None: no kernel call
        (3, frozenset()): None, (3, frozenset({"decode"})): (0, 3), (3, frozenset({"prefill"})): None,
        (3, frozenset({"decode", "prefill"})): (0, 3),
        (2, frozenset()): None, (2, frozenset({"decode"})): None, (2, frozenset({"prefill"})): (0, 8),
        (2, frozenset({"decode", "prefill"})): (0, 8),
        (4, frozenset()): None, (4, frozenset({"decode"})): (0, 2), (4, frozenset({"prefill"})): (2, 7),
        (4, frozenset({"decode", "prefill"})): (0, 7),
    }[len(q_lens), phases]
    rows = sum(q_lens)
    if expected is None:
        assert b.kernel is None and not b.kernel_attends_all
    else:
        lo, hi = expected
        assert b.kernel is kernel and b.kernel_rows == expected and b.kernel_attends_all == (expected == (0, rows))
        assert b.kernel_slots.tolist() == b.write_slots.tolist()[lo:hi]
        assert b.kernel_lens.tolist() == [p + 1 for p in b.write_positions.tolist()[lo:hi]]
    decodes = 3 if len(q_lens) == 3 else 2 if len(q_lens) == 4 else 0  # leading one-token entries
    decodes_by_kernel = expected is not None and expected[0] == 0
    chunks_by_kernel = expected is not None and expected[1] == rows and decodes < len(q_lens)
    assert b.first_chunk == decodes
    assert b.num_decodes == (0 if decodes_by_kernel else decodes)  # SDPA's one batched call
    if decodes < len(q_lens):  # SDPA's per-chunk masks, where it attends the chunks
        assert (b.chunk_masks is None) == chunks_by_kernel
