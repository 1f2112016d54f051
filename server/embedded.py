"""Embedded mode: the server in this process, N client processes on localhost, mutual TLS.

``fl-secure train`` runs this. Certificates are made in the run directory (``RUN/certs``, one
folder per party); every client is a separate ``fl-secure client`` process that talks to the
server over gRPC exactly as on separate machines, and reads only its own site folder
(``RUN/certs/sites/<id>``), as the server reads only ``RUN/certs/server``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fl_secure.config import Config, load_config
from fl_secure.data.plan import plan_client_id
from fl_secure.errors import CheckpointError
from fl_secure.runs import RunDir, new_run_dir, removed_if_setup_fails
from fl_secure.tls import CertificateSet, init_certificates
from server.app import load_enrollment, start_server
from server.bootstrap import build_server
from server.preflight import preflight
from server.run_files import record_start, write_config
from server.summary import build_summary

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedResult:
    """Where the run went and how it ended."""

    run_dir: Path
    summary: dict[str, Any]


def client_command(
    port: int, client_id: str, run: RunDir, index: int, *, insecure: bool
) -> list[str]:
    """The command line of one embedded client process."""
    cmd = [
        sys.executable,
        "-m",
        "fl_secure.app.cli",
        "client",
        "--server",
        f"localhost:{port}",
        "--id",
        client_id,
        "--config",
        str(run.config),
        "--plan-index",
        str(index),
        "--state-dir",
        str(run.path / "clients" / client_id),
        "--quiet",
        # the operator's own processes, under the operator's config: its choice of seeded
        # (reproducible) DP noise is theirs to make
        "--accept-seeded-noise",
    ]
    site = CertificateSet(run.certs).site_dir(client_id)  # its own keys, no other site's
    cmd += ["--insecure"] if insecure else ["--certs", str(site)]
    return cmd


def spawn_clients(
    port: int, run: RunDir, num_clients: int, *, insecure: bool = False
) -> list[subprocess.Popen[bytes]]:
    """Start one client process per client id; logs go to ``run/logs/<id>.log``."""
    (run.path / "logs").mkdir(parents=True, exist_ok=True)
    procs = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for i in range(num_clients):
        client_id = plan_client_id(i)
        log_file = (run.path / "logs" / f"{client_id}.log").open("ab")
        procs.append(
            subprocess.Popen(  # noqa: S603 - our own interpreter and module
                client_command(port, client_id, run, i, insecure=insecure),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
        log_file.close()
    return procs


def run_embedded(
    config: Config,
    *,
    out: Path | None = None,
    resume: Path | None = None,
    insecure: bool = False,
    progress: bool = True,
) -> EmbeddedResult:
    """Train a run end to end in embedded mode (or resume one after a crash)."""
    created = None
    if resume is not None:
        run = RunDir(resume)
        if not run.config.exists():
            raise CheckpointError(f"{resume} is not a run directory (no config.toml)")
        config = load_config(run.config)
    else:
        preflight(config, config.partition.num_clients)  # before anything is written
        run = RunDir(created := new_run_dir(out or Path("runs"), config.run.name))
    with run.held():
        return _run_held(config, run, created, insecure=insecure, progress=progress)


def _run_held(
    config: Config, run: RunDir, created: Path | None, *, insecure: bool, progress: bool
) -> EmbeddedResult:
    """:func:`run_embedded` once this process holds the run directory."""
    started = time.time()
    with removed_if_setup_fails(created):  # e.g. a data plan that does not fit the clients
        if created is not None:
            write_config(run, config)
            init_certificates(run.certs, clients=config.partition.num_clients)
            if config.secure_aggregation.scheme == "ckks":  # the clients' shared key, made here
                # deferred: privacy.ckks imports tenseal, which only CKKS runs need
                from privacy.ckks.keys import distribute_ckks_keys

                distribute_ckks_keys(run.certs)
        served = CertificateSet(run.certs).server_dir  # no client secret in it
        enrolled = set(load_enrollment(served).fingerprints)
        side = build_server(config, run, enrolled=enrolled, cert_dir=None if insecure else served)
        coordinator = side.coordinator
        done = coordinator.resume()
        record_start(run)
        server, port = start_server(
            coordinator, config.server.address, cert_dir=served, insecure=insecure
        )
    procs = spawn_clients(port, run, config.partition.num_clients, insecure=insecure)
    bar = tqdm(
        total=config.train.rounds,
        initial=done,
        desc="rounds",
        unit="round",
        disable=None if progress else True,  # None: off when not a terminal
        file=sys.stderr,
    )

    def on_round(record: dict[str, Any]) -> None:
        held = record.get("held_out") or {}
        tar = held.get("tar_at_far_1e-2")  # None: the round scored NaN
        postfix = {"clients": f"{record['num_updates']}/{record['cohort_size']}"}
        if "tar_at_far_1e-2" in held:
            postfix["tar_1e2"] = f"{tar:.3f}" if isinstance(tar, float) else "n/a"
        bar.set_postfix(postfix)
        bar.update(1)
        if bar.disable and progress:  # not a terminal: one plain line per round
            line = f"round {record['round']}/{config.train.rounds}: "
            line += f"{record['num_updates']}/{record['cohort_size']} clients"
            if "tar_at_far_1e-2" in held:
                line += f", held-out TAR@FAR=1e-2 {postfix['tar_1e2']}"
            print(line, file=sys.stderr, flush=True)

    try:
        coordinator.run(on_round=on_round)
        coordinator.wait_clients_finished(timeout=10.0)
    finally:
        bar.close()
        server.stop(grace=2.0)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
    summary = build_summary(config, coordinator, side.strategy, side.plan, started=started)
    summary["transport"] = "plaintext gRPC (--insecure)" if insecure else "gRPC + mutual TLS"
    run.write_summary(summary)
    return EmbeddedResult(run_dir=run.path, summary=summary)
