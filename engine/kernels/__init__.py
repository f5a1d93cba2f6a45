"""The engine's own CPU kernel (gemv.cpp), compiled once per machine at first use.

``gemv(dtype)`` returns ``torch.ops.miniserve.gemv`` when this CPU can run it for ``dtype``, else
None, and the engine keeps oneDNN for those calls. The build (a few seconds with g++ and ninja) is
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

MAX_ROWS = 2  # the kernel's limit (kMaxRows in gemv.cpp): where it beats oneDNN (benchmarks/gemv_kernel.py)
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


def gemv(dtype: torch.dtype):
    """The decode-sized matrix product for ``dtype`` on this CPU, or None."""
    if not _load() or not torch.ops.miniserve.gemv_supported(dtype):
        return None
    return torch.ops.miniserve.gemv.default
