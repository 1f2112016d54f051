"""Server under load: a real ``fl-secure server`` with hundreds of live sites; prints JSON.

Starts a standalone server process (gRPC + mutual TLS, certificates from
:func:`fl_secure.tls.init_certificates`) and ``--clients`` virtual clients in a few harness
processes (``benchmarks/server_load_clients.py``): each is the project's own
:class:`client.app.FlClient` with its own channel and client certificate, speaking the real
protocol (Join, PollTask long polls, GetParameters and SubmitUpdate streams, the
SecAggExchange stages); only local training is replaced by a known update (small integers
times 2^-8, on SecAgg's fixed-point grid). The same run is then repeated with
``--baseline-clients``, and each figure of the large run is also given as a ratio to the
baseline's (same machine, same invocation).

Two workloads (``--workload``): ``plain`` (FedAvg, no DP: joins, long polls, downloads and
uploads of the model) and ``secure`` (SecAgg+, ``neighbours`` and ``threshold`` derived from
``corrupt_fraction`` and ``dropout_fraction``), where the harness processes holding
``--dropout-fraction`` of the clients are SIGKILLed in round ``--kill-round`` once every one
of their clients has passed the key stages and is training: their connections drop mid-round
and the survivors must recover their masks. Checked, per round:

- every round completes (``metrics.jsonl``), in the first attempt;
- secure: the server's survivors are exactly the clients that were not killed, and the
  released model equals ``w + (sum of the survivors' known updates) / |survivors|`` BIT-EXACTLY
  (the global model the next round starts from, or the last checkpoint); plain: the
  released model equals ``w + mean`` to float32 rounding (the streaming mean's order varies).

Measured: the time for all clients to join, each round's duration (the server's record) and
the whole run's wall time, the server process's peak RSS (``VmHWM``), its threads, open file
descriptors and established TCP connections (sampled), and client-side errors.

Usage: python benchmarks/server_load.py [--clients 200] [--baseline-clients 20] [--rounds 2]
       [--workload plain|secure|both] [--dropout-fraction 0.2] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from queue import Empty, Queue
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # its siblings (a PyPI "benchmarks" may exist)

from server_load_checks import check_models, proc_sample  # noqa: E402

HARNESS = ROOT / "benchmarks" / "server_load_clients.py"
CONFIG = """
[run]
name = "load"
seed = 0
[data]
source = "synthetic"
image_size = 32
num_identities = {identities}
images_per_identity = 4
held_out_identities = 2
[partition]
num_clients = {clients}
[model]
backbone = "cnn-small"
embedding_size = 8
[algorithm]
name = "fedavg"
[train]
rounds = {rounds}
local_steps = 1
batch_size = 4
lr = 0.05
trainable = "embedding"
[server]
min_clients = {min_clients}
round_timeout = {round_timeout}
max_retries = 1
[secure_aggregation]
scheme = "{scheme}"
dropout_fraction = {dropout}
stage_timeout = {stage_timeout}
"""


class LoadRun:
    """One server process and its harness processes for ``n`` clients."""

    def __init__(self, work: Path, n: int, secure: bool, args: argparse.Namespace) -> None:
        from fl_secure.tls import init_certificates

        self.work, self.n, self.secure, self.args = work, n, secure, args
        self.tag = f"{'secure' if secure else 'plain'} n={n}"
        victims = round(args.dropout_fraction * n) if secure else 0
        self.victims = [f"client-{i}" for i in range(n - victims, n)]
        dropout = max(args.dropout_fraction, victims / n) if secure else 0.1
        self.config = work / "load.toml"
        self.config.write_text(
            CONFIG.format(
                identities=n + 2, clients=n, rounds=args.rounds,
                min_clients=max(2, math.ceil(n / 2)), round_timeout=args.round_timeout,
                scheme=args.scheme if secure else "none", dropout=dropout,
                stage_timeout=args.stage_timeout,
            )
        )  # fmt: skip
        self.certs = work / "certs"
        init_certificates(self.certs, clients=n)  # ca/, server/, sites/<id>/
        self.record = work / "params"
        self.record.mkdir()
        self.events: Queue[tuple[int, dict[str, Any]]] = Queue()
        self.procs: list[subprocess.Popen[str]] = []
        self.killed: list[str] = []
        self.samples: list[dict[str, float]] = []

    def start_server(self) -> tuple[subprocess.Popen[bytes], int]:
        port_file = self.work / "port"
        cmd = [sys.executable, "-m", "fl_secure.app.cli", "server", "--config", str(self.config),
               "--certs", str(self.certs / "server"), "--address", "localhost:0", "--port-file",
               str(port_file), "--out", str(self.work / "runs"), "--no-eval"]  # fmt: skip
        env = {**os.environ, "GRPC_VERBOSITY": "ERROR", "OMP_NUM_THREADS": "1"}
        with (self.work / "server.log").open("ab") as log:
            server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        end = time.monotonic() + 300
        while not (port_file.exists() and port_file.read_text().strip()):
            if server.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the server did not start: {self.work / 'server.log'}")
            time.sleep(0.2)
        return server, int(port_file.read_text().strip())

    def start_harnesses(self, port: int) -> None:
        size = self.args.clients_per_process
        live = [f"client-{i}" for i in range(self.n) if f"client-{i}" not in self.victims]
        groups = [(live[i : i + size], False) for i in range(0, len(live), size)]
        groups += [(self.victims[i : i + size], True) for i in range(0, len(self.victims), size)]
        env = {**os.environ, "GRPC_VERBOSITY": "ERROR", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}  # fmt: skip
        self.victim_procs: list[int] = []
        for ids, victim in groups:
            cmd = [sys.executable, str(HARNESS), "--port", str(port), "--certs", str(self.certs),
                   "--ids", ",".join(ids), "--record", str(self.record),
                   "--max-wait", str(self.args.round_timeout)]  # fmt: skip
            if victim:
                cmd += ["--victim-round", str(self.args.kill_round)]
                self.victim_procs.append(len(self.procs))
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=(self.work / f"harness-{len(self.procs)}.log").open("w"),
                env=env, text=True, bufsize=1,
            )  # fmt: skip
            index = len(self.procs)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(index, proc), daemon=True).start()

    def _read(self, index: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                self.events.put((index, json.loads(line)))

    def run(self) -> dict[str, Any]:
        """Start, release the clients at once, watch until the server exits; the figures."""
        server, port = self.start_server()
        started = time.time()
        try:
            self.start_harnesses(port)
            return self._watch(server, port, started)
        finally:
            for proc in [*self.procs, server]:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)

    def _watch(self, server: subprocess.Popen[bytes], port: int, started: float) -> dict[str, Any]:
        args = self.args
        ready = joined = 0
        joins: dict[str, float] = {}
        trained: dict[int, set[str]] = {}
        done: dict[int, set[str]] = {}
        errors: list[dict[str, Any]] = []
        finished = 0
        go = 0.0
        deadline = time.monotonic() + args.max_minutes * 60
        last_line = 0.0
        while server.poll() is None and time.monotonic() < deadline:
            try:
                index, ev = self.events.get(timeout=0.5)
            except Empty:
                index, ev = -1, {"event": "tick"}
            kind = ev["event"]
            if kind == "ready":
                ready += 1
                if ready == len(self.procs):  # every process imported: release all clients
                    go = time.time()
                    for proc in self.procs:
                        assert proc.stdin is not None
                        proc.stdin.write("go\n")
                        proc.stdin.flush()
            elif kind == "joined":
                joins[ev["client"]] = ev["t"]
                joined = len(joins)
            elif kind == "train":
                trained.setdefault(ev["round"], set()).add(ev["client"])
            elif kind == "done":
                done.setdefault(ev["round"], set()).add(ev["client"])
            elif kind == "error":
                errors.append({"process": index, **ev})
            elif kind == "finished":
                finished += 1
            at_kill = trained.get(args.kill_round, set()) & set(self.victims)
            if self.victims and not self.killed and len(at_kill) == len(self.victims):
                for i in self.victim_procs:  # mid-round: after the key stages, before upload
                    self.procs[i].send_signal(signal.SIGKILL)
                self.killed = list(self.victims)
                print(f"[{self.tag}] killed {len(self.victims)} clients", file=sys.stderr)
            sample = proc_sample(server.pid, port)
            if sample:
                self.samples.append(sample)
            now = time.monotonic()
            if now - last_line > 5 and sample:
                last_line = now
                rounds = {r: len(c) for r, c in sorted(done.items())}
                print(
                    f"[{self.tag}] joined {joined}/{self.n}, updates per round {rounds}, "
                    f"server RSS {sample['rss_mb']:.0f} MB, threads {sample['threads']:.0f}, "
                    f"connections {sample['connections']:.0f}, errors {len(errors)}",
                    file=sys.stderr,
                )
        wall = time.time() - (go or started)
        code = server.poll()
        if code is None:
            server.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        while not self.events.empty():  # the last events of the harnesses
            _, ev = self.events.get()
            if ev["event"] == "error":
                errors.append(ev)
            elif ev["event"] == "finished":
                finished += 1
        return self._figures(code, go, joins, errors, finished, wall)

    def _figures(
        self,
        code: int | None,
        go: float,
        joins: dict[str, float],
        errors: list[dict[str, Any]],
        finished: int,
        wall: float,
    ) -> dict[str, Any]:
        runs = sorted((self.work / "runs").glob("load-*"))
        run = runs[0] if runs else self.work / "missing"
        lines = (run / "metrics.jsonl").read_text().splitlines() if run.exists() else []
        records = [json.loads(ln) for ln in lines if ln.endswith("}")]
        completed = [r for r in records if "kind" not in r and r["round"] > 0]
        aborted = [r for r in records if "kind" in r]
        summary = json.loads((run / "summary.json").read_text()) if run.exists() else {}
        everyone = [f"client-{i}" for i in range(self.n)]
        models = check_models(run, self.record, completed, self.secure, everyone, self.killed)
        fatal = [e for e in errors if e.get("fatal")]
        peak = max((s["hwm_mb"] for s in self.samples), default=0.0)
        checks = {
            "server_exit_0": code == 0,
            "every_round_completed": [r["round"] for r in completed]
            == list(range(1, self.args.rounds + 1)),
            "no_failed_attempt": not aborted,
            "all_joined": len(joins) == self.n,
            "no_fatal_client_error": not fatal,
            "every_live_client_finished": finished == self.n - len(self.killed),
            **models["checks"],
        }
        return {
            "clients": self.n,
            "killed": len(self.killed),
            "ok": all(checks.values()),
            "checks": checks,
            "join_s": round(max(joins.values()) - go, 3) if joins and go else None,
            "round_s": [r["duration_s"] for r in completed],
            "round_mean_s": round(sum(r["duration_s"] for r in completed) / len(completed), 3)
            if completed
            else None,
            "wall_s": round(wall, 2),
            "server_peak_rss_mb": round(peak, 1),
            "server_max_threads": max((s["threads"] for s in self.samples), default=0),
            "server_max_fds": max((s["fds"] for s in self.samples), default=0),
            "server_max_connections": max((s["connections"] for s in self.samples), default=0),
            "server_max_queued_connections": max((s["queued"] for s in self.samples), default=0),
            "survivors": [
                len(r.get("secure_aggregation", {}).get("survivors", r["clients"]))
                for r in completed
            ],  # fmt: skip
            "client_errors": len(errors),
            "client_error_samples": sorted({e["message"] for e in errors})[:8],
            "failed_attempts": [a.get("reason", "")[:200] for a in aborted][:5],
            "model": models["figures"],
            "run_status": summary.get("status"),
        }


RATIO_KEYS = ("join_s", "round_mean_s", "wall_s", "server_peak_rss_mb", "server_max_threads",
              "server_max_fds", "server_max_connections", "client_errors")  # fmt: skip


def workload(secure: bool, args: argparse.Namespace) -> dict[str, Any]:
    """The workload at the baseline size and at the full size, and their ratios."""
    out: dict[str, Any] = {}
    sizes = [args.clients]
    if 0 < args.baseline_clients != args.clients:  # 0: no baseline, no ratios
        sizes.insert(0, args.baseline_clients)
    for n in sizes:
        work = Path(tempfile.mkdtemp(prefix="fl-secure-load-"))
        print(f"[{'secure' if secure else 'plain'} n={n}] in {work}", file=sys.stderr)
        try:
            out[str(n)] = LoadRun(work, n, secure, args).run()
        finally:
            if args.keep is not None:
                shutil.copytree(work, args.keep / f"{'secure' if secure else 'plain'}-{n}")
            shutil.rmtree(work, ignore_errors=True)
    out["ok"] = all(out[str(n)]["ok"] for n in sizes)
    if len(sizes) == 2:
        small, large = out[str(args.baseline_clients)], out[str(args.clients)]
        out["ratios"] = {
            k: round(large[k] / small[k], 2) if small.get(k) and large.get(k) is not None else None
            for k in RATIO_KEYS
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--baseline-clients", type=int, default=20, help="0: none")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workload", choices=("plain", "secure", "both"), default="both")
    parser.add_argument("--secure", action="store_true", help="the secure workload only")
    parser.add_argument("--scheme", choices=("secagg+", "secagg"), default="secagg+")
    parser.add_argument("--dropout-fraction", type=float, default=0.2)
    parser.add_argument("--kill-round", type=int, default=1)
    parser.add_argument("--clients-per-process", type=int, default=40)
    parser.add_argument("--round-timeout", type=float, default=600.0)
    parser.add_argument("--stage-timeout", type=float, default=120.0)
    parser.add_argument("--max-minutes", type=float, default=30.0, help="per run (each size)")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--keep", type=Path, help="copy each run's folder (logs, run) here")
    args = parser.parse_args(argv)
    if args.secure:
        args.workload = "secure"
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    for name in ("plain", "secure"):
        if args.workload in (name, "both"):
            result[name] = workload(name == "secure", args)
    result["ok"] = all(result[w]["ok"] for w in ("plain", "secure") if w in result)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
