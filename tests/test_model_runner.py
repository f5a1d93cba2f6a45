"""The packed ragged forward is exact: per-request logits equal an unbatched reference forward."""

import copy
import dataclasses
import gc
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.model import kernels as engine_kernels
from engine.model.kernels import dispatch
from engine.core.config import ModelConfig, SchedulerConfig
from engine.model.lean_qwen2 import rope_is_fixed
from engine.model.loader import load_model, pack_linear_weights
from engine.model.runner import ModelRunner
from engine.core.plan import BatchPlan
from engine.core.request import Request
from engine.core.scheduler import make_scheduler
from engine.core.state import ServingState

ROOT = Path(__file__).resolve().parents[1]


def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Plain transformers forward of one sequence (stock SDPA attention, no cache)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids], device=model.device)).logits[0, -1].float()


def sdpa_twin(model_config: ModelConfig):
    ref, _ = load_model(model_config)
    ref.set_attn_implementation("sdpa")
    return ref


def drive(runner: ModelRunner, config: SchedulerConfig, requests: list[Request],
          check_row: Callable[[list[int], torch.Tensor, int], None]) -> tuple[int, set[str], ServingState]:
    """Serves requests to completion through the scheduler and the runner, handing each sampled row
    (the tokens it was computed from, its logits, the token sampled) to check_row."""
    state = ServingState(config)
    scheduler = make_scheduler(config)
    for r in requests:
        state.add(r)
    steps, phases = 0, set()
    while state.has_unfinished:
        plan = scheduler.schedule(state)
        phases.add(plan.phase)
        result, logits = runner.execute(plan, state.requests, return_logits=True)
        assert torch.isfinite(logits).all() and len(result.token_ids) == plan.num_samples
        k = 0
        for rid, n, ctx, sampled in zip(plan.request_ids, plan.num_tokens, plan.context_lens, plan.samples):
            if sampled:
                check_row(state.requests[rid].token_ids(0, ctx + n), logits[k], result.token_ids[k])
                k += 1
        runner.free(r.request_id for r in state.apply(plan, result.token_ids, 0.0, 0.0))
        steps += 1
    return steps, phases, state


def run_and_compare(runner: ModelRunner, ref, config: SchedulerConfig, requests: list[Request],
                    atol: float) -> tuple[int, float, set[str]]:
    """Every sampled row within atol of the unbatched reference, and its token the reference's argmax."""
    worst = 0.0

    def exact(tokens: list[int], row: torch.Tensor, token: int) -> None:
        nonlocal worst
        expected = reference_logits(ref, tokens)
        worst = max(worst, (expected - row).abs().max().item())
        assert token == int(expected.argmax())

    steps, phases, _ = drive(runner, config, requests, exact)
    assert worst <= atol, worst
    return steps, worst, phases


def run_bf16_against_fp32(runner: ModelRunner, config: SchedulerConfig, requests: list[Request]) -> float:
    """The worst relative L2 error of bf16 logits against the same (bf16-drawn) weights computed in
    fp32, and every request served exactly its max_tokens. A bf16 and an fp32 draw of the seeded
    weights need not be one model: torch's bf16 normal_ draws its own numbers."""
    ref = sdpa_twin(runner.model_config).float()
    worst = 0.0

    def close(tokens: list[int], row: torch.Tensor, _: int) -> None:
        nonlocal worst
        expected = reference_logits(ref, tokens)
        worst = max(worst, ((row.float() - expected).norm() / expected.norm()).item())

    _, _, state = drive(runner, config, requests, close)
    assert sum(r.num_output_tokens for r in state.finished) == sum(r.max_tokens for r in requests)
    return worst


def mixed_requests(vocab: int) -> list[Request]:
    g = torch.Generator().manual_seed(1)
    return [Request(f"m{i}", torch.randint(0, vocab, (3 + 5 * i,), generator=g).tolist(), 2 + i % 3)
            for i in range(6)]


DISPATCH = ["", "linear=gemv,attention=kernel", "linear=onednn,attention=sdpa", "linear=torch,attention=sdpa",
            # a step's phases split between the kernel and SDPA, each way round
            "linear=gemv,decode_attention=kernel,prefill_attention=sdpa",
            "linear=gemv,decode_attention=sdpa,prefill_attention=kernel"]


