"""The C allocator's settings for a process that recomputes: keep freed memory for reuse.

A recompute allocates and frees the same large numpy temporaries for every shard (a float64
column of a 65 K-row shard is 512 KiB). glibc's malloc serves blocks that large with ``mmap`` and
returns them to the system on ``free`` (and trims the top of its heap beyond a threshold), so the
next shard's arrays fault their pages in again: on a 10 M-row run that was ~810 K page faults and
~3.5 s of system time, a fifth of the recompute's CPU. Raising the mmap threshold to glibc's
largest (32 MiB) and the trim threshold above it keeps those blocks in the heap, where the next
shard reuses them (~45 K faults). The price is that up to the trim threshold of freed memory stays
with the process until it exits, which a command-line process can afford; the Python API does not
call this, so a notebook's allocator is left as its owner set it.
"""

from __future__ import annotations

import ctypes
import sys

#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: blocks below this come from the heap (32 MiB: the largest glibc accepts on 64-bit)
MMAP_THRESHOLD = 32 * 1024 * 1024
#: free memory at the heap's top beyond this goes back to the system
TRIM_THRESHOLD = 128 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Set glibc's thresholds (above) for this process; False where the C library is not glibc
    (macOS, musl), which keeps its own behaviour."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded into this process, the C library's among them
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):  # musl has no gnu_get_libc_version
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
