"""retain_freed_memory: a round's freed buffers are reused, not faulted in again."""

from __future__ import annotations

import platform
import resource
import sys
import threading
from collections.abc import Callable

import numpy as np
import pytest

from fl_secure.memory import retain_freed_memory

PAGES = 4_000_000 // 4096  # one 4 MB buffer


def _churn() -> None:
    """What a round does with its buffers: make a few MB, copy them, free them."""
    for _ in range(5):
        a = np.ones(1_000_000, dtype=np.float32)
        b = bytearray(a.tobytes())
        del a, b


def _faults(work: Callable[[], None]) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    work()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _in_thread() -> None:
    t = threading.Thread(target=_churn)
    t.start()
    t.join()


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's",
)
def test_freed_buffers_are_reused_without_page_faults() -> None:
    # Prepare: the thresholds set (idempotent), then one round to warm the heaps up
    assert retain_freed_memory() is True
    assert retain_freed_memory() is True
    _churn()
    _in_thread()
    # Execute: the same work again, in this thread and in a new one
    main, other = _faults(_churn), _faults(_in_thread)
    # Assert: 5 rounds touch 3 buffers of ~1000 pages each; nearly none fault again
    # (with glibc's defaults every page faults again: about 14 500 faults per call)
    assert main < 0.05 * 15 * PAGES
    assert other < 0.05 * 15 * PAGES
