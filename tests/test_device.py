"""Device choice, dtype=auto, the synchronised timer, and the device-generic runner path (stock
layers, KV slots as device tensors, greedy on the device, no CPU kernel), forced on CPU so every
machine tests what a GPU runs."""

import json
import logging
import time
from dataclasses import replace

import pytest
import torch

from engine.core.config import ModelConfig, SchedulerConfig
from engine.model import device as dev
from engine.model import kernels
from engine.model.kernels.features import detected
from engine.model.runner import ModelRunner, _torch_greedy
from tests.test_model_runner import drive, mixed_requests, run_and_compare, sdpa_twin

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
NO_MPS = pytest.mark.skipif(dev._has_mps(), reason="this machine has an Apple GPU")


def test_auto_takes_cuda_then_mps_then_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dev, "_has_mps", lambda: False)
    assert dev.resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(dev, "_has_mps", lambda: True)
    assert dev.resolve_device("auto") == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dev.resolve_device("auto") == torch.device("cuda")
    assert dev.resolve_device("cpu") == torch.device("cpu")


@NO_CUDA
def test_cuda_without_a_gpu_fails_at_once_naming_what_is_missing():
    missing = "CPU-only build" if torch.version.cuda is None else "sees no NVIDIA GPU or driver"
    with pytest.raises(RuntimeError, match=f"model.device=cuda, but .*{missing}"):
        dev.resolve_device("cuda")
    with pytest.raises(RuntimeError, match="model.device=cuda"):  # before any model is built
        ModelRunner(ModelConfig(name="tiny", device="cuda"), SchedulerConfig(max_num_seqs=2))


@NO_MPS
def test_mps_without_an_apple_gpu_fails_at_once():
    with pytest.raises(RuntimeError, match="model.device=mps, but (this torch was built without MPS|no Apple GPU)"):
        dev.resolve_device("mps")


@NO_CUDA
def test_the_apps_refuse_an_absent_device_before_they_start(tmp_path):
    import subprocess
    import sys

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "experiments.seed", "model=tiny", "model.device=cuda",
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "model.device=cuda, but" in proc.stderr
    assert not (tmp_path / "seed.json").exists() and time.perf_counter() - t0 < 60


def test_unknown_device_is_refused_at_config_time():
    with pytest.raises(ValueError, match="model.device must be one of"):
        ModelConfig(device="tpu")


@pytest.mark.parametrize("mask", ["avx512", "avx512_bf16", "avx2"])
def test_dtype_auto_is_bf16_only_where_the_cpu_has_bf16_arithmetic(monkeypatch, mask, caplog):
    monkeypatch.setenv("MINISERVE_CPU_FEATURES", mask)
    bf16 = mask == "avx512_bf16" and "avx512_bf16" in detected()
    assert dev.resolve_dtype("auto", torch.device("cpu")) == ("bfloat16" if bf16 else "float32")
    assert dev.resolve_dtype("float32", torch.device("cpu")) == "float32"  # explicit wins
    with caplog.at_level(logging.INFO, logger="miniserve.device"):
        resolved = dev.resolve(ModelConfig(name="tiny", dtype="auto", device="cpu"))
    assert resolved.dtype == ("bfloat16" if bf16 else "float32") and resolved.device == "cpu"
    assert "model.dtype=auto" in caplog.text  # the choice is logged


@pytest.mark.parametrize("capability,native", [((7, 5), False), ((7, 0), False), ((8, 0), True), ((9, 0), True)])
def test_dtype_auto_on_cuda_is_bf16_only_where_the_gpu_computes_it(monkeypatch, capability, native):
    """A T4 (7.5) or V100 (7.0) runs bf16 emulated, slower than fp32; Ampere (8.x) on natively."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert dev.resolve_dtype("auto", torch.device("cuda")) == ("bfloat16" if native else "float32")


@NO_MPS
def test_dtype_auto_on_mps_probes_bf16_and_takes_fp32_when_refused():
    assert not dev.device_has_bf16(torch.device("mps"))  # the probe fails here as on macOS < 14


def test_cpu_timer_measures_wall_time():
    timer = dev.DeviceTimer("cpu")
    timer.start()
    time.sleep(0.05)
    assert 0.05 <= timer.stop() < 30  # the sleep at least; the bound only catches a unit slip (ms, ns)


def test_cuda_timer_waits_for_its_end_event_and_reads_device_time(monkeypatch):
    log = []

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing
            self.name = "start" if not any(e == "new" for e in log) else "end"
            log.append("new")

        def record(self):
            log.append(f"record {self.name}")

        def synchronize(self):
            log.append(f"sync {self.name}")

        def elapsed_time(self, end):
            assert log[-1] == "sync end"  # read only after the device finished the call
            return 12.5  # ms, as CUDA events report

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = dev.DeviceTimer(torch.device("cuda"))
    timer.start()
    assert timer.stop() == pytest.approx(0.0125)
    assert [e for e in log if e != "new"] == ["record start", "record end", "sync end"]


def test_mps_timer_synchronises_on_both_ends(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append(time.perf_counter()))
    timer = dev.DeviceTimer(torch.device("mps"))
    timer.start()
    time.sleep(0.02)
    seconds = timer.stop()
    assert len(calls) == 2 and 0.02 <= seconds and seconds >= calls[1] - calls[0] - 1e-3


@pytest.mark.parametrize("attention", ["ragged", "masked"])
def test_the_generic_path_equals_the_unbatched_reference_fp32(attention, monkeypatch):
    def no_kernels(*args):
        raise AssertionError("the generic path must not ask for a CPU kernel")

    for name in ("gemv", "decode_attention", "layer_ops", "argmax_rows"):
        monkeypatch.setattr(kernels, name, no_kernels)
    model_config = ModelConfig(name="tiny", attention=attention, device="cpu")
    config = SchedulerConfig(name="continuous", max_num_seqs=4, max_num_batched_tokens=16,
                             long_prefill_token_threshold=6)
    runner = ModelRunner(model_config, config, generic=True)
    assert runner.generic and runner._lean is None and runner.greedy is _torch_greedy
    assert not hasattr(runner.cache, "_buffer")  # slots are device tensors, not the CPU's mmap
    assert not any(hasattr(m, "packed_weight") for m in runner.model.modules())  # no oneDNN packing
    assert not any(runner.kernels_used().values())
    _, worst, phases = run_and_compare(runner, sdpa_twin(model_config), config, mixed_requests(512), atol=1e-5)
    assert "mixed" in phases


def test_a_forward_that_bypasses_the_kv_slots_is_an_error_not_wrong_logits():
    """Were the stock forward handed the slots under a name it does not take (transformers renamed
    past_key_values to cache), it would attend over each step's own keys: that must raise."""
    config = SchedulerConfig(name="serial", max_num_seqs=2)
    runner = ModelRunner(ModelConfig(name="tiny", device="cpu"), config, generic=True)
    assert runner._cache_arg in ("cache", "past_key_values")
    runner._cache_arg = "kv_cache_under_another_name"
    layers = len(runner.cache.keys)
    with pytest.raises(RuntimeError, match=f"wrote 0 of {layers} layers' keys through the engine's KV cache"):
        drive(runner, config, mixed_requests(512)[:1], lambda *row: None)


