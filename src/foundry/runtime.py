"""Process-wide settings of a long-running numeric process (the C library's allocator)."""

from __future__ import annotations

import ctypes
import platform

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit systems
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int: keep up to 2 GiB of free heap top


def retain_freed_memory() -> bool:
    """Keep memory freed by one training step mapped for the next (glibc only, process-wide).

    A step allocates and frees the same activations every time. glibc returns large freed
    blocks to the OS (munmap, heap trimming), so the next step takes a page fault for every
    4 KiB to get them back: on the "small" preset that is a third of the step time. Raising
    malloc's mmap and trim thresholds keeps those pages in the process (the resident size stays
    at its peak). Call once at the start of a long-running training process; returns whether
    the setting took (False on other C libraries).
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    return bool(ok and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1)


def give_back_freed_memory() -> bool:
    """Return the heap's free pages to the OS now (glibc's ``malloc_trim``), whatever
    :func:`retain_freed_memory` set: a service calls it when a peer that made it hold large
    buffers is gone, so that memory is not kept for the life of the process (the pages a
    training step reuses come back at the next step's first touch). Returns whether anything
    was given back (False on other C libraries)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    return bool(ctypes.CDLL(None).malloc_trim(0))
