"""retain_freed_memory: a round's freed buffers are reused, not faulted in again."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = 4_000_000 // 4096  # one 4 MB buffer

# Run in a fresh interpreter, as a client process calls it at start: in the test process,
# threads and arenas made by earlier tests would decide which heap a new thread gets.
PROBE = """
import resource, sys, threading
import numpy as np
from fl_secure.memory import retain_freed_memory

def churn():  # what a round does with its buffers: make a few MB, copy them, free them
    for _ in range(5):
        a = np.ones(1_000_000, dtype=np.float32)
        b = bytearray(a.tobytes())
        del a, b

def in_thread():
    t = threading.Thread(target=churn)
    t.start()
    t.join()

def concurrent():  # threads holding their buffers at once, as gRPC's threads do
    barrier = threading.Barrier(4)
    def hold():
        buffers = [bytearray(np.ones(1_000_000, dtype=np.float32).tobytes()) for _ in range(6)]
        barrier.wait()
        del buffers
    threads = [threading.Thread(target=hold) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

def faults(work):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    work()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

tuned = sys.argv[1] == "tuned"
if tuned:
    assert retain_freed_memory() is True and retain_freed_memory() is True
churn()
in_thread()  # one round to warm the heaps up
main, thread = faults(churn), faults(in_thread)
concurrent()
concurrent()
print(main, thread, faults(lambda: [concurrent() for _ in range(3)]))
"""


def _faults(mode: str) -> tuple[int, int, int]:
    out = subprocess.run(  # noqa: S603 - this interpreter running the probe above
        [sys.executable, "-c", PROBE, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    return int(out[0]), int(out[1]), int(out[2])


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's",
)
def test_freed_buffers_are_reused_without_page_faults() -> None:
    # Prepare / Execute: the same rounds with glibc's defaults and with the thresholds
    default_main, default_thread, default_concurrent = _faults("default")
    tuned_main, tuned_thread, tuned_concurrent = _faults("tuned")
    # Assert: 5 rounds touch 3 buffers of ~1000 pages each. With the defaults every page
    # faults again (about 14 500 per call); with the thresholds nearly none does.
    assert min(default_main, default_thread) > 10 * PAGES
    assert tuned_main < 0.05 * 15 * PAGES
    assert tuned_thread < 0.05 * 15 * PAGES
    # Four threads holding 6 buffers each at once (3 rounds, ~3 000 pages per thread and
    # round): with the defaults 20 000-70 000 faults; with one arena for all threads no heap
    # is handed back when its threads' buffers are freed (two arenas gave 3 900-4 900).
    assert default_concurrent > 10 * PAGES
    assert tuned_concurrent < 0.05 * default_concurrent
