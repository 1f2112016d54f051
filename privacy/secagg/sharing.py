"""What one process running a whole cohort's round may compute once for every member.

Every member of a round checks every advertised key and derives the same graph, pure
functions of public data: a simulation that runs the cohort in one process
(:mod:`privacy.secagg.in_process`) computes each once inside :func:`cohort_in_one_process`.
Outside it (a real client, the server, the benchmarks against Flower) nothing is remembered,
so each party's compute is its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_SHARED: ContextVar[bool] = ContextVar("privacy_secagg_shared", default=False)


def shared() -> bool:
    """Whether the running code is a whole cohort in one process (:func:`cohort_in_one_process`)."""
    return _SHARED.get()


@contextlib.contextmanager
def cohort_in_one_process() -> Iterator[None]:
    """Within it, the members' identical checks and derivations are computed once."""
    token = _SHARED.set(True)
    try:
        yield
    finally:
        _SHARED.reset(token)
