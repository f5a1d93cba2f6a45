"""The engine on a GPU: the packed ragged forward equals the unbatched reference there too, bf16
stays close to it, and the call timer reads the device's clock.

These run where a GPU is: ``MINISERVE_TEST_DEVICE=cuda pytest tests/test_on_gpu.py`` (or ``mps``);
benchmarks/device_check.py runs them before its end-to-end check. Elsewhere they skip, saying so:
the CPU suite checks the same generic path by forcing it (tests/test_device.py).
"""

import time

import pytest
import torch

from engine.core.config import ModelConfig, SchedulerConfig
from engine.model.device import DeviceTimer, synchronize
from engine.model.runner import ModelRunner

from tests.conftest import TEST_DEVICE  # the one switch: conftest leaves that GPU visible
from tests.test_model_runner import mixed_requests, run_and_compare, run_bf16_against_fp32, sdpa_twin

pytestmark = pytest.mark.skipif(
    TEST_DEVICE not in ("cuda", "mps"),
    reason="GPU checks: run MINISERVE_TEST_DEVICE=cuda|mps pytest tests/test_on_gpu.py on a GPU machine")

CONTINUOUS = SchedulerConfig(name="continuous", max_num_seqs=4, max_num_batched_tokens=16,
                             long_prefill_token_threshold=6)


@pytest.fixture(autouse=True, scope="module")
def _exact_fp32():
    """fp32 products in fp32: TF32 (cuBLAS's fast fp32 mode) would round both sides differently."""
    if TEST_DEVICE == "cuda":
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        yield
        torch.backends.cuda.matmul.allow_tf32 = old
    else:
        yield


@pytest.mark.parametrize("attention", ["ragged", "masked"])
def test_packed_mixed_steps_match_unbatched_reference_fp32_on_gpu(attention):
    model_config = ModelConfig(name="tiny", attention=attention, device=TEST_DEVICE, dtype="float32")
    runner = ModelRunner(model_config, CONTINUOUS)
    assert runner.device.type == TEST_DEVICE and runner.generic and runner._lean is None
    assert runner.cache.keys[0].device.type == TEST_DEVICE
    # a GPU's products pick their algorithm by shape, so a packed row and its unbatched twin are
    # summed in another order: equal to fp32 rounding of the logits, not bit for bit
    _, worst, phases = run_and_compare(runner, sdpa_twin(model_config), CONTINUOUS, mixed_requests(512),
                                       atol=1e-4)
    print(f"{TEST_DEVICE} {attention}: worst |logit - reference| {worst:.2e}")
    assert "mixed" in phases


@pytest.mark.parametrize("name", ["serial", "static"])
def test_serial_and_static_plans_match_the_reference_on_gpu(name):
    model_config = ModelConfig(name="tiny", device=TEST_DEVICE, dtype="float32")
    config = SchedulerConfig(name=name, max_num_seqs=3)
    _, _, phases = run_and_compare(ModelRunner(model_config, config), sdpa_twin(model_config), config,
                                   mixed_requests(512), atol=1e-4)
    assert phases == {"prefill", "decode"}


def test_bf16_on_gpu_conserves_tokens_and_stays_close_to_fp32():
    """bf16 operands: within bf16's rounding of the same weights computed in fp32 (relative L2
    error), every request gets exactly its max_tokens."""
    runner = ModelRunner(ModelConfig(name="tiny", device=TEST_DEVICE, dtype="bfloat16"), CONTINUOUS)
    assert runner.model.dtype == torch.bfloat16 and runner.cache.keys[0].dtype == torch.bfloat16
    worst = run_bf16_against_fp32(runner, CONTINUOUS, mixed_requests(512))
    print(f"{TEST_DEVICE} bf16: worst relative L2 error against fp32 {worst:.2e}")
    assert worst <= 3e-2


def test_timer_reads_the_device_clock_not_the_launch():
    """A product launched asynchronously is timed to its end; an idle wait between start and stop counts."""
    device = torch.device(TEST_DEVICE)
    a = torch.randn(4096, 4096, device=device)
    a @ a
    synchronize(device)
    timer = DeviceTimer(device)
    t0 = time.perf_counter()
    timer.start()
    for _ in range(20):
        a @ a
    seconds = timer.stop()
    wall = time.perf_counter() - t0
    assert 0 < seconds <= wall + 1e-3
    timer.start()
    time.sleep(0.05)
    assert 0.045 <= timer.stop() <= 0.5
