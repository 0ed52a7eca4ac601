"""glibc malloc settings for the analysis's short-lived large temporaries.

The stochastic path allocates N times larger temporaries than the model (samples, digit maps,
perturbed GEMM operands) and frees them within the call. glibc serves allocations above its
dynamic mmap threshold with fresh ``mmap``\\ s, and trims its heap when more than twice that
threshold is free at the top: both hand the memory back to the kernel, so the next call takes a
page fault for every 4 KiB page again. On the benchmarks' LayerNorm+softmax at the arithmetic
level that was ~1700 faults and a quarter of the analysis time per call; on the MLP at operator
level ~900 faults (``benchmarks/bench_overhead.py``, docs/kernels.md).

:func:`tune` raises both thresholds once, on the first analysed call: freed temporaries stay in
the heap and are reused by the next call (the peak is the same; the heap keeps up to
``TRIM_THRESHOLD`` bytes of free memory instead of returning it).

:func:`trim` hands the heap's free pages back (``malloc_trim``) where the heap fragments: a
call interpreted node by node (the untraced rules, the trace of a sampled graph) leaves small
long-lived blocks (the trace's graph, its fake values) between freed activations, so the next
activation does not fit there and the heap grows; a 1.1B model's trace held ~70 MB more per
layer than it used (``benchmarks/bench_scale.py``'s peak memory). The pages come back as they
are reused (a page fault each, once). It does nothing when
``FXSTAB_MALLOC_TUNING=0``, when the user set any of glibc's ``MALLOC_*_`` variables, or when
the process does not use glibc's malloc settings (other platforms, musl).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

__all__ = ["tune", "trim", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 256 << 20
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_MMAP_MAX_")


@functools.lru_cache(maxsize=None)
def _glibc():
    """The C library when it is glibc (its malloc settings apply), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # (not musl...)


@functools.lru_cache(maxsize=None)
def tune() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); True if they were set."""
    if os.environ.get("FXSTAB_MALLOC_TUNING", "1") == "0" or \
            any(k in os.environ for k in _USER_SETTINGS):
        return False
    libc = _glibc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def trim() -> bool:
    """Return the heap's free pages to the kernel (glibc's ``malloc_trim(0)``); True if any
    were. Does nothing where glibc is not the allocator or ``FXSTAB_MALLOC_TUNING=0``."""
    fn = getattr(_glibc(), "malloc_trim", None)
    if fn is None or os.environ.get("FXSTAB_MALLOC_TUNING", "1") == "0":
        return False
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return bool(fn(0))
