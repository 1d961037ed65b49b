"""The CPU memory allocator's setting for training: keep freed memory for reuse (glibc).

Imports nothing heavy (no torch, no numpy), so that the command line can apply it before anything allocates and
a Ctrl-C during start-up still ends as one line.
"""

from __future__ import annotations

import ctypes
import os
import platform

#: glibc's ``mallopt`` parameters (``malloc.h``).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Environment variables with which a user sets these thresholds; when any is set it wins.
_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory(*, mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Have glibc's allocator keep freed CPU memory for reuse instead of returning it to the OS at once.

    A training step on the CPU allocates and frees tensors of a few to a few tens of MB each time it runs. By
    default glibc serves blocks above a moving threshold with ``mmap`` and gives freed memory back, so each step
    pays the page faults of touching fresh pages again (measured: 1.66x slower per-record coefficient gradients
    of LeNet; docs/compact.md, "Time, and what bounds it"). Blocks below ``mmap_threshold`` (at most glibc's
    32 MiB) now come from the heap, and up to ``trim_threshold`` bytes of free heap are kept. The command line,
    the worker processes and the Flower apps call this once at start; returns whether the setting was applied
    (False off glibc, or when the user set ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_`` or
    ``GLIBC_TUNABLES``, which then stay in charge)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or any(k in os.environ for k in _MALLOC_ENV):
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )
