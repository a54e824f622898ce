"""Keep the agent's resident memory near its working set.

glibc raises its mmap threshold every time a large block is freed (up to 32 MiB), after which the
256 KiB copy buffers of a busy connection come from the heap instead of their own mappings; freed,
they stay resident as fragmented heap. Measured with the egress benchmark (docs/benchmarks.md):
after the throughput rounds the agent held about 145 MiB with the dynamic threshold and about
63 MiB with a fixed 128 KiB one, at no measurable throughput cost. ``MALLOC_MMAP_THRESHOLD_`` in
the environment does the same; an explicit value there wins.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number (malloc.h)."""
MMAP_THRESHOLD = 128 * 1024
"""glibc's default threshold, made fixed: blocks this large or larger get their own mapping."""


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes; False where that is not possible
    (another libc) or the environment already sets one."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
