"""Freeing weights the forward no longer reads, once a packed layout has replaced them.

Why: each packed layout (oneDNN's, the gemv's panels) is a whole copy of the weights; keeping the
model's own parameters beside it doubles the memory (issue 16, memory)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch


def release(param: torch.Tensor) -> None:
    """Free a parameter nothing reads any more: a zero-stride view keeps its shape, dtype and
    count (ModelShape, state-dict keys, parameter counts) without its memory."""
    param.data = torch.empty((), dtype=param.dtype, device=param.device).expand(param.shape)


def released(param: torch.Tensor) -> bool:
    """Whether ``release`` freed this parameter (it holds one element for any shape)."""
    return param.numel() > 1 and all(s == 0 for s in param.stride())


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library returns memory its own way)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def trim_heap() -> None:
    """Return freed heap pages to the OS: glibc keeps freed mid-sized blocks (a layer's weights)
    mapped, and packed copies go into their own memory, so without this the process holds both."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
