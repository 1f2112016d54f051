"""The simulation engine: a population of virtual clients, a sampled cohort per round.

:mod:`~fl_secure.app.sim.executor` runs virtual clients (:class:`ClientJob` in,
:class:`ClientResult` out); :mod:`~fl_secure.app.sim.engine` runs the rounds with the gRPC
coordinator's round code.
"""

from fl_secure.app.sim.executor import (
    ClientExecutor,
    ClientJob,
    ClientResult,
    SerialExecutor,
    VirtualClientWorker,
)

__all__ = [
    "ClientExecutor",
    "ClientJob",
    "ClientResult",
    "SerialExecutor",
    "VirtualClientWorker",
]