def test_profile_from_another_device_is_warned_about_and_another_model_refused(tmp_path, caplog):
    from calibration.cost_model import FEATURES, ProfileMismatchError
    from engine.model.loader import config_fingerprint
    from sim.run import load_cost_model

    model = ModelConfig(name="tiny", dtype="auto")
    here = dev.here("cpu")
    measured = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "cuda_runtime": "12.8"}
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"feature_names": list(FEATURES), "coefficients": [0.0] * len(FEATURES),
                                   "fingerprint": config_fingerprint(replace(model, dtype="bfloat16")),
                                   "model": {"name": "tiny", "dtype": "bfloat16"}, "measured_on": measured}))
    with caplog.at_level(logging.WARNING, logger="miniserve.sim"):
        cost = load_cost_model(str(profile), replace(model, device="cpu"))  # dtype=auto: the profile's choice
    assert "measured on cuda (NVIDIA H100 80GB HBM3), but this run is on cpu" in caplog.text
    assert cost.info["device_warning"] in caplog.text
    same = json.loads(profile.read_text()) | {"measured_on": {k: here[k] for k in ("device", "device_name")}}
    profile.write_text(json.dumps(same))
    assert "device_warning" not in load_cost_model(str(profile), replace(model, device="cpu")).info
    with pytest.raises(ProfileMismatchError, match="calibrate this model first"):
        load_cost_model(str(profile), ModelConfig(name="qwen2_5_0_5b", dtype="bfloat16", device="cpu"))


def test_a_profile_whose_calls_took_other_kernels_is_said_to(caplog):
    from calibration.cost_model import other_kernels_warning
    from experiments.validate import warn_other_kernels
    from sim.executors import cost_model_from

    profiled = {"gemv": True, "decode_attention": True, "layer_ops": True, "decoder_layers": True}
    assert other_kernels_warning({"kernels": profiled}, dict(profiled)) is None
    assert other_kernels_warning({}, profiled) is None and other_kernels_warning({"kernels": profiled}, {}) is None
    off = {**profiled, "gemv": False, "decoder_layers": False}  # e.g. MINISERVE_KERNELS=0 for the linears
    warning = other_kernels_warning({"kernels": profiled}, off)
    assert "decoder_layers on there, off here, gemv on there, off here" in warning
    assert "calibrate with the kernels this engine runs" in warning
    # a kernel one side does not name is not recorded there (a profile from before it existed)
    assert "argmax not recorded there, on here" in other_kernels_warning({"kernels": profiled},
                                                                          {**profiled, "argmax": True})
    # on another device than the profile's every CPU kernel is off: the device warning says it all
    on_cpu = {"kernels": profiled, "device": "cpu"}
    assert other_kernels_warning(on_cpu, off, "cuda") is None and other_kernels_warning(on_cpu, off, "cpu")
    cost = replace(cost_model_from(const=0.01), info={"measured_on": on_cpu})
    with caplog.at_level(logging.WARNING, logger="experiments.validate"):
        warn_other_kernels(cost, [{"kernels": profiled, "device": "cpu"}, {"kernels": off, "device": "cpu"},
                                  {"kernels": off, "device": "cpu"}, {"kernels": off, "device": "cuda"}, {}])
    assert caplog.text.count("other kernels") == 1 and "gemv on there, off here" in caplog.text


def test_describe_says_where_a_measurement_ran():
    info = dev.describe(torch.device("cpu"))
    assert info["device"] == "cpu" and info["torch"] == torch.__version__ and info["device_name"] == info["cpu"]
    assert set(info["cpu_features"]) <= {"avx2", "avx512", "avx512_bf16", "amx_bf16"}
