"""A securely aggregated round vs a plaintext round over gRPC + mTLS, in one run; prints JSON.

Ten clients (each with its own gRPC channel and client certificate) send a constant update of
``d`` float32 parameters to a real server on loopback; the clock runs from the round's start
to the aggregate being applied. ``--clients-as processes`` (the default) runs every client in
its own OS process, as in a deployment (the 2 cores of this machine are shared by the server
and the ten clients, where a deployment gives each client its own machine); each process
stays for ``--rounds`` rounds and every round's ``duration_s`` after the first (which also
opens the channels and TLS sessions; ``--warmup``) is a sample.
``--clients-as threads`` runs them as threads of the server's interpreter (one GIL for all),
one round per server. The plaintext round streams float32
updates into the running mean; the secure round runs SecAgg (or SecAgg+ with ``--neighbours``)
end to end: signed key advertisements, encrypted shares, masked uploads (32-bit words at the
default modulus), unmasking.
Sides alternate over ``--repeats`` runs; medians are reported with their ratio (goal: secure
<= 1.5x plaintext at n = 10, d = 1e6). With client processes the CPU time of each counted
round is reported too: the server process (``time.process_time``) and every client process
(its CPU-time clock, ``clock_getcpuclockid``: every thread, ended ones too), between the
ends of consecutive rounds. ``--ckks`` adds a CKKS round (TenSEAL: encrypted
uploads, server-side ciphertext sum, two clients decrypt) to the same alternation.

Usage: python benchmarks/secagg_round.py [--clients 10] [--params 1000000] [--repeats 3]
                                         [--clients-as processes|threads] [--rounds 4] [--ckks]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from client.app import FlClient  # noqa: E402
from client.transport import Connection  # noqa: E402
from fl_secure.config import (  # noqa: E402
    Config,
    PartitionConfig,
    SecureAggregationConfig,
    ServerConfig,
    TrainConfig,
    config_to_toml,
)
from fl_secure.messages import LocalTraining, Tensors  # noqa: E402
from fl_secure.runs import RunDir  # noqa: E402
from fl_secure.tls import init_certificates  # noqa: E402
from fl_secure.tls.identity import load_signing_registry  # noqa: E402
from privacy.ckks.keys import distribute_ckks_keys, load_public_context  # noqa: E402
from server.app import load_enrollment, start_server  # noqa: E402
from server.coordinator import Coordinator  # noqa: E402
from server.settings import CoordinatorSettings  # noqa: E402


class ConstantTrainer:
    """Returns ``shift`` in every coordinate at once (no training: the protocol is timed)."""

    def __init__(self, shift: float) -> None:
        self.shift, self.num_examples = shift, 10

    def train(self, shared: Tensors, training: LocalTraining) -> Any:
        update = OrderedDict((k, np.full_like(v, self.shift)) for k, v in shared.items())
        return update, self.num_examples, {}

    def evaluate(self, shared: Tensors) -> Any:
        return self.num_examples, {}


def _coordinator(
    certs: Path, out: Path, clients: int, params: int, secure: str, k: int, rounds: int
) -> Coordinator:
    initial = OrderedDict([("w", np.zeros(params, np.float32))])
    scheme = SecureAggregationConfig(scheme=secure, neighbours=k, clip_range=2.0)  # type: ignore[arg-type]
    public = load_public_context(certs) if secure == "ckks" else b""
    settings = CoordinatorSettings(
        rounds=rounds,
        min_clients=clients,
        round_timeout=600.0,
        poll_wait=0.5,
        final_evaluation=False,
        run_id=f"bench-{secure}-{time.time_ns()}",
        secure_aggregation=scheme,
        ckks_public_context=public,
        # the clients hold each round's setup to the run config they joined under
        run_config_toml=config_to_toml(
            Config(
                partition=PartitionConfig(num_clients=clients),
                server=ServerConfig(min_clients=clients),
                secure_aggregation=scheme,
                # a site refuses a round outside 1..train.rounds of the run it joined
                train=TrainConfig(rounds=rounds),
            )
        ),
    )
    return Coordinator(
        settings,
        initial,
        enrolled=set(load_enrollment(certs).fingerprints),
        run_dir=RunDir(out / settings.run_id),
        server_step=lambda p, u, r: OrderedDict((n, p[n] + u[n]) for n in p),
        signing_registry=load_signing_registry(certs / "server"),
    )


def _check(coord: Coordinator, secure: str, clients: int, rounds: int) -> None:
    if coord.status != "completed":
        raise RuntimeError(f"{secure} round failed: {coord.stop_reason}")
    expected = rounds * np.mean([0.01 * (i + 1) for i in range(clients)])
    error = float(np.abs(coord.params["w"] - expected).max())
    if error > 1e-4 * rounds:
        raise RuntimeError(f"{secure} round aggregate is off by {error}")


def _await_clients(coord: Coordinator, clients: int, what: list[subprocess.Popen[bytes]]) -> None:
    """Until every client has joined (not timed); a worker that died is an error."""
    while len(coord.online_clients()) < clients:
        dead = [p.args for p in what if p.poll() is not None]  # argv lists
        if dead:
            raise RuntimeError(f"a client process exited before joining: {dead[0]!r}")
        time.sleep(0.05)


def one_round(certs: Path, out: Path, clients: int, params: int, secure: str, k: int) -> float:
    """Seconds from the first task to the applied aggregate of one round (thread clients)."""
    coord = _coordinator(certs, out, clients, params, secure, k, rounds=1)
    server, port = start_server(coord, "127.0.0.1:0", cert_dir=certs)
    threads = []
    for i in range(clients):
        trainer = ConstantTrainer(0.01 * (i + 1))
        client = FlClient(
            Connection(f"localhost:{port}", f"client-{i}", cert_dir=certs),
            lambda reply, t=trainer: t,  # type: ignore[misc]
            max_wait=60.0,
        )
        th = threading.Thread(target=client.run, daemon=True)
        th.start()
        threads.append(th)
    _await_clients(coord, clients, [])
    last: dict[str, object] = {}
    driver = threading.Thread(target=lambda: last.update(coord.run()), daemon=True)
    driver.start()
    driver.join()
    server.stop(grace=None)
    _check(coord, secure, clients, 1)
    # the round's own clock, as in processes mode: not the round-0 record, the checkpoint
    # or the ledger around it
    return float(last["duration_s"])  # type: ignore[arg-type]


def _processes_cpu_s(pids: list[int]) -> float | None:
    """CPU seconds these processes have run, every thread counted (None where unsupported).

    Each process's CPU-time clock (``clock_getcpuclockid``, nanoseconds) covers the threads
    that already ended too: gRPC streams an upload from a per-call thread, and a secure
    round's download runs in a prefetch thread, both gone by the end of the round.
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        getcpuclockid = libc.clock_getcpuclockid
    except (OSError, AttributeError):  # no POSIX per-process CPU clocks here
        return None
    total = 0.0
    for pid in pids:
        clock = ctypes.c_int()
        if getcpuclockid(pid, ctypes.byref(clock)) != 0:  # the process ended meanwhile
            return None
        try:
            total += time.clock_gettime(clock.value)
        except OSError:
            return None
    return total


