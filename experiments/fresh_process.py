"""Run a function in a newly spawned interpreter: the seed ran a fresh server per strategy, and a
timed run should not inherit another run's allocator, caches or threads.

A worker outlives a parent that is killed (SIGTERM or SIGKILL reach that process alone; an
interrupt from a terminal reaches the whole group) and would run its job to the end, minutes of a
real run on the CPU that whatever is measured next needs. So the worker checks every second and
exits once its parent is gone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
PARENT_POLL_S = 1.0


def _exit_with(parent_pid: int) -> None:
    """(In the worker.) Exit as soon as ``parent_pid`` is no longer this process's parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def in_fresh_process(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a newly spawned interpreter; its result (or its exception) comes back here."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=_exit_with,
                             initargs=(os.getpid(),)) as pool:
        return pool.submit(fn, *args).result()
