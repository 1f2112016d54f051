"""Secure rounds with real client processes (``secagg_worker.py``), some killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


def run_client_processes(
    coord: Any,
    server: Any,
    port: int,
    certs: Path,
    tmp_path: Path,
    shifts: list[float],
    dying: dict[int, tuple[list[str], str]],
) -> tuple[list[int], str]:
    """Run ``coord`` with one worker process per shift; kill -9 each dying one at its point.

    ``dying`` maps a client's index to the worker's extra flags and the marker file suffix
    (``client-<i>.<suffix>`` in ``tmp_path``) the worker writes once it reached the point of
    the protocol where it must die; it is then killed with SIGKILL. The server is stopped at
    the end. Returns the exit codes of the other clients and the tail of every client's log.
    """
    worker = Path(__file__).with_name("secagg_worker.py")
    env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, shift in enumerate(shifts):
            cmd = [sys.executable, str(worker), "--port", str(port), "--id", f"client-{i}"]
            cmd += ["--certs", str(certs), "--shift", repr(shift)]
            cmd += dying[i][0] if i in dying else []
            log = (tmp_path / f"client-{i}.log").open("wb")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        driver = threading.Thread(target=coord.run, daemon=True)
        driver.start()
        deadline = time.monotonic() + 180
        pending = set(dying)
        while pending and time.monotonic() < deadline:
            for i in sorted(pending):
                if (tmp_path / f"client-{i}.{dying[i][1]}").exists():
                    procs[i].send_signal(signal.SIGKILL)
                    assert procs[i].wait(timeout=10) == -signal.SIGKILL
                    pending.discard(i)
            time.sleep(0.05)
        assert not pending, f"clients {sorted(pending)} never reached their point of the protocol"
        driver.join(timeout=180)
        codes = [p.wait(timeout=60) for i, p in enumerate(procs) if i not in dying]
    finally:
        server.stop(grace=None)
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join(p.read_text()[-1500:] for p in tmp_path.glob("client-*.log"))
    return codes, logs