def force_dispatch(monkeypatch: pytest.MonkeyPatch, force: str) -> str:
    """This test's runners take the dispatch ``force`` names (``dispatch.FORCE_ENV``: "" is the
    measured table's); skipped where its forced linear does not run on this machine. Returns that
    linear ("" for none forced)."""
    monkeypatch.setenv(dispatch.FORCE_ENV, force)
    forced = force.split(",")[0].removeprefix("linear=")
    if forced and forced not in dispatch.linear_candidates(torch.float32):
        pytest.skip(f"no {forced} linear on this machine (as masked)")
    return forced


@pytest.mark.parametrize("force", DISPATCH)
@pytest.mark.parametrize("attention", ["ragged", "masked"])
def test_packed_mixed_steps_match_unbatched_reference_fp32(attention, force, monkeypatch):
    """Exact on every dispatch choice: the measured table's, and each candidate forced."""
    forced = force_dispatch(monkeypatch, force)
    model_config = ModelConfig(name="tiny", attention=attention)
    config = SchedulerConfig(name="continuous", max_num_seqs=4, max_num_batched_tokens=16,
                             long_prefill_token_threshold=6)
    runner = ModelRunner(model_config, config)
    assert not force or set(runner._lean.choices) == {forced}
    if "attention=sdpa" in force.split(","):  # what machines without ours run: oneDNN or F.linear, SDPA, torch's ops
        assert runner.attention_kernel is None and not runner.kernel_phases
        runner._lean.ops = engine_kernels.TORCH_LAYER_OPS
    elif "_attention=" in force:
        if runner.attention_kernel is None:
            pytest.skip("no attention kernel on this machine (as masked)")
        assert runner.kernel_phases == {"decode" if "decode_attention=kernel" in force else "prefill"}
    _, worst, phases = run_and_compare(runner, sdpa_twin(model_config), config, mixed_requests(512), atol=1e-5)
    assert "mixed" in phases  # decodes and chunks with prior context shared one call


@pytest.mark.parametrize("name", ["serial", "static"])
def test_serial_and_static_plans_run_through_the_same_runner(name):
    model_config = ModelConfig(name="tiny")
    config = SchedulerConfig(name=name, max_num_seqs=3)
    runner = ModelRunner(model_config, config)
    steps, _, phases = run_and_compare(runner, sdpa_twin(model_config), config, mixed_requests(512), atol=1e-5)
    assert phases == {"prefill", "decode"}


def test_bf16_runs_and_stays_close_to_fp32_reference():
    config = SchedulerConfig(name="continuous", max_num_seqs=4, max_num_batched_tokens=16,
                             long_prefill_token_threshold=6)
    runner = ModelRunner(ModelConfig(name="tiny", dtype="bfloat16"), config)
    assert runner.model.dtype == torch.bfloat16 and runner.cache.keys[0].dtype == torch.bfloat16
    worst = run_bf16_against_fp32(runner, config, mixed_requests(512))
    assert worst <= 3e-2, worst


@pytest.mark.skipif(not engine_kernels.gemv_amx(torch.bfloat16),
                    reason="the gemv's AMX tiles need a CPU with AMX-BF16 (as masked)")
def test_bf16_steps_on_amx_tiles_match_the_vector_gemv(monkeypatch):
    """The same mixed steps with the gemv forced onto AMX tiles and off them: one model, bf16
    rounding apart (the tiles may add a k pair's two products in the other order)."""
    config = SchedulerConfig(name="continuous", max_num_seqs=4, max_num_batched_tokens=48,
                             long_prefill_token_threshold=20)
    logits = {}
    for amx in ("on", "off"):
        monkeypatch.setenv(dispatch.FORCE_ENV, f"linear=gemv,amx={amx}")
        runner = ModelRunner(ModelConfig(name="tiny", dtype="bfloat16"), config)
        assert runner._lean.gemv_tuning.amx_rows == (1 if amx == "on" else 0)
        state, scheduler, logits[amx] = ServingState(config), make_scheduler(config), []
        for r in mixed_requests(512):
            state.add(r)
        while state.has_unfinished:
            plan = scheduler.schedule(state)
            result, step_logits = runner.execute(plan, state.requests, return_logits=True)
            logits[amx].append(step_logits.float())
            tokens = [2] * len(result.token_ids)  # the same tokens (not EOS) in both runs: the same steps
            runner.free(r.request_id for r in state.apply(plan, tokens, 0.0, 0.0))
    assert len(logits["on"]) == len(logits["off"])
    for on, off in zip(logits["on"], logits["off"]):
        assert on.shape == off.shape and (on - off).abs().max() <= 0.05 * off.abs().max()


