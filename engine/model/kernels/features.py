"""Which CPU features the engine may use: what this CPU has, less what ``MINISERVE_CPU_FEATURES`` masks.

Why a mask: the kernels and their tests must pass on CPUs we do not sit at (AVX-512 without
AVX512-BF16, AVX2 only, arm64). ``MINISERVE_CPU_FEATURES=avx512`` makes this CPU look like an
AVX-512 one without bf16 arithmetic, ``=avx2`` like one without AVX-512, ``=none`` like one with
neither; the engine's choices (which kernels load, ``model.dtype=auto``) and the C++ ops'
``*_supported`` checks (told by ``engine.model.kernels``) then follow the masked set. A mask only
takes away: a feature this CPU lacks stays absent whatever the mask says.

Torch-free except for the fallback where /proc/cpuinfo is missing (macOS) or names no flags, which
asks torch.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path

ENV = "MINISERVE_CPU_FEATURES"
# feature -> the /proc/cpuinfo flags it needs (x86); each name below implies the ones it builds on
FLAGS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},  # torch's "AVX512" capability
    "avx512_bf16": {"avx512_bf16"},  # bf16 dot products (vdpbf16ps): gemv's bf16 kernel
    "amx_bf16": {"amx_bf16", "amx_tile"},  # bf16 tiles: oneDNN's bf16 matmuls and the gemv's tile path
}
IMPLIES = {"avx2": set(), "avx512": {"avx2"}, "avx512_bf16": {"avx512", "avx2"}, "amx_bf16": {"avx512", "avx2"}}
FEATURES = tuple(FLAGS)


@functools.cache
def _cpuinfo() -> str | None:
    """/proc/cpuinfo, read once (None where there is none: macOS)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


@functools.cache
def _cpuinfo_flags() -> frozenset[str] | None:
    """The first CPU's flags (x86 ``flags``, arm64 ``Features``), or None where /proc/cpuinfo has
    neither (or is absent: macOS), so that torch's own reading of the CPU is asked instead."""
    text = _cpuinfo()
    if text is None:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def _closure(names: set[str]) -> set[str]:
    return names.union(*(IMPLIES[n] for n in names)) if names else set()


def detected(flags: frozenset[str] | None = None) -> frozenset[str]:
    """This CPU's features (before any mask), from its cpuinfo flags, else from torch's capability."""
    flags = _cpuinfo_flags() if flags is None else flags
    if flags is None:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
        return frozenset({"AVX512": {"avx512", "avx2"}, "AVX2": {"avx2"}}.get(capability, set()))
    found = {name for name, need in FLAGS.items() if need <= flags}
    # a feature counts only with what it builds on (no AVX-512 kernels on a CPU lacking AVX2's FMA)
    return frozenset(n for n in found if IMPLIES[n] <= found)


def parse_mask(text: str) -> frozenset[str]:
    """``MINISERVE_CPU_FEATURES``'s value as the features it allows: comma-separated names from
    FEATURES (each with what it builds on), or ``none``."""
    names = {n.strip().lower() for n in text.split(",") if n.strip()}
    if names == {"none"}:
        return frozenset()
    unknown = names - set(FEATURES)
    if unknown:
        raise ValueError(f"{ENV}={text!r}: unknown feature(s) {sorted(unknown)}; use a comma-separated "
                         f"subset of {list(FEATURES)}, or 'none'")
    return frozenset(_closure(names))


def cpu_features(mask: str | None = None, flags: frozenset[str] | None = None) -> frozenset[str]:
    """What the engine may use on this CPU: ``detected()`` ∩ the mask (default: the
    ``MINISERVE_CPU_FEATURES`` environment variable; unset or empty: no mask)."""
    have = detected(flags)
    mask = os.environ.get(ENV, "") if mask is None else mask
    return have & parse_mask(mask) if mask.strip() else have


def has_bf16_arithmetic(features: frozenset[str] | None = None) -> bool:
    """Whether bf16 matmuls run natively here (AVX512-BF16 dot products or AMX tiles), rather than
    widened to fp32: only then is bf16 the faster dtype on this CPU (docs/architecture.md)."""
    features = cpu_features() if features is None else features
    return bool({"avx512_bf16", "amx_bf16"} & features)


@functools.cache
def cpu_model() -> str:
    """This CPU's name (cpu_name), what cached tables and histories are keyed by."""
    return cpu_name(_cpuinfo() or "", platform.system(), platform.processor() or platform.machine())


def cpu_name(cpuinfo: str, system: str, fallback: str) -> str:
    """``model name`` in /proc/cpuinfo (x86), the implementer and part numbers on Linux on ARM
    (which names no model: a Graviton2 and a Graviton3 both said aarch64), the brand string on
    macOS (``Apple M1``), else ``fallback`` (what platform says)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if fields.get("model name"):
        return fields["model name"]
    if "CPU implementer" in fields:
        return f"arm implementer {fields['CPU implementer']} part {fields.get('CPU part', '?')}"
    if system == "Darwin":
        try:
            brand = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                   timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            brand = ""
        if brand:
            return brand
    return fallback


@functools.cache
def cache_sizes() -> dict[str, int]:
    """This CPU's data cache sizes in bytes by level ("L1", "L2", "L3": what one core's sysfs lists),
    for the kernels' blocking; a level sysfs does not list is absent (the caller's default applies)."""
    sizes: dict[str, int] = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = (index / "level").read_text().strip()
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMGB")
        if digits.isdigit():
            sizes[f"L{level}"] = int(digits) * scale
    return sizes
