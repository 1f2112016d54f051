"""Chaos benchmark: client and server processes killed with SIGKILL mid-run; prints one JSON object.

A standalone ``fl-secure server`` and ``--clients`` ``fl-secure client`` processes over gRPC +
mutual TLS run ``--rounds`` rounds of the tiniest configuration (synthetic faces, cnn-small,
32x32 images) with secure aggregation (SecAgg) and client-level DP whose discrete-Gaussian
noise the clients add in shares before masking. While it runs:

- in each round, ``--kill-rate`` of the client processes, drawn at random, are killed with
  SIGKILL at a random moment of the round and started again at once (same state folder);
- every ``--server-kill-every`` rounds the server is killed with SIGKILL during the next
  round and started again with ``--resume`` on the same address (so is a server that exits
  with the run aborted: an operator resumes it).

The processes run through ``benchmarks/chaos_node.py``, which records each client's integer
input before masking and each sum the server unmasks. At the end the benchmark checks:

- every unmasked sum equals the sum of its survivors' recorded inputs mod 2^bits, exactly,
  and every completed round has such a sum with the round record's survivors;
- each round 0..R is recorded once in ``metrics.jsonl``, and once as a client-level row in
  the privacy ledger; the ledger verifies (``fl-secure privacy ledger --verify``);
- the run's final epsilon equals a fresh PLD computation from the ledger's rows;
- nothing is lost: the run completed all rounds, every client process that was not killed
  finished with exit code 0 (one restarted in the last round may start after the server has
  exited; it then waits for a server that is gone, and is listed apart).

Usage: python benchmarks/chaos.py [--clients 30] [--rounds 50] [--kill-rate 0.3]
       [--server-kill-every 10] [--seed 0] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NODE = ROOT / "benchmarks" / "chaos_node.py"
CONFIG = """
[run]
name = "chaos"
seed = 3
[data]
source = "synthetic"
image_size = 32
num_identities = {identities}
images_per_identity = 4
held_out_identities = 4
[partition]
num_clients = {clients}
[model]
backbone = "cnn-small"
embedding_size = 32
[algorithm]
name = "fedpe"
[train]
rounds = {rounds}
local_steps = 1
batch_size = 8
lr = 0.05
[server]
min_clients = {min_clients}
round_timeout = {round_timeout}
max_retries = 3
[privacy]
unit = "client"
noise_placement = "distributed"
noise_multiplier = {noise}
[secure_aggregation]
scheme = "secagg"
clip_range = 8.0
stage_timeout = {stage_timeout}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Chaos:
    """The processes of one federation, and the kills."""

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        from fl_secure.tls import init_certificates

        self.work, self.args = work, args
        self.rng = random.Random(args.seed)  # noqa: S311 - which process to kill, not a secret
        self.config = work / "chaos.toml"
        min_clients = args.min_clients or max(2, args.clients // 3)
        self.config.write_text(
            CONFIG.format(
                identities=3 * args.clients + 4, clients=args.clients, rounds=args.rounds,
                min_clients=min_clients, round_timeout=args.round_timeout,
                stage_timeout=args.round_timeout / 2, noise=args.noise_multiplier,
            )
        )  # fmt: skip
        self.certs = work / "certs"
        init_certificates(self.certs, clients=args.clients)
        self.record = work / "record"
        self.out = work / "runs"
        self.logs = work / "logs"
        self.logs.mkdir()
        self.port = _free_port()
        self.env = {
            **os.environ, "GRPC_VERBOSITY": "ERROR", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "CHAOS_RECORD": str(self.record),
        }  # fmt: skip
        self.server: subprocess.Popen[bytes] | None = None
        self.clients: dict[int, subprocess.Popen[bytes]] = {}
        self.killed: list[subprocess.Popen[bytes]] = []
        self.client_kills = 0
        self.server_kills = 0
        self.server_resumes = 0
        self.server_exits: list[int] = []
        self.current_round = 0  # the round running now (the last completed one + 1)
        self.restarted_in: dict[int, int] = {}  # client -> the round it was last restarted in

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        with (self.logs / log).open("ab") as handle:
            return subprocess.Popen(
                [sys.executable, str(NODE), *args], stdout=handle, stderr=subprocess.STDOUT,
                env=self.env, cwd=self.work,
            )  # fmt: skip

    @property
    def run_dir(self) -> Path:
        runs = sorted(self.out.glob("chaos-*"))
        return runs[0] if runs else self.out / "missing"

    def start_server(self, resume: bool = False) -> None:
        args = ["server", "--certs", str(self.certs), "--address", f"localhost:{self.port}",
                "--no-eval"]  # fmt: skip
        if resume:
            args += ["--resume", str(self.run_dir)]
        else:
            args += ["--config", str(self.config), "--out", str(self.out)]
        self.server = self._spawn(args, "server.log")

    def start_client(self, i: int) -> None:
        self.clients[i] = self._spawn(
            [
                "client", "--server", f"localhost:{self.port}", "--id", f"client-{i}",
                "--certs", str(self.certs), "--config", str(self.config),
                "--plan-index", str(i), "--state-dir", str(self.work / "state" / str(i)),
            ],
            f"client-{i}.log",
        )  # fmt: skip

    def kill_clients(self) -> list[int]:
        """SIGKILL ``kill_rate`` of the running clients at random; start them again at once."""
        alive = [i for i, p in self.clients.items() if p.poll() is None]
        chosen = self.rng.sample(
            alive, min(len(alive), round(self.args.kill_rate * self.args.clients))
        )
        for i in chosen:
            proc = self.clients[i]
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            self.killed.append(proc)
            self.client_kills += 1
            self.start_client(i)
            self.restarted_in[i] = self.current_round
        return chosen

    def kill_server(self) -> None:
        """SIGKILL the server and start it again with ``--resume`` on the same address."""
        assert self.server is not None
        self.server.send_signal(signal.SIGKILL)
        self.server.wait(timeout=30)
        self.server_kills += 1
        self.start_server(resume=True)
        self.server_resumes += 1

    def completed_rounds(self) -> list[int]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        records = [json.loads(ln) for ln in path.read_text().splitlines() if ln.endswith("}")]
        return [r["round"] for r in records if "kind" not in r]

    def stop(self) -> None:
        for proc in [*self.clients.values(), self.server]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)

    # ---------------------------------------------------------------------- the run
    def run(self) -> dict[str, Any]:
        """Start everything, kill on schedule until the run completes (or time runs out)."""
        args = self.args
        self.start_server()
        for i in range(args.clients):
            self.start_client(i)
        start = time.monotonic()
        deadline = start + args.max_minutes * 60
        seen = 0  # the highest completed round seen
        round_started = time.monotonic()
        round_seconds = 10.0
        kill_at: float | None = None
        server_kill_at: float | None = None
        server_killed_after: set[int] = set()
        while time.monotonic() < deadline:
            time.sleep(0.2)
            assert self.server is not None
            code = self.server.poll()
            if code is not None:
                self.server_exits.append(code)
                summary = self.run_dir / "summary.json"
                if code == 0 and summary.exists():
                    break
                self.start_server(resume=True)  # aborted or failed: the operator resumes
                self.server_resumes += 1
                continue
            done = self.completed_rounds()
            now = time.monotonic()
            if done and max(done) > seen:  # round `seen + 1` began: plan this round's kills
                if seen > 0:
                    round_seconds = max(1.0, now - round_started)
                seen, round_started = max(done), now
                self.current_round = seen + 1
                if kill_at is not None:  # the last round ended before its kill: kill now
                    self.kill_clients()
                    kill_at = None
                if seen < args.rounds and args.kill_rate > 0:
                    kill_at = now + self.rng.uniform(0.1, 0.9) * round_seconds
                every = args.server_kill_every
                if every and seen % every == 0 and seen < args.rounds:
                    if seen not in server_killed_after:
                        server_killed_after.add(seen)
                        server_kill_at = now + self.rng.uniform(0.1, 0.9) * round_seconds
            if kill_at is not None and now >= kill_at:
                kill_at = None
                self.kill_clients()
            if server_kill_at is not None and now >= server_kill_at:
                server_kill_at = None
                self.kill_server()
        wall = time.monotonic() - start
        finished = {}
        for i, proc in self.clients.items():
            try:
                finished[i] = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                finished[i] = None
        return {"wall_s": round(wall, 1), "client_exit_codes": finished}


