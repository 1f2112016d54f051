"""Checks and samples of the server-load benchmark (``benchmarks/server_load.py``).

:func:`check_models` recomputes each round's released model from the known updates of the
round's survivors (:func:`benchmarks.server_load_clients.known_update`) and the model the
round started from; :func:`proc_sample` reads the server process's memory, threads, file
descriptors and established TCP connections from ``/proc``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from server_load_clients import known_update  # a sibling: benchmarks/ is on sys.path

#: Plain rounds: the streaming mean adds updates in arrival order, so float32 rounding may
#: differ from a recomputation by a few ulps of the values (|w| < 1 here).
PLAIN_TOLERANCE = 1e-6


def _tensors(path: Path) -> OrderedDict[str, np.ndarray]:
    if path.suffix == ".npz":
        with np.load(path) as data:
            return OrderedDict((k, data[k]) for k in data.files)
    from safetensors.numpy import load_file

    return OrderedDict(load_file(str(path)))


def released(run: Path, record: Path, number: int) -> Path | None:
    """The model released by round ``number``: the next round's download, or its checkpoint."""
    nxt = record / f"params-{number + 1:04d}.npz"
    if nxt.exists():
        return nxt
    path = run / "checkpoints" / f"round-{number:06d}.safetensors"
    return path if path.exists() else None


def check_models(
    run: Path,
    record: Path,
    completed: list[dict[str, Any]],
    secure: bool,
    everyone: list[str],
    killed: list[str],
) -> dict[str, Any]:
    """Each completed round's survivors and released model against the known updates.

    Secure rounds: the survivors must be exactly the clients not killed, and the released
    model ``w + (sum of their updates / |survivors|)`` bit-exactly. Plain rounds: every live
    client's update is in, and the model agrees to :data:`PLAIN_TOLERANCE`.
    """
    alive = sorted(set(everyone) - set(killed))
    survivors_ok, exact, problems = True, True, []
    worst = 0.0
    for rec in completed:
        number = rec["round"]
        if secure:
            survivors = sorted(rec.get("secure_aggregation", {}).get("survivors", []))
        else:
            survivors = sorted(rec.get("clients", {}))
        if survivors != alive:
            survivors_ok = False
            problems.append(f"round {number}: {len(survivors)} survivors, {len(alive)} alive")
        start = record / f"params-{number:04d}.npz"
        after = released(run, record, number)
        if not start.exists() or after is None or not survivors:
            exact = False
            problems.append(f"round {number}: no model to compare")
            continue
        before, got = _tensors(start), _tensors(after)
        total = {k: np.zeros(v.shape, np.float64) for k, v in before.items()}
        for client in survivors:
            for k, v in known_update(client, number, before).items():
                total[k] += v  # integers times 2^-8: exact in float64
        for k, w in before.items():
            mean = (total[k] / len(survivors)).astype(w.dtype)  # as server.secure_relay
            want = (w + mean).astype(w.dtype)  # FedAvg's server step
            diff = float(np.max(np.abs(got[k].astype(np.float64) - want), initial=0.0))
            worst = max(worst, diff)
            same = np.array_equal(got[k], want)
            if (secure and not same) or diff > PLAIN_TOLERANCE:
                exact = False
                problems.append(f"round {number}: {k} differs by up to {diff:.3g}")
    key = "released_models_bit_exact" if secure else "released_models_match"
    return {
        "checks": {"survivors_are_the_live_clients": survivors_ok, key: exact},
        "figures": {"max_abs_difference": worst, "problems": problems[:5]},
    }


def proc_sample(pid: int, port: int) -> dict[str, float] | None:
    """The server's RSS, peak RSS (MB), threads, open fds and TCP connections.

    ``connections``: established ones the server has accepted; ``queued``: established ones
    still in its listen queue (a join burst faster than the server accepts and handshakes).
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)

    def kb(name: str) -> float:
        return float(fields.get(name, "0 kB").split()[0]) / 1024.0

    owned: set[str] = set()  # the inodes of the server's sockets
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                owned.add(target[8:-1])
    except OSError:
        pass
    connections = queued = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or cols[3] != "01" or int(cols[1].rsplit(":", 1)[1], 16) != port:
                continue
            if cols[9] in owned:  # accepted by the server
                connections += 1
            elif cols[9] == "0":  # in the listen queue, not accepted yet
                queued += 1
    return {
        "rss_mb": kb("VmRSS"),
        "hwm_mb": kb("VmHWM"),
        "threads": float(fields.get("Threads", "0").strip() or 0),
        "fds": float(fds),
        "connections": float(connections),
        "queued": float(queued),
    }
