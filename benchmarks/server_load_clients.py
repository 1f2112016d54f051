"""Virtual clients of the server-load benchmark (``benchmarks/server_load.py``).

One process holds many clients, one thread each. Every client is the project's own
:class:`client.app.FlClient` (join, long polls, the parameter download, the upload, the
secure-aggregation stages through :class:`client.secure_round.SecureExchange` and
:class:`privacy.secagg.client.SecAggClient`) with its own mTLS channel and its own client
certificate; only local training is replaced by :class:`KnownTrainer`, which returns a known
update (:func:`known_update`) in a few microseconds instead of running torch. So one process
serves a few dozen sites where a real client process needs ~300 MB each.

Usage (started by the benchmark)::

    python benchmarks/server_load_clients.py --port P --certs DIR --ids client-0,client-1
        [--victim-round R] [--record DIR]

The process prints one JSON line per event on stdout (``ready``, ``joined``, ``train``,
``done``, ``error``, ``finished``, ``exit``) and starts its clients when it reads a line on
stdin (so that every process has imported everything before the joins are timed). With
``--victim-round R`` each of its clients stops in round R's local training, after the key
stages of a secure round (its pairwise masks must then be recovered by the others), and
waits there for the benchmark to SIGKILL the whole process: its connections drop mid-round.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from client.app import FlClient  # noqa: E402
from client.transport import Connection  # noqa: E402
from fl_secure.messages import LocalTraining, Task, Tensors  # noqa: E402

#: Every update value is an integer multiple of this (on the fixed-point grid of SecAgg for
#: any ``scale_bits >= 8``, so it is encoded, summed and decoded exactly).
GRID = 1.0 / 256
#: Example count every virtual client states (equal weights in a plain FedAvg round).
EXAMPLES = 10

_print_lock = threading.Lock()


def report(event: str, **fields: Any) -> None:
    """One event as a JSON line on stdout (the benchmark reads them)."""
    line = json.dumps({"event": event, "t": time.time(), **fields})
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def client_index(client_id: str) -> int:
    """``client-17`` -> 17."""
    return int(client_id.rsplit("-", 1)[1])


def known_update(client_id: str, round_: int, shared: Tensors) -> Tensors:
    """The update ``client_id`` sends in ``round_``: small integers times :data:`GRID`.

    Values in ``[-8, 8] / 256`` (inside any ``clip_range >= 1/32``), a pattern that differs
    per client, round and coordinate, so a sum that lost or doubled a client shows.
    """
    i = client_index(client_id)
    out: Tensors = OrderedDict()
    offset = 0
    for name, value in shared.items():
        n = int(value.size)
        j = np.arange(offset, offset + n, dtype=np.int64)
        ints = (7 * i + 13 * round_ + 3 * j + (i * j) % 5) % 17 - 8
        out[name] = (ints.astype(np.float64) * GRID).astype(value.dtype).reshape(value.shape)
        offset += n
    return out


class KnownTrainer:
    """Local training replaced by :func:`known_update`; records what it was sent."""

    def __init__(self, client_id: str, victim_round: int, record: Path | None) -> None:
        self.client_id = client_id
        self.victim_round = victim_round
        self.record = record
        self.num_examples = EXAMPLES
        self.round = 0  # set by LoadClient before each task

    def train(self, shared: Tensors, training: LocalTraining) -> tuple[Tensors, int, dict]:
        """The known update of this client and round (and, as a victim, wait to be killed)."""
        del training
        if self.record is not None:  # the global model this round started from
            save_once(self.record / f"params-{self.round:04d}.npz", shared)
        report("train", client=self.client_id, round=self.round)
        if self.round == self.victim_round:
            threading.Event().wait()  # killed here, with the process, by the benchmark
        return known_update(self.client_id, self.round, shared), EXAMPLES, {"local_steps": 1.0}

    def evaluate(self, shared: Tensors) -> tuple[int, dict[str, float]]:
        """No local evaluation figures."""
        del shared
        return EXAMPLES, {}


def save_once(path: Path, tensors: Tensors) -> None:
    """Write ``tensors`` to ``path`` unless a client of this process has (atomic rename)."""
    if path.exists():
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp.npz")
    np.savez(tmp, **dict(tensors))
    os.replace(tmp, path)


class LoadClient(FlClient):
    """:class:`FlClient` that tells its trainer the task's round and reports each task."""

    def _do_task(self, stub: Any, task: Task) -> None:
        assert isinstance(self.trainer, KnownTrainer)
        self.trainer.round = task.round
        before = self.rounds_done
        super()._do_task(stub, task)
        if self.rounds_done > before:
            report("done", client=self.conn.client_id, round=task.round, kind=task.kind.value)


class _Errors(logging.Handler):
    """Client-side warnings and errors (refused updates, ended rounds, reconnects)."""

    def emit(self, record: logging.LogRecord) -> None:
        report("error", client=record.threadName, message=record.getMessage()[:300])


def run_client(args: argparse.Namespace, client_id: str) -> None:
    """One virtual site, until the server says the run is finished."""
    trainer = KnownTrainer(client_id, args.victim_round, args.record)

    def factory(reply: Any) -> KnownTrainer:
        report("joined", client=client_id)
        return trainer

    conn = Connection(f"localhost:{args.port}", client_id, cert_dir=args.certs)
    try:
        message = LoadClient(conn, factory, max_wait=args.max_wait).run()  # type: ignore[arg-type]
        report("finished", client=client_id, message=message[:200])
    except Exception as exc:  # reported, counted by the benchmark
        report("error", client=client_id, message=f"{type(exc).__name__}: {exc}"[:300], fatal=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--certs", type=Path, required=True)
    parser.add_argument("--ids", required=True, help="comma-separated client ids")
    parser.add_argument("--victim-round", type=int, default=-1)
    parser.add_argument("--record", type=Path)
    parser.add_argument("--max-wait", type=float, default=120.0)
    args = parser.parse_args()
    handler = _Errors(level=logging.WARNING)
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.WARNING)
    ids = args.ids.split(",")
    report("ready", clients=len(ids), pid=os.getpid())
    sys.stdin.readline()  # the benchmark's "go": every process has imported everything
    threads = [
        threading.Thread(target=run_client, args=(args, c), name=c, daemon=True) for c in ids
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report("exit")


if __name__ == "__main__":
    main()
