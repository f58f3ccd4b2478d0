"""Large CPU tensors served from memory the process already holds (glibc's malloc, Linux).

Why: glibc maps every allocation above its mmap threshold (at most 32 MiB, 128 KiB at first) with a fresh
``mmap`` and returns it to the system at ``free``, so each new large tensor pays a page fault per 4 KiB page
on first touch (the kernel zeroes the page), every time. An RL step on a CPU makes thousands of such
tensors: the LM head's [128 x 49k] fp32 blocks (25 MB), the KV cache of a prefill ([30, 20, 3, 402, 64] in
bf16, 93 MB) and its row selections. Measured on one core (Xeon, torch 2.13): a zeroed 93 MB cache 36.5 ms
fresh against 26.3 ms reused, its row selection 47.1 ms against 14.2 ms, a 128 x 49k log-softmax 13.3 ms
against 7.1 ms. Raising the mmap threshold and the trim threshold (``mallopt``) makes glibc serve those
tensors from its heap and keep freed blocks for the next one. Nothing computed changes; the cost is that
memory freed by the process stays reserved by it (its resident size stays near its peak).

``STRATARL_SYSTEM_MALLOC=1`` in the environment leaves glibc's defaults as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations up to this size come from the heap (above it, mmap as before: a multi-GiB buffer stays out of
# the heap); freed memory at the top of the heap is returned to the system only above the trim threshold.
HEAP_MAX_BYTES = 1 << 30
TRIM_BYTES = 1 << 31
OPT_OUT_ENV = "STRATARL_SYSTEM_MALLOC"


@functools.cache
def reuse_large_allocations() -> bool:
    """Set glibc's mmap and trim thresholds, once per process (see the module docstring): True when they are
    set, False where this is not Linux with glibc or the user opted out."""
    if os.environ.get(OPT_OUT_ENV, "") not in ("", "0") or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries: no mallopt, nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_MAX_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