# ------------------------------------------------------------------------- the checks
def check_sums(record: Path, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Every unmasked sum against its survivors' recorded inputs; every round has one."""
    exact, wrong, missing_inputs = 0, [], []
    sums: list[dict[str, Any]] = []
    for meta_path in sorted((record / "sums").glob("*.json")):
        meta = json.loads(meta_path.read_text())
        total = np.load(meta_path.with_suffix(".npy"))
        bits = int(meta["modulus_bits"])
        mask = np.uint64((1 << bits) - 1) if bits < 64 else np.uint64(2**64 - 1)
        acc = np.zeros(total.shape, np.uint64)
        folder = record / "inputs" / meta_path.stem
        absent = [c for c in meta["survivors"] if not (folder / f"{c}.npy").exists()]
        if absent:
            missing_inputs.append({"round_id": meta_path.stem, "clients": absent})
            continue
        for client in meta["survivors"]:
            acc += np.load(folder / f"{client}.npy").astype(np.uint64)  # wraps mod 2^64
        if np.array_equal(acc & mask, total.astype(np.uint64) & mask):
            exact += 1
            sums.append(meta)
        else:
            wrong.append(meta)
    unmatched = []
    for r in rounds:
        if r["round"] == 0:
            continue
        survivors = sorted(r["clients"])
        if not any(s["round"] == r["round"] and s["survivors"] == survivors for s in sums):
            unmatched.append(r["round"])
    return {
        "unmasked_sums": exact + len(wrong) + len(missing_inputs),
        "exact": exact,
        "wrong": wrong,
        "missing_inputs": missing_inputs,
        "completed_rounds_without_an_exact_sum": unmatched,
    }


def check_ledger(run: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The ledger's own verification (the CLI) and a fresh epsilon from its rows."""
    from privacy.dp.calibration import epsilon_for

    cmd = [sys.executable, "-m", "fl_secure.app.cli", "privacy", "ledger", "--run", str(run),
           "--verify", "--json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    out = json.loads(done.stdout) if done.stdout.strip() else {}
    entries = out.get("entries", [])
    released = [e for e in entries if e["kind"] in ("client_level", "discarded_sum")]
    rounds = [e["round"] for e in entries if e["kind"] == "client_level"]
    events = {(e["payload"]["noise_multiplier"], e["payload"]["sample_rate"]) for e in released}
    fresh = None
    if len(events) == 1:
        ((z, q),) = events
        delta = float(summary.get("delta") or 1e-5)
        # distributed noise is integer noise: its zCDP bound, no amplification
        fresh = epsilon_for(
            accountant="pld", noise_multiplier=z, sample_rate=q, steps=len(released),
            delta=delta, noise="discrete_gaussian",
        )  # fmt: skip
    return {
        "verify_ok": bool(out.get("verify", {}).get("ok")),
        "verify_problems": out.get("verify", {}).get("problems"),
        "client_level_rounds": rounds,
        "discarded_sums": out.get("discarded_sums", []),
        "epsilon_recorded": summary.get("epsilon"),
        "epsilon_fresh": fresh,
        "events": sorted(events),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--kill-rate", type=float, default=0.3)
    parser.add_argument("--server-kill-every", type=int, default=10)
    parser.add_argument("--min-clients", type=int, default=0, help="0: a third of the clients")
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--round-timeout", type=float, default=120.0)
    parser.add_argument("--max-minutes", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="keep the run, logs and records here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fl-secure-chaos-"))
    chaos = Chaos(work, args)
    try:
        timing = chaos.run()
    finally:
        chaos.stop()
    run = chaos.run_dir
    summary = (
        json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    )
    lines = (run / "metrics.jsonl").read_text().splitlines() if run.exists() else []
    records = [json.loads(ln) for ln in lines if ln.endswith("}")]
    completed = [r for r in records if "kind" not in r]
    failed_attempts = [r for r in records if "kind" in r]
    ledger = check_ledger(run, summary) if run.exists() else {}
    sums = check_sums(chaos.record, completed) if chaos.record.exists() else {}
    numbers = [r["round"] for r in completed]
    survivors = [r["num_updates"] for r in completed if r["round"] > 0]
    codes = timing.pop("client_exit_codes")
    fresh, recorded = ledger.get("epsilon_fresh"), ledger.get("epsilon_recorded")
    all_rounds = list(range(args.rounds + 1))
    checks = {
        "completed": summary.get("status") == "completed" and numbers == all_rounds,
        "no_round_twice": len(numbers) == len(set(numbers)),
        "every_sum_exact": bool(sums) and not sums["wrong"] and not sums["missing_inputs"]
        and not sums["completed_rounds_without_an_exact_sum"],
        "ledger_verifies": bool(ledger.get("verify_ok")),
        "ledger_one_row_per_round": ledger.get("client_level_rounds") == all_rounds[1:],
        "epsilon_is_a_fresh_recomputation": fresh is not None and recorded is not None
        and abs(fresh - recorded) <= 1e-9 * max(1.0, fresh),
        # a client restarted in the last round may come up after the server has exited: it
        # then waits for a server that is gone (by design) and never hears FINISHED
        "every_client_finished": all(
            code == 0 or chaos.restarted_in.get(i) == args.rounds for i, code in codes.items()
        ),
    }  # fmt: skip
    out = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "checks": checks,
        "ok": all(checks.values()),
        **timing,
        "client_kills": chaos.client_kills,
        "server_kills": chaos.server_kills,
        "server_resumes": chaos.server_resumes,
        "server_exit_codes": chaos.server_exits,
        "client_exit_codes": codes,
        "restarted_in_the_last_round": sorted(
            i for i, r in chaos.restarted_in.items() if r == args.rounds
        ),
        "rounds_completed": numbers,
        "failed_attempts": len(failed_attempts),
        "failed_attempt_reasons": [r.get("reason", "")[:160] for r in failed_attempts][:10],
        "survivors_per_round": survivors,
        "sums": {k: v for k, v in sums.items() if k != "wrong"}
        | {"wrong": len(sums.get("wrong", []))},
        "ledger": ledger,
        "run_status": summary.get("status"),
        "run_reason": summary.get("reason"),
    }
    print(json.dumps(out, indent=2))
    if args.keep is not None:
        shutil.copytree(work, args.keep, dirs_exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