def process_rounds(
    certs: Path, out: Path, clients: int, params: int, secure: str, k: int, rounds: int
) -> tuple[list[float], list[tuple[float, float]]]:
    """Each round's ``duration_s`` (task out to aggregate applied), clients in processes.

    Also each round's CPU seconds as ``(server, clients)``, from the end of the previous round
    (the first from the start of the run) to the end of this one; empty without /proc.
    """
    coord = _coordinator(certs, out, clients, params, secure, k, rounds=rounds)
    server, port = start_server(coord, "127.0.0.1:0", cert_dir=certs)
    workers = [
        subprocess.Popen(  # noqa: S603 - this interpreter running this file
            [
                sys.executable,
                __file__,
                "--worker",
                f"localhost:{port}",
                str(certs / "sites" / f"client-{i}"),  # its own site folder only
                f"client-{i}",
                str(0.01 * (i + 1)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for i in range(clients)
    ]
    durations: list[float] = []
    marks: list[tuple[float, float | None]] = []
    pids = [w.pid for w in workers]

    def mark(record: dict[str, Any] | None = None) -> None:
        marks.append((time.process_time(), _processes_cpu_s(pids)))
        if record is not None:
            durations.append(float(record["duration_s"]))

    try:
        _await_clients(coord, clients, workers)
        mark()
        coord.run(on_round=mark)
        coord.wait_clients_finished(timeout=10.0)
    finally:
        server.stop(grace=None)
        for w in workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
    _check(coord, secure, clients, rounds)
    cpu = [  # (server, clients) between consecutive marks
        (server - marks[i][0], clients - before)
        for i, (server, clients) in enumerate(marks[1:])
        if clients is not None and (before := marks[i][1]) is not None
    ]
    return durations, cpu


def worker(address: str, certs: str, client_id: str, shift: float) -> None:
    """One client process: a constant update every round until the server says finished."""
    trainer = ConstantTrainer(shift)
    FlClient(
        Connection(address, client_id, cert_dir=Path(certs)),
        lambda reply: trainer,  # type: ignore[arg-type,return-value]
        max_wait=60.0,
    ).run()


def _cpu_summary(cpu: dict[str, list[tuple[float, float]]], scheme: str) -> dict[str, Any]:
    """Median CPU seconds per round (server, clients, both) per side, and the secure/plain ratio."""
    if not cpu["none"] or not cpu[scheme]:
        return {}
    per_side = {
        side: {
            "server": round(statistics.median(s for s, _ in rounds), 3),
            "clients": round(statistics.median(c for _, c in rounds), 3),
            "total": round(statistics.median(s + c for s, c in rounds), 3),
        }
        for side, rounds in cpu.items()
        if rounds
    }
    return {
        "cpu_per_round_s": per_side,
        "cpu_ratio_secure_to_plaintext": round(
            per_side[scheme]["total"] / per_side["none"]["total"], 3
        ),
    }


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":  # a client process of this benchmark
        worker(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10, help="clients (default: 10)")
    parser.add_argument("--params", type=int, default=1_000_000, help="d (default: 1e6)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side (default: 3)")
    parser.add_argument(
        "--neighbours", type=int, default=0, help="SecAgg+ neighbours (default: 0 = SecAgg)"
    )
    parser.add_argument(
        "--clients-as",
        choices=("processes", "threads"),
        default="processes",
        help="one OS process per client (default), or threads of the server's interpreter",
    )
    parser.add_argument(
        "--rounds", type=int, default=4, help="rounds per server with --clients-as processes"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="first rounds of each server not counted, with --clients-as processes (default: 1)",
    )
    parser.add_argument("--ckks", action="store_true", help="also time a CKKS round")
    args = parser.parse_args()
    if args.clients_as == "processes" and not 0 <= args.warmup < args.rounds:
        parser.error(f"--warmup must be in 0..{args.rounds - 1} (--rounds {args.rounds})")
    scheme = "secagg+" if args.neighbours else "secagg"
    times: dict[str, list[float]] = {"none": [], scheme: []}
    if args.ckks:
        times["ckks"] = []
    cpu: dict[str, list[tuple[float, float]]] = {side: [] for side in times}
    with tempfile.TemporaryDirectory() as tmp:
        certs = Path(tmp) / "certs"
        init_certificates(certs, clients=args.clients)
        distribute_ckks_keys(certs)
        for _ in range(args.repeats):  # sides alternate, so machine noise hits both
            for side in times:
                run = (args.clients, args.params, side, args.neighbours)
                if args.clients_as == "threads":
                    times[side].append(one_round(certs, Path(tmp), *run))
                else:
                    durations, used = process_rounds(certs, Path(tmp), *run, rounds=args.rounds)
                    times[side] += durations[args.warmup :]
                    cpu[side] += used[args.warmup :]
    plain, secure = statistics.median(times["none"]), statistics.median(times[scheme])
    result = {
        "clients": args.clients,
        "params": args.params,
        "scheme": scheme,
        "plaintext_round_s": round(plain, 3),
        "secure_round_s": round(secure, 3),
        "ratio_secure_to_plaintext": round(secure / plain, 3),
        "goal_ratio_max": 1.5,
        "meets_goal": secure / plain <= 1.5,
        **(
            {
                "ckks_round_s": round(statistics.median(times["ckks"]), 3),
                "ratio_ckks_to_plaintext": round(statistics.median(times["ckks"]) / plain, 3),
                "ratio_ckks_to_secagg": round(statistics.median(times["ckks"]) / secure, 3),
            }
            if args.ckks
            else {}
        ),
        **_cpu_summary(cpu, scheme),
        "runs_s": {k: [round(v, 3) for v in vs] for k, vs in times.items()},
        "clients_as": args.clients_as,
        "note": (
            "clients are threads of the server's process: one interpreter, 2 cores"
            if args.clients_as == "threads"
            else f"one process per client, {args.rounds} rounds per server, the first "
            f"{args.warmup} of each not counted; the server and all clients share this "
            "machine's cores"
        ),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
