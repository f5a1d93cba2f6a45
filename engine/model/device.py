"""Where the model runs, in which dtype, and how a model call is timed there.

- ``resolve_device("auto"|"cpu"|"cuda"|"mps")``: auto takes cuda, then mps, then cpu; asking for a
  device this machine lacks fails at once, naming what is missing.
- ``resolve_dtype("auto"|"float32"|"bfloat16", device)``: auto is bf16 only where bf16 arithmetic
  is native (a GPU with bf16, a CPU with AVX512-BF16 or AMX), fp32 elsewhere: on a CPU without
  it oneDNN widens bf16 to fp32 and the calls are no faster (docs/architecture.md has the figures).
- ``DeviceTimer``: a call's duration as the device saw it. GPU launches return before the work is
  done, so a host clock around them measures the launch; the timer synchronises (CUDA events, or
  ``torch.mps.synchronize``). On CPU it is ``time.perf_counter``.
- ``describe(device)``: what a profile records about where it was measured.
"""

from __future__ import annotations

import logging
import platform
import time

from dataclasses import replace

import torch

from engine.core.config import DEVICES, ModelConfig
from engine.model.kernels.features import cpu_features, cpu_model, has_bf16_arithmetic

log = logging.getLogger("miniserve.device")


def _has_mps() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(name: str) -> torch.device:
    """The torch device for ``model.device``; an explicit device this machine lacks is an error."""
    if name not in DEVICES:
        raise ValueError(f"model.device must be one of {DEVICES}, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if _has_mps() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = ("this torch is a CPU-only build (torch.version.cuda is None)" if torch.version.cuda is None
               else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no NVIDIA GPU or driver")
        raise RuntimeError(f"model.device=cuda, but {why}; use model.device=cpu or auto")
    if name == "mps" and not _has_mps():
        mps = getattr(torch.backends, "mps", None)
        why = ("this torch was built without MPS" if mps is None or not mps.is_built()
               else "no Apple GPU (MPS needs macOS 12.3+ on Apple silicon or an AMD GPU)")
        raise RuntimeError(f"model.device=mps, but {why}; use model.device=cpu or auto")
    return torch.device(name)


def device_has_bf16(device: torch.device) -> bool:
    """Whether bf16 arithmetic is native on ``device`` (not widened to fp32 per operation)."""
    if device.type == "cuda":
        if torch.version.hip:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.cuda.get_device_capability(device)[0] >= 8  # Ampere on; a T4 or V100 emulates it
    if device.type == "mps":
        try:  # MPS runs bf16 natively from macOS 14 on; torch refuses it below that
            torch.ones(1, dtype=torch.bfloat16, device=device)
        except (RuntimeError, TypeError):
            return False
        return True
    return has_bf16_arithmetic(cpu_features())


def resolve_dtype(name: str, device: torch.device) -> str:
    """``model.dtype`` as a concrete name: ``auto`` picks bfloat16 where ``device`` has bf16
    arithmetic, float32 elsewhere."""
    if name != "auto":
        return name
    return "bfloat16" if device_has_bf16(device) else "float32"


def resolve(model_config: ModelConfig) -> ModelConfig:
    """The config with ``device`` and ``dtype`` concrete for this machine (``auto`` resolved, the
    choice logged): what the runner builds, the fingerprint hashes and a profile records."""
    device = resolve_device(model_config.device)
    dtype = resolve_dtype(model_config.dtype, device)
    if model_config.dtype == "auto" or model_config.device == "auto":
        log.info("model.device=%s model.dtype=%s → %s, %s%s", model_config.device, model_config.dtype, device.type,
                 dtype, "" if model_config.dtype != "auto" else
                 f" ({'native' if dtype == 'bfloat16' else 'no native'} bf16 arithmetic on {device.type})")
    return replace(model_config, device=device.type, dtype=dtype)


def synchronize(device: torch.device) -> None:
    """Wait for every queued call on ``device`` (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class DeviceTimer:
    """``start()`` … ``stop() -> seconds`` of device work between them.

    CUDA: two events on the current stream, the end one waited for; MPS: synchronise on both ends
    around perf_counter (its profiler regions are logical, not the GPU's time); CPU: perf_counter.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._events = None
        self._t0 = 0.0

    def start(self) -> None:
        if self.device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            synchronize(self.device)  # earlier work must not count (a no-op on CPU)
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.device.type == "cuda":
            self._events[1].record()
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1e3
        synchronize(self.device)
        return time.perf_counter() - self._t0


def describe(device: torch.device) -> dict:
    """Where a measurement ran: device kind and name, driver/runtime, torch, and the CPU with the
    features the kernels used (``MINISERVE_CPU_FEATURES`` applied)."""
    info = {"device": device.type, "torch": torch.__version__, "cpu": cpu_model(),
            "cpu_features": sorted(cpu_features()), "machine": platform.machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, cuda_runtime=torch.version.cuda,
                    compute_capability=f"{props.major}.{props.minor}", driver=_nvidia_driver())
    elif device.type == "mps":
        info.update(device_name=f"Apple GPU ({platform.platform()})", mps_runtime=platform.mac_ver()[0])
    else:
        info["device_name"] = info["cpu"]
    return info


def here(requested: str = "auto") -> dict:
    """``describe`` of the device ``requested`` resolves to on this machine; where it is absent
    (a GPU profile simulated on a laptop), only its kind."""
    try:
        return describe(resolve_device(requested))
    except RuntimeError:
        return {"device": requested}


def _nvidia_driver() -> str | None:
    """The NVIDIA driver version (nvidia-smi), or None where it cannot be read."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None
