"""Keep a round's freed buffers in the process instead of handing them back to the kernel.

A client handles several multi-megabyte buffers every round (the downloaded parameters, the
update, a masked vector, their protobuf chunks) in several threads (the download prefetch,
gRPC's request serializer); the server handles ten times as many (every cohort member's
download and upload chunks in gRPC's threads, the running sum, the unmasked and decoded
sums). With glibc's defaults each buffer is freed back to the kernel at the end of the round
and the next round takes every page fault again, the kernel zeroing each page: about 4,700
faults (18 MB) per client and secure round at 10^6 parameters, a quarter of the client's CPU
in that round (``benchmarks/secagg_round.py``); on the server, the unmasking and decoding
after the last upload of a secure round took 55 ms instead of 12. Raising glibc's mmap and
trim thresholds and putting every thread on one arena (``mallopt``) keeps freed memory for
the next round: a process's resident memory then stays at its peak rather than falling back
between rounds.

Only glibc has ``mallopt``; elsewhere (musl, macOS, Windows) :func:`retain_freed_memory`
changes nothing and says so.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
#: Allocations up to this size come from the heap (glibc's largest allowed value on 64-bit).
MMAP_THRESHOLD = 32 << 20
#: Free memory kept at the top of a heap before glibc trims it.
TRIM_THRESHOLD = 256 << 20
#: One heap for all threads (glibc's default is 8 arenas per core). gRPC's threads come and
#: go, and a thread given a fresh arena faults in its buffers again; and a second arena is
#: made of 64 MB sub-heaps that glibc unmaps whenever one empties, whatever the trim
#: threshold: with two arenas the server still took ~3,300 faults per secure round (13 MB),
#: with one ~700 (tests/fl_secure/test_memory.py has the same pattern in small).
ARENA_MAX = 1

_lock = threading.Lock()
_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Set glibc's thresholds and arena cap for this process (once); ``True`` if all are set.

    Idempotent and thread-safe. Returns ``False``, changing nothing, where the C library has
    no ``mallopt`` or refuses the values.
    """
    global _applied
    with _lock:
        if _applied is None:
            _applied = _mallopt()
        return _applied


def _mallopt() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # a C library without mallopt (musl)
        log.debug("no mallopt in this C library; freed memory goes back to the kernel")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(
        mallopt(option, value)
        for option, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_ARENA_MAX, ARENA_MAX),
        )
    )
    if not ok:  # pragma: no cover - glibc accepts all three values
        log.debug("mallopt refused a setting; freed memory may go back to the kernel")
    return ok


__all__ = ["retain_freed_memory"]
