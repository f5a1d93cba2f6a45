"""Each linear's weight lives in one layout once the engine is built (issue 16, memory): the one
its dispatch choice reads, the model's own parameter released unless it is that layout, and a
tied embedding read out of the lm_head's layout rather than kept a second time."""

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.core.config import ModelConfig, SchedulerConfig
from engine.model import kernels
from engine.model.kernels import dispatch
from engine.model.runner import ModelRunner
from engine.model.weights import released
from tests.test_model_runner import force_dispatch


def layouts(p) -> list[str]:
    return [name for name in ("panels", "packed", "plain") if getattr(p, name) is not None]


def held_bytes(runner: ModelRunner) -> int:
    """Bytes of weights the runner holds: its layouts and the parameters not released, each storage once."""
    tensors = {}
    for p in runner._lean.projections:
        if p.packed is not None:  # an opaque oneDNN tensor: no storage to ask, its elements' bytes
            tensors[id(p.packed)] = p.packed.numel() * p.packed.element_size()
        for t in (p.panels.data if p.panels else None, p.plain):
            if t is not None:
                tensors[t.data_ptr()] = t.nbytes
    for prm in runner.model.parameters():
        if not released(prm):
            tensors[prm.data_ptr()] = prm.nbytes
    return sum(tensors.values())


@pytest.mark.parametrize("force", ["", "linear=gemv", "linear=onednn", "linear=torch"])
def test_each_linear_weight_lives_in_one_layout(force, monkeypatch):
    """The measured table's choice (one candidate at every row count) and each candidate forced."""
    force_dispatch(monkeypatch, force)
    runner = ModelRunner(ModelConfig(name="tiny"), SchedulerConfig(max_num_seqs=2, max_model_len=64))
    lean, model = runner._lean, runner.model
    choice = lean.choices[0]
    assert set(lean.choices) == {choice}  # one candidate for every row count
    assert all(layouts(p) == [{"gemv": "panels", "onednn": "packed", "torch": "plain"}[choice]]
               for p in lean.projections)
    embedding = model.model.embed_tokens.weight
    # what still holds memory: F.linear's plain weight is the parameter; oneDNN's tied lm_head is the embedding
    kept = {p.plain.data_ptr() for p in lean.projections if p.plain is not None}
    kept |= {embedding.data_ptr()} if choice == "onednn" else set()
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            assert released(m.weight) or m.weight.data_ptr() in kept, name
    params = {prm.data_ptr(): prm for prm in model.parameters()}
    one_copy = sum(prm.numel() * prm.element_size() for prm in params.values())
    # oneDNN's packed lm_head cannot be read as an embedding: the tied embedding stays beside it
    extra = embedding.numel() * embedding.element_size() if choice == "onednn" else 0
    assert held_bytes(runner) <= 1.02 * one_copy + extra
    if choice == "gemv":
        assert released(embedding) and lean.embed_panels is lean.lm.panels


needs_kernels = pytest.mark.skipif(not kernels.built(), reason="panels are read back by miniserve's kernels, not built here")


@needs_kernels
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 300), rows=st.integers(0, 11),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
@example(n=70, k=65, rows=11, dtype=torch.bfloat16)  # past the op's 32 steps of reads ahead, an odd K
def test_panel_rows_read_back_the_packed_weight(n, k, rows, dtype):
    w = torch.randn(n, k).to(dtype)
    ids = torch.randint(0, n, (rows,))
    got = kernels.panel_rows(kernels.pack_panels(w), ids)
    assert got.is_contiguous() and got.shape == (rows, k) and torch.equal(got, F.embedding(ids, w))


@needs_kernels
@pytest.mark.parametrize("bad", [70, 95, -1])  # past n in the last panel's padding, past the panels, negative
def test_panel_rows_refuse_an_id_outside_the_weight(bad):
    panels = kernels.pack_panels(torch.randn(70, 5).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=f"id {bad} is outside"):
        kernels.panel_rows(panels, torch.tensor([3, bad]))


def test_the_stock_forward_on_cpu_reads_only_oneDNN_copies(tmp_path):
    """A model the lean forward does not cover (here a GELU MLP) runs the stock layers over oneDNN's
    packed weights: their sources are released, except the tied lm_head's, which is the embedding."""
    if not dispatch.onednn_available():
        pytest.skip("no oneDNN in this torch")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512, "tie_word_embeddings": True, "hidden_act": "gelu"}))
    runner = ModelRunner(ModelConfig(name="local", path=str(tmp_path)), SchedulerConfig(max_num_seqs=2))
    model = runner.model
    assert runner._lean is None
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            assert hasattr(m, "packed_weight") and (released(m.weight) or m is model.lm_head), name
    assert not released(model.model.embed_tokens.weight)