def test_bf16_runs_on_a_cpu_without_avx512():
    """An AVX2-only CPU (masked here, in a fresh process: kernel loads are cached per process) has
    none of our bf16 kernels (only fp32 ones have AVX2 forms), and oneDNN's bf16
    linear refuses it at packing time (it raised on a real one): the engine runs bf16 on F.linear there."""
    code = ("import torch\n"
            "from engine.model.kernels import dispatch\n"
            "assert dispatch.linear_candidates(torch.bfloat16) == ['torch'], dispatch.linear_candidates(torch.bfloat16)\n"
            "assert 'onednn' in dispatch.linear_candidates(torch.float32) or not dispatch.onednn_available()\n"
            "import tests.test_model_runner as t\n"
            "t.test_bf16_runs_and_stays_close_to_fp32_reference()\n")
    env = {**os.environ, "MINISERVE_CPU_FEATURES": "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_local_qwen3_checkpoint_loads_offline_and_matches_reference(tmp_path):
    cfg = AutoConfig.for_model("qwen3", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model_config = ModelConfig(name="local", path=str(tmp_path))
    config = SchedulerConfig(name="continuous", max_num_seqs=3, max_num_batched_tokens=12,
                             long_prefill_token_threshold=5)
    runner = ModelRunner(model_config, config)
    assert type(runner.model).__name__ == "Qwen3ForCausalLM"
    run_and_compare(runner, sdpa_twin(model_config), config, mixed_requests(256), atol=1e-5)


def tiny_qwen3(path, head_dim: int = 32) -> ModelConfig:
    """A Qwen3 checkpoint where head_dim is not hidden / heads (48 / 4 = 12), with GQA (4 query
    heads, 2 KV heads), no q/k/v bias and random norm weights (q_norm / k_norm included), so each
    of Qwen3's differences from Qwen2 changes the logits."""
    cfg = AutoConfig.for_model("qwen3", vocab_size=256, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                               max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return ModelConfig(name="local", path=str(path))


@pytest.mark.parametrize("force", DISPATCH)
def test_qwen3_runs_the_lean_path_and_matches_unbatched_reference_fp32(tmp_path, force, monkeypatch):
    """Qwen3 runs the same lean loop and kernels as Qwen2 (q/k norms in the rotary op), exact against
    transformers' Qwen3 on prefill chunks, ragged batched decodes and mixed steps."""
    monkeypatch.setenv(dispatch.FORCE_ENV, force)
    if "gemv" in force and "gemv" not in dispatch.linear_candidates(torch.float32):
        pytest.skip("no gemv kernel on this machine (as masked)")
    model_config = tiny_qwen3(tmp_path)
    config = SchedulerConfig(name="continuous", max_num_seqs=4, max_num_batched_tokens=16,
                             long_prefill_token_threshold=6)
    runner = ModelRunner(model_config, config)
    assert type(runner.model).__name__ == "Qwen3ForCausalLM" and runner._lean is not None
    assert runner.cache.keys[0].shape[-1] == 32  # the config's head_dim, not hidden / heads
    if "attention=sdpa" in force.split(","):  # the path machines without ours run
        assert runner.attention_kernel is None and not runner.kernel_phases
        runner._lean.ops = engine_kernels.TORCH_LAYER_OPS
    _, _, phases = run_and_compare(runner, sdpa_twin(model_config), config, mixed_requests(256), atol=1e-5)
    assert {"mixed", "decode"} <= phases


def test_qwen3_head_dim_without_a_decode_kernel_stays_exact(tmp_path):
    """A head dim the decode attention kernel has no variant for (24) decodes with SDPA, still lean."""
    model_config = tiny_qwen3(tmp_path, head_dim=24)
    config = SchedulerConfig(name="continuous", max_num_seqs=3, max_num_batched_tokens=12,
                             long_prefill_token_threshold=5)
    runner = ModelRunner(model_config, config)
    assert runner._lean is not None and runner.attention_kernel is None
    run_and_compare(runner, sdpa_twin(model_config), config, mixed_requests(256), atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                                  {"rope_type": "dynamic", "factor": 2.0}])
def test_the_lean_forward_reads_rotary_rows_the_module_would_make(dtype, rope):
    """cos/sin come from a table made once over the KV cache's positions: the same bits as the
    rotary module at any positions (yarn: scaled, still fixed); a dynamic rope type keeps calling
    the module, whose frequencies follow the longest sequence seen (here past 16 positions)."""
    runner = ModelRunner(ModelConfig(name="tiny", dtype=dtype), SchedulerConfig(max_num_seqs=2, max_model_len=64))
    lean = runner._lean
    if rope is not None:
        config = copy.deepcopy(runner.model.config)
        config.max_position_embeddings = 16
        config.rope_parameters = {**rope, "rope_theta": config.rope_parameters["rope_theta"]}
        lean.rotary = type(lean.rotary)(config)
        lean._rope_fixed = rope_is_fixed(lean.rotary)
    reference = copy.deepcopy(lean.rotary)  # the module as it stands, called apart
    h = torch.zeros(1, dtype=runner.model.dtype)
    positions = torch.tensor([0, 63, 5, 5, 17])
    if rope is None:  # a table for a shorter cache, made anew for a longer one
        lean._cos_sin(h, positions[positions < 32], 32)
        assert lean._rope_table[0].shape[0] == 32
    cos, sin = lean._cos_sin(h, positions, 64)
    ref_cos, ref_sin = reference(h, positions[None])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
    dynamic = rope is not None and rope["rope_type"] == "dynamic"
    assert lean._rope_fixed is not dynamic
    assert (lean._rope_table is None) if dynamic else (lean._rope_table[0].shape[0] == 64)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(ModelConfig(name="local", path=str(tmp_path)))


@pytest.mark.parametrize("force", ["", "linear=torch", "linear=onednn", "generic"])
def test_runner_freezes_its_startup_objects_and_a_replaced_runner_frees_its_weights(force, monkeypatch):
    """A serving loop's full collections must not re-walk the model and the libraries
    (engine.model.runner.freeze_startup_objects), and the freeze must not keep a dropped runner's
    weights: a reference cycle through them is never collected once frozen. Every linear choice
    (the lean path keeps a different projector for each) and the stock layers."""
    generic = force == "generic"
    if not generic:
        force_dispatch(monkeypatch, force)
    runner = ModelRunner(ModelConfig(name="tiny", dtype="float32"), SchedulerConfig(max_num_seqs=2),
                         generic=generic)
    weight = next(runner.model.parameters())
    scanned = {id(o) for o in gc.get_objects()}
    assert id(runner.model) not in scanned and id(weight) not in scanned
    assert gc.get_freeze_count() > 0
    dropped = weakref.ref(weight)
    del weight, runner
    gc.collect()
    assert dropped() is None


def test_onednn_packed_linears_hold_no_reference_cycle():
    """The stock layers on oneDNN's packed weights (a CPU model the lean path does not take):
    each Linear's new forward must not refer back to it, or a frozen model would never be freed."""
    if not dispatch.onednn_available(torch.float32):
        pytest.skip("no oneDNN on this machine")
    model, _ = load_model(ModelConfig(name="tiny", dtype="float32"))
    assert pack_linear_weights(model) > 0
    head = weakref.ref(model.lm_head)
    gc.disable()  # freed by reference counts alone, as a frozen object must be
    try:
        del model
        assert head() is None
    finally:
        gc.enable()


def test_slots_are_reused_after_free_and_resume_needs_a_slot():
    config = SchedulerConfig(name="continuous", max_num_seqs=2)
    runner = ModelRunner(ModelConfig(name="tiny"), config)
    reqs = {r.request_id: r for r in [Request("a", [1, 2, 3], 2), Request("b", [4, 5], 2)]}
    plan = BatchPlan("continuous", ("a", "b"), (3, 2), (0, 0), (True, True), 0)
    runner.execute(plan, reqs)
    runner.free(["a"])
    with pytest.raises(RuntimeError, match="holds no KV slot"):
        runner.execute(BatchPlan("continuous", ("a",), (1,), (3,), (True,), 1), reqs)
    reqs["c"] = Request("c", [6], 1)
    runner.execute(BatchPlan("continuous", ("c",), (1,), (0,), (True,), 0), reqs)  # takes a's slot


class CountingLayers:
    """Stands in for the lean forward's DecoderLayers, counting the steps it runs."""

    def __init__(self, layers) -> None:
        self.layers, self.calls, self.most_rows = layers, 0, 0

    def run(self, h, *args):
        self.calls += 1
        self.most_rows = max(self.most_rows, h.shape[0])
        return self.layers.run(h, *args)


def sampled_logits(runner: ModelRunner, config: SchedulerConfig, requests: list[Request]) -> tuple[list, int]:
    rows = []
    steps, _, _ = drive(runner, config, requests, lambda tokens, row, token: rows.append(row.clone()))
    return rows, steps


def long_chunk_requests(vocab: int) -> list[Request]:
    g = torch.Generator().manual_seed(2)
    return [Request(f"l{i}", torch.randint(0, vocab, (40 + 23 * i,), generator=g).tolist(), 3) for i in range(3)]


STEPS = {  # small steps, and chunks long enough that the gemv takes rows in passes over blocks of K
    "short": (SchedulerConfig(name="continuous", max_num_seqs=4, max_num_batched_tokens=16,
                              long_prefill_token_threshold=6), mixed_requests),
    "long": (SchedulerConfig(name="continuous", max_num_seqs=4, max_num_batched_tokens=96,
                             long_prefill_token_threshold=64, max_model_len=256), long_chunk_requests),
}


@pytest.mark.parametrize("steps", ["short", "long"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["qwen2", "qwen3"])
def test_the_layers_in_one_call_give_the_python_loops_logits_bit_for_bit(model, dtype, steps, tmp_path, monkeypatch):
    """Where every product runs on the gemv and every token attends on the kernel, a step's layers run
    as one C++ call (kernels.decoder_layers): the same kernels in the same order as the Python loop,
    so the same bits, on every step, Qwen3's q/k norms included, at row counts past the gemv's one
    sweep (its row and k blocks) too."""
    force_dispatch(monkeypatch, "linear=gemv,attention=kernel")
    if "gemv" not in dispatch.linear_candidates(getattr(torch, dtype)):
        pytest.skip(f"no {dtype} gemv on this machine (as masked)")
    model_config = tiny_qwen3(tmp_path) if model == "qwen3" else ModelConfig(name="tiny")
    model_config = dataclasses.replace(model_config, dtype=dtype)
    config, requests = STEPS[steps]
    runner = ModelRunner(model_config, config)
    lean = runner._lean
    if runner.attention_kernel is None or lean.ops is engine_kernels.TORCH_LAYER_OPS:
        pytest.skip("no attention kernel or layer ops on this machine (as masked)")
    assert lean.stack is not None and runner.kernels_used()["decoder_layers"]
    lean.stack = counting = CountingLayers(lean.stack)
    one_call, num_steps = sampled_logits(runner, config, requests(256))
    assert counting.calls == num_steps  # every step: decodes, chunks and mixed ones
    if steps == "long":  # steps past the gemv's one sweep of the weights
        assert counting.most_rows > lean.gemv_tuning.stream_rows
    lean.stack = None
    python_loop, _ = sampled_logits(runner, config, requests(256))
    assert len(one_call) == len(python_loop) and all(torch.equal(a, b) for a, b in zip(one_call, python_loop))


def test_the_layers_run_in_one_call_only_where_every_piece_runs_on_the_kernels(monkeypatch):
    """A step whose chunks attend with SDPA, or a model on torch's layer ops, runs the Python loop."""
    force_dispatch(monkeypatch, "linear=gemv,decode_attention=kernel,prefill_attention=sdpa")
    config = SchedulerConfig(name="continuous", max_num_seqs=4, max_num_batched_tokens=16,
                             long_prefill_token_threshold=6)
    runner = ModelRunner(ModelConfig(name="tiny"), config)
    lean = runner._lean
    if lean.stack is None:
        pytest.skip("no attention kernel or layer ops on this machine (as masked)")
    lean.stack = counting = CountingLayers(lean.stack)
    steps, phases, _ = drive(runner, config, mixed_requests(512), lambda *_: None)
    assert {"decode", "mixed"} <= phases and 0 < counting.calls < steps  # decode-only steps alone
    counting.calls = 0
    lean.ops = engine_kernels.TORCH_LAYER_OPS
    drive(runner, config, mixed_requests(512), lambda *_: None)
    assert counting.calls == 0
    # where no step can attend on the kernel (the masked backend, SDPA for both phases) none is kept
    for attention, force in (("masked", "linear=gemv"), ("ragged", "linear=gemv,attention=sdpa")):
        monkeypatch.setenv(dispatch.FORCE_ENV, force)
        other = ModelRunner(ModelConfig(name="tiny", attention=attention), config)
        assert other._lean.stack is None and not other.kernels_used()["decoder_layers"]


@pytest.mark.skipif(engine_kernels.decoder_layers() is None, reason="miniserve's kernels are not built here")
@pytest.mark.parametrize("counts, message", [
    ((5, 6, 4), "6 weights a layer"),
    ((6, 5, 4), "6 optional tensors a layer"),
    ((6, 6, 3), "4 scalars a layer"),
])
def test_decoder_layers_refuse_a_layout_they_cannot_read(counts, message):
    weights, optionals, scalars = counts
    with pytest.raises(RuntimeError, match=message):
        engine_kernels.decoder_layers()([torch.ones(4)] * weights, [None] * optionals, [1.0] * scalars,
                                        [1, 1, 4, 4], [8] * 8, [0] * 6)


def test_the_layers_in_one_call_are_profiled_as_the_loops_kernel_calls(monkeypatch):
    """Each kernel the one call makes is a profiler region of its op's name, with its inputs' shapes,
    as when the Python loop calls the ops: a profile of a step still says where its time goes."""
    force_dispatch(monkeypatch, "linear=gemv,attention=kernel")
    runner = ModelRunner(ModelConfig(name="tiny"), SchedulerConfig(max_num_seqs=4, max_model_len=64))
    lean = runner._lean
    if lean.stack is None:
        pytest.skip("no one-call layers on this machine (as masked)")
    reqs = {f"r{i}": Request(f"r{i}", list(range(1, 20)), 4) for i in range(2)}
    plan = BatchPlan("continuous", tuple(reqs), (8, 1), (0, 0), (True, True), 0)

    def kernel_events(stack) -> dict[str, list]:
        lean.stack = stack
        with torch.profiler.profile(record_shapes=True) as prof:
            runner.execute(plan, reqs)
        runner.free(reqs)
        events = {}
        for e in prof.events():
            if e.name.startswith("miniserve::") and not e.name.endswith("argmax_rows"):
                events.setdefault(e.name, []).append([list(s) for s in e.input_shapes if s][:2])
        return events

    one_call, loop = kernel_events(lean.stack), kernel_events(None)
    layers = runner.model.config.num_hidden_layers
    assert {name: len(calls) for name, calls in one_call.items()} == {
        "miniserve::gemv": 3 * layers + 1, "miniserve::add_rms_norm": 2 * layers + 1,
        "miniserve::rotary_kv": layers, "miniserve::decode_attention": layers, "miniserve::gate_up_silu": layers,
        "miniserve::panel_rows": 1}  # the tied embedding, read out of the lm_head's panels
    assert one_call == loop  # the same regions with the same input shapes
