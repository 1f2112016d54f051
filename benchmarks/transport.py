"""Transport benchmark: prints one JSON object.

1. Throughput of parameter bytes over gRPC + mutual TLS on loopback (GetParameters stream,
   server -> client, and SubmitUpdate, client -> server) against an in-process
   serialize/deserialize baseline of the same tensors in the same run (ratio). Each round's
   wire time is the download (from the previous round's end to the client's training) plus
   the upload (from the end of training to the server's fold of it): the echo training, the
   server step and the checkpoint are left out, and so is round 1 (TLS handshake, warm-up).
   Both sides report the median of their repeats.
2. Peak memory of a server process during one round of 8 clients vs 2 clients at 10M float32
   parameters: VmHWM after the round minus VmRSS just before it (the peak is reset then), so
   the process's baseline (torch, the model) is not in the ratio (goal: ratio <= 1.5, i.e.
   memory O(d), not O(clients x d)). Sizes in MB (1e6 bytes).

Usage: python benchmarks/transport.py [--params 10000000] [--mb 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "server"))


def _params(n: int) -> OrderedDict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return OrderedDict([("w", rng.standard_normal(n).astype(np.float32))])


def baseline_mb_s(params: OrderedDict[str, np.ndarray], repeats: int = 3) -> float:
    """In-process: chunk, serialize to bytes, parse, reassemble with digest checks."""
    from fl_secure import serde
    from fl_secure.v1 import transport_pb2 as pb

    nbytes = serde.total_bytes(params)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        wire = [c.SerializeToString() for c in serde.parameters_to_chunks(1, params)]
        parsed = (pb.ParameterChunk.FromString(b) for b in wire)
        serde.parameters_from_chunks(parsed, max_bytes=nbytes + 1)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e6


def grpc_mb_s(params: OrderedDict[str, np.ndarray], rounds: int = 4) -> dict[str, float]:
    """Real server + client over mTLS: median wire time of one download plus one upload."""
    from conftest import EchoTrainer, make_run  # the same harness the tests use

    from fl_secure import serde

    nbytes = serde.total_bytes(params)
    ended: list[float] = []  # each round's end (the next round's parameters are ready)
    trained: list[tuple[float, float]] = []  # the client's training, per round
    folded: list[float] = []  # the server folded the round's upload

    class Timed(EchoTrainer):
        def train(self, shared, training):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            out = super().train(shared, training)
            trained.append((start, time.perf_counter()))
            return out

    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(
            Path(tmp), params, clients=1, rounds=rounds, min_clients=1,
            on_round=lambda record: ended.append(time.perf_counter()),
        )  # fmt: skip
        commit = run.coordinator.commit_upload

        def timed_commit(ticket, tensors):  # type: ignore[no-untyped-def]
            commit(ticket, tensors)
            folded.append(time.perf_counter())

        run.coordinator.commit_upload = timed_commit  # type: ignore[method-assign]
        run.client("client-0", Timed(shift=0.0)).run()
        run.server.stop(grace=None)  # type: ignore[attr-defined]
    wire = [  # rounds 2.. : download + upload
        (trained[r][0] - ended[r - 1]) + (folded[r] - trained[r][1]) for r in range(1, rounds)
    ]
    # each round moves the parameters twice (down and up)
    return {"seconds": statistics.median(wire), "mb_s": 2 * nbytes / statistics.median(wire) / 1e6}


SERVER_SNIPPET = r"""
import os, sys, json, threading
from pathlib import Path
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import numpy as np

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
from collections import OrderedDict
from conftest import make_run
n, clients, tmp = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
params = OrderedDict([("w", np.zeros(n, np.float32))])
run = make_run(tmp, params, clients=clients, rounds=1, min_clients=clients, round_timeout=600)

def status_kb(key):
    lines = open("/proc/self/status").read().splitlines()
    return int([l for l in lines if l.startswith(key)][0].split()[1])

before = status_kb("VmRSS")  # no client yet: torch, gRPC, the model
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS now
(tmp / "port").write_text(str(run.port))
run.driver.join()
print(json.dumps({{"vmhwm_kb": status_kb("VmHWM"), "before_kb": before,
                  "status": run.coordinator.status}}))
run.server.stop(grace=None)
"""


def server_peak_kb(n: int, clients: int) -> dict[str, object]:
    """Run a server process for one round of ``clients`` echo clients; return its VmHWM."""
    from conftest import EchoTrainer

    from client.app import FlClient
    from client.transport import Connection

    with tempfile.TemporaryDirectory() as tmp:
        code = SERVER_SNIPPET.format(root=str(ROOT), tests=str(ROOT / "tests" / "server"))
        proc = subprocess.Popen(  # noqa: S603
            [sys.executable, "-c", code, str(n), str(clients), tmp],
            stdout=subprocess.PIPE,
            text=True,
        )
        port_file = Path(tmp) / "port"
        deadline = time.time() + 120
        while not port_file.exists() and time.time() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"the benchmark's server process exited ({proc.returncode})")
            time.sleep(0.1)
        if not port_file.exists():
            proc.kill()
            raise SystemExit("the benchmark's server process did not start within 120 s")
        port = int(port_file.read_text())
        threads = []
        for i in range(clients):
            conn = Connection(f"localhost:{port}", f"client-{i}", cert_dir=Path(tmp) / "certs")
            trainer = EchoTrainer(shift=1.0)
            c = FlClient(conn, lambda reply, t=trainer: t, max_wait=60)  # type: ignore[misc]
            th = threading.Thread(target=c.run, daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join(timeout=600)
        out, _ = proc.communicate(timeout=120)
    return json.loads(out.strip().splitlines()[-1])


def _mb(kb: float) -> float:
    return round(kb * 1024 / 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--params", type=int, default=10_000_000,
        help="float32 parameters of the memory test (default: 1e7)",
    )  # fmt: skip
    parser.add_argument(
        "--mb", type=float, default=100.0, help="MB of parameters for the throughput test"
    )
    args = parser.parse_args()
    import logging

    logging.disable(logging.WARNING)
    tensors = _params(int(args.mb * 1e6 / 4))
    base = baseline_mb_s(tensors)
    wire = grpc_mb_s(tensors)
    two = server_peak_kb(args.params, 2)
    eight = server_peak_kb(args.params, 8)
    inc2 = two["vmhwm_kb"] - two["before_kb"]  # the round's own peak, in kB
    inc8 = eight["vmhwm_kb"] - eight["before_kb"]
    result = {
        "throughput": {
            "payload_mb": args.mb,
            "grpc_mtls_mb_s": round(wire["mb_s"], 1),
            "in_process_serde_mb_s": round(base, 1),
            "ratio_grpc_vs_serde": round(wire["mb_s"] / base, 3),
        },
        "server_peak_memory": {
            "params": args.params,
            "model_mb": args.params * 4 / 1e6,
            "clients_2_vmhwm_mb": _mb(two["vmhwm_kb"]),
            "clients_8_vmhwm_mb": _mb(eight["vmhwm_kb"]),
            "clients_2_before_round_mb": _mb(two["before_kb"]),
            "clients_8_before_round_mb": _mb(eight["before_kb"]),
            "clients_2_round_peak_mb": _mb(inc2),
            "clients_8_round_peak_mb": _mb(inc8),
            "ratio_8_vs_2": round(inc8 / inc2, 3),
            "extra_per_client_mb": _mb((inc8 - inc2) / 6),
            "goal_ratio_max": 1.5,
        },
        "machine": {"cpus": os.cpu_count()},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
