"""The engine's own CPU kernel (gemv.cpp), compiled once per machine at first use.

``gemv(dtype)`` returns ``torch.ops.miniserve.gemv`` (x, panels, bias, N) when this CPU can run
it for ``dtype``, else None, and the engine keeps oneDNN for those calls; ``pack_panels`` lays a
weight out for it. The build (a few seconds with g++ and ninja) is
cached by torch.utils.cpp_extension under ``$TORCH_EXTENSIONS_DIR`` (default
~/.cache/torch_extensions) and redone only when the source changes; concurrent processes wait on
its lock. A machine without a compiler gets a warning and the slower path, not an error.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 8  # rows per call the kernel takes (kMaxRows in gemv.cpp)
PANEL = 32  # output columns per panel (kPanel in gemv.cpp)
SOURCE = Path(__file__).with_name("gemv.cpp")
log = logging.getLogger("miniserve.kernels")


@functools.cache
def _load() -> bool:
    try:
        import ninja  # the build tool torch's extension loader runs; on PATH even without an activated venv
        from torch.utils.cpp_extension import load

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        # -fopenmp: at::parallel_for then runs on torch's own OpenMP pool (the libgomp torch has
        # loaded); without it the kernel would run on one core
        load("miniserve_kernels", [str(SOURCE)], extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
             is_python_module=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the engine still runs, on oneDNN
        log.warning("miniserve's gemv kernel could not be built (%s); decode linears stay on oneDNN",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False
    return True


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """w (N, K) in the kernel's layout: panels of PANEL output columns, k-major inside a panel,
    so a panel's weights for one k (fp32) or one pair of k (bf16, for its pairwise dot product)
    are one contiguous 128 bytes. Zero-padded past N (and past an odd K in bf16)."""
    n, k = w.shape
    panels = -(-n // PANEL)
    w = w.detach()
    if w.dtype == torch.bfloat16:
        pad_k = k % 2
        w = F.pad(w, (0, pad_k, 0, panels * PANEL - n))
        return w.view(panels, PANEL, (k + pad_k) // 2, 2).permute(0, 2, 1, 3).contiguous()
    w = F.pad(w, (0, 0, 0, panels * PANEL - n))
    return w.view(panels, PANEL, k).permute(0, 2, 1).contiguous()


def gemv(dtype: torch.dtype):
    """The decode-sized matrix product for ``dtype`` on this CPU, or None."""
    if not _load() or not torch.ops.miniserve.gemv_supported(dtype):
        return None
    return torch.ops.miniserve.gemv.default
