"""Simulation at scale: our engine on Ray against Flower's simulation engine; prints JSON.

The workload of the issue: a population of ``--clients`` virtual clients (1,000), a cohort of
``--per-round`` (100) each round, ``--rounds`` (20) rounds of FedAvg; one small model
(backbone ``cnn-small``, 32x32 synthetic faces, a CosFace head over the training identities),
one identity and a few images per client, one local epoch of SGD (batch 8, momentum 0.9).

Rows (each in its own child process, so that its peak memory is its own):

* ``ours``: :class:`fl_secure.app.sim.engine.SimulationEngine` with
  :class:`fl_secure.app.sim.ray_executor.RayExecutor` (one actor per core), no DP: the
  like-for-like row;
* ``ours_dp``: the same with client-level DP (DP-FedAvg: clipping at 1, distributed noise
  z = 1 added by the clients before masking, the ledger written and committed every round)
  and SecAgg+ run for real among each cohort (the engine's in-process rounds);
* ``ours_batch`` / ``ours_dp_batch``: ``ours`` / ``ours_dp`` with ``--client-batch`` (25)
  sampled clients of an actor trained together in one vectorised pass
  (:mod:`fl_secure.app.sim.vectorized`; ``fl-secure simulate --client-batch``);
* ``flower``: ``benchmarks/simulation_flower_app.py`` under ``--flower-python`` (Flower 1.42,
  ``flwr[simulation]``, its Ray backend, one actor per core): the same model in plain torch,
  the same images (exported from our plan as ``.npy``), same batch size and epochs, FedAvg
  with ``fraction_train = per_round / clients`` and no federated evaluation;
* ``flower_dp``: the like-for-like row of ``ours_dp`` in Flower 1.42,
  ``benchmarks/simulation_flower_secure_app.py``: the same workload with Flower's SecAgg+
  (``SecAggPlusWorkflow`` + ``secaggplus_mod``; ``num_shares`` = our ``k`` + 1, since
  Flower counts a client's own share, and ``reconstruction_threshold`` = our ``t``, both
  derived by :func:`privacy.secagg.in_process.cohort_setup` for a cohort of ``--per-round``)
  and its central DP with client-side fixed clipping
  (``DifferentialPrivacyClientSideFixedClipping`` + ``fixedclipping_mod``: clipping at 1,
  Gaussian noise z = 1 added by the server to the unmasked mean; no accountant, no ledger);
* ``memory``: ours (no DP) for ``--memory-rounds`` rounds with ``--clients`` and with
  ``--memory-clients`` (10,000) virtual clients: peak RSS of each and their ratio.

Timing: ``rounds_s`` is the wall time of the training rounds (each side's start-up before
them is ``startup_s``; Flower starts its Ray actors inside round 1, ours before it),
``clients_per_s`` the client trainings per second of the rounds, ``steady_clients_per_s``
the same after round 1 (both sides warmed up); ``ratio_*`` = ours / Flower
(``ratio_ours_dp_over_flower_dp_*``: the secure rows, like for like). Peak memory is
the largest sum over the row's process and all its descendants (Ray's GCS, raylet and
workers) of the proportional set size (``peak_pss_mb``: shared pages split among the
processes) and of the resident set size (``peak_rss_mb``: shared pages counted in each),
sampled every 0.2 s from ``/proc/PID/smaps_rollup``. ``load_average_start`` / ``_end``: the
machine's 1, 5 and 15 minute load averages before the first row and after the last.

Flower's venv (Flower is never a dependency of this project)::

    python3 -m venv /work/flwr-venv
    /work/flwr-venv/bin/pip install 'flwr[simulation]==1.42.0' numpy
    # torch: reuse this project's (a CUDA build is several GB) through a .pth file
    echo "$PWD/.venv/lib/python3.11/site-packages" \\
        > /work/flwr-venv/lib/python3.11/site-packages/zz_torch.pth

Usage: python benchmarks/simulation.py [--clients 1000] [--per-round 100] [--rounds 20]
       [--flower-python /work/flwr-venv/bin/python]
       [--rows ours,ours_batch,ours_dp,ours_dp_batch,flower,flower_dp,memory]
       [--memory-clients 10000] [--memory-rounds 3] [--workers N] [--client-batch 25]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FLOWER_APP = ROOT / "benchmarks" / "simulation_flower_app.py"
FLOWER_SECURE_APP = ROOT / "benchmarks" / "simulation_flower_secure_app.py"
DEFAULT_FLOWER_PYTHON = Path("/work/flwr-venv/bin/python")
HELD_OUT = 4  # identities the server scores each round's model on (as every run has)

WORKLOAD = """
[run]
name = "simulation-bench"
seed = 1
[data]
source = "synthetic"
image_size = 32
num_identities = {identities}
images_per_identity = {images}
held_out_identities = {held_out}
[partition]
kind = "equal"
num_clients = {clients}
[model]
backbone = "cnn-small"
embedding_size = 32
[algorithm]
name = "fedavg"
[train]
rounds = {rounds}
local_epochs = 1
batch_size = {batch}
optimizer = "sgd"
lr = 0.05
threads = 1
[server]
clients_per_round = {per_round}
min_clients = 2
"""

PRIVATE = """
[privacy]
unit = "client"
noise_placement = "distributed"
clip_norm = 1.0
noise_multiplier = 1.0
delta = {delta}
[secure_aggregation]
scheme = "secagg+"
"""


def workload(args: argparse.Namespace, clients: int, *, private: bool) -> Any:
    """The benchmark's config for ``clients`` virtual clients."""
    from fl_secure.config import load_config

    text = WORKLOAD.format(
        identities=clients + HELD_OUT,
        images=args.images,
        held_out=HELD_OUT,
        clients=clients,
        rounds=args.rounds,
        batch=args.batch_size,
        per_round=args.per_round,
    )
    if private:
        text += PRIVATE.format(delta=1.0 / (10 * clients))
    path = Path(tempfile.mkdtemp(prefix="simbench-")) / "workload.toml"
    path.write_text(text)
    return load_config(path)


def secagg_parameters(config: Any, cohort: int) -> dict[str, Any]:
    """Our SecAgg+ ``k``, ``t`` and modulus for a cohort of ``cohort`` (as a round derives them)."""
    from privacy.secagg.in_process import cohort_setup

    plan = config.privacy
    setup = cohort_setup(
        config.secure_aggregation,
        [f"c{i}" for i in range(cohort)],
        1,  # k and t depend on the cohort and the rates, not on the vector's length
        round_id=bytes(16),
        ddg=(plan.noise_multiplier, plan.clip_norm, config.server.min_clients),
        min_inputs=config.server.min_clients,
    )
    return {
        "neighbours": setup.neighbours or cohort - 1,
        "threshold": setup.threshold,
        "modulus_bits": setup.modulus_bits,
    }


# ------------------------------------------------------------------ rows (child processes)
def row_ours(
    args: argparse.Namespace, clients: int, private: bool, client_batch: int = 1
) -> dict[str, Any]:
    """Our engine on Ray actors; the rounds timed."""
    import torch

    from fl_secure.app.sim.engine import SimulationEngine
    from fl_secure.app.sim.ray_executor import RayExecutor
    from fl_secure.runs import RunDir, new_run_dir

    torch.set_num_threads(1)
    config = workload(args, clients, private=private)
    started = time.perf_counter()
    run = RunDir(new_run_dir(Path(tempfile.mkdtemp(prefix="simbench-run-")), "bench"))
    workers = args.workers
    engine = SimulationEngine(
        config,
        run_dir=run,
        executor=lambda cfg: RayExecutor(cfg, num_workers=workers, client_batch=client_batch),
    )
    startup = time.perf_counter() - started
    started = time.perf_counter()
    ends = []
    for number in range(1, config.train.rounds + 1):
        engine.train_round(number)
        ends.append(time.perf_counter() - started)
    out: dict[str, Any] = {
        "clients": clients,
        "rounds": engine.rounds_completed,
        **rates(engine.cohort_sizes, ends, startup),
        "workers": getattr(engine.executor, "num_workers", None),
        "secure_aggregation": config.secure_aggregation.scheme,
        "client_batch": client_batch,
    }
    if config.secure_aggregation.scheme != "none":
        out["secagg"] = secagg_parameters(config, args.per_round)
    if engine.server.privacy is not None:
        out["privacy"] = {
            k: engine.server.privacy.summary().get(k)
            for k in ("epsilon", "delta", "accountant", "privacy_unit", "noise_placement")
        }
    engine.close()
    return out


def rates(cohorts: list[int], ends: list[float], startup: float) -> dict[str, Any]:
    """Clients/s over all rounds and after round 1 (each side warms up in round 1)."""
    trained = sum(cohorts)
    out: dict[str, Any] = {
        "client_trainings": trained,
        "startup_s": round(startup, 2),
        "rounds_s": round(ends[-1], 2),
        "total_s": round(startup + ends[-1], 2),
        "clients_per_s": round(trained / ends[-1], 2),
    }
    if len(ends) > 1:
        out["steady_clients_per_s"] = round(sum(cohorts[1:]) / (ends[-1] - ends[0]), 2)
    return out


def export_data(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Our plan's client training images as ``.npy`` for the Flower side."""
    import numpy as np

    from fl_secure.data.plan import plan_federation

    plan = plan_federation(workload(args, args.clients, private=False))
    ids = np.asarray(plan.train_identities)
    images = [c.train.images.numpy() for c in plan.clients]
    labels = [np.searchsorted(ids, c.train.labels.numpy()) for c in plan.clients]
    offsets = np.cumsum([0, *(len(x) for x in images)])
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "images.npy", np.concatenate(images).astype(np.float32))
    np.save(folder / "labels.npy", np.concatenate(labels).astype(np.int64))
    np.save(folder / "offsets.npy", offsets.astype(np.int64))
    np.save(folder / "classes.npy", np.int64(len(ids)))
    return {"images": int(offsets[-1]), "classes": len(ids)}


# ------------------------------------------------------------------ the parent
def tree_memory(pid: int) -> tuple[int, int]:
    """Resident and proportional set sizes (bytes) of ``pid`` and all its descendants.

    RSS counts a page shared by several processes (torch's libraries, Ray's object store)
    once in each; PSS splits it among them, so the PSS sum is the tree's share of memory.
    """
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    rss = pss = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss


def measured(command: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``command``; its last stdout line as JSON, with the peak RSS of its tree."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    peak = [0, 0]

    def poll() -> None:
        while proc.poll() is None:
            rss, pss = tree_memory(proc.pid)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            time.sleep(0.2)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    out, err = proc.communicate()
    watcher.join()
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {err.strip()[-1500:]}"}
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": f"no JSON output: {err.strip()[-1500:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    result["peak_rss_mb"] = round(peak[0] / 2**20, 1)
    result["peak_pss_mb"] = round(peak[1] / 2**20, 1)
    return result


def child(args: argparse.Namespace, row: str, **extra: Any) -> dict[str, Any]:
    """This script as a child process running one row."""
    command = [sys.executable, __file__, "--row", row, *args.passthrough]
    for key, value in extra.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return measured(command, env)


def flower(args: argparse.Namespace, *, secure: bool = False) -> dict[str, Any]:
    """The Flower row (``secure``: SecAgg+ and DP as ours_dp's), or why it was skipped."""
    python = Path(args.flower_python)
    if not python.exists():
        return {"skipped": f"no Flower interpreter at {python} (see this script's docstring)"}
    data = Path(tempfile.mkdtemp(prefix="simbench-flower-"))
    exported = child(args, "export", data=data)
    if "error" in exported:
        return {"error": f"export: {exported['error']}"}
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "FLB_DATA": str(data),
        "FLB_CLIENTS": str(args.clients),
        "FLB_ROUNDS": str(args.rounds),
        "FLB_FRACTION": str(args.per_round / args.clients),
        "FLB_BATCH": str(args.batch_size),
        "FLB_LR": "0.05",
        "FLB_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    if args.workers:
        env["FLB_CPUS"] = str(args.workers)
    if secure:
        ours = secagg_parameters(workload(args, args.clients, private=True), args.per_round)
        env["FLB_SHARES"] = str(min(ours["neighbours"] + 1, args.per_round))
        env["FLB_THRESHOLD"] = str(ours["threshold"])
        env["FLB_NOISE"] = env["FLB_CLIP"] = "1.0"  # PRIVATE's noise_multiplier, clip_norm
    env.pop("PYTHONPATH", None)
    result = measured([str(python), str(FLOWER_SECURE_APP if secure else FLOWER_APP)], env)
    if "rounds_s" in result:
        ends = result.pop("round_ends_s")
        startup = result.pop("total_s") - result.pop("rounds_s")
        result.update(rates([args.per_round] * len(ends), ends, startup))
    return result


def main() -> None:
    """Run the rows asked for; print one JSON object."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--per-round", type=int, default=100)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--images", type=int, default=4, help="images per client (one identity)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=0, help="Ray actors (0: one per core)")
    p.add_argument("--flower-python", default=str(DEFAULT_FLOWER_PYTHON))
    p.add_argument(
        "--rows", default="ours,ours_batch,ours_dp,ours_dp_batch,flower,flower_dp,memory"
    )
    p.add_argument(
        "--client-batch", type=int, default=25,
        help="the *_batch rows: virtual clients an actor trains together (vectorised)",
    )  # fmt: skip
    p.add_argument("--memory-clients", type=int, default=10_000)
    p.add_argument("--memory-rounds", type=int, default=3)
    p.add_argument("--row", help=argparse.SUPPRESS)  # a child process's row
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--population", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.workers = args.workers or None
    if args.row is not None:  # a child: one row, one JSON line
        clients = args.population or args.clients
        if args.row == "export":
            print(json.dumps(export_data(args, args.data)))
        else:
            batch = args.client_batch if args.row.endswith("_batch") else 1
            private = args.row.startswith("ours_dp")
            print(json.dumps(row_ours(args, clients, private=private, client_batch=batch)))
        return
    shared = ["clients", "per_round", "rounds", "images", "batch_size", "workers", "client_batch"]
    args.passthrough = [
        item
        for name in shared
        if getattr(args, name)
        for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))
    ]
    rows = args.rows.split(",")
    report: dict[str, Any] = {
        "workload": {
            "clients": args.clients,
            "per_round": args.per_round,
            "rounds": args.rounds,
            "images_per_client": args.images,
            "batch_size": args.batch_size,
            "model": "cnn-small, 32x32, embedding 32, CosFace head",
            "cpus": os.cpu_count(),
        },
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }
    if "ours" in rows:
        report["ours"] = child(args, "ours")
    if "ours_batch" in rows:
        report["ours_batch"] = child(args, "ours_batch")
    if "flower" in rows:
        report["flower"] = flower(args)
    if "ours_dp" in rows:
        report["ours_dp"] = child(args, "ours_dp")
    if "ours_dp_batch" in rows:
        report["ours_dp_batch"] = child(args, "ours_dp_batch")
    if "flower_dp" in rows:
        report["flower_dp"] = flower(args, secure=True)
    theirs = report.get("flower", {})
    for key in ("clients_per_s", "steady_clients_per_s"):
        for row in ("ours", "ours_batch", "ours_dp", "ours_dp_batch"):
            mine = report.get(row, {})
            if key in mine and key in theirs:
                report[f"ratio_{row}_over_flower_{key}"] = round(mine[key] / theirs[key], 2)
        for row in ("ours_dp", "ours_dp_batch"):
            mine, theirs_dp = report.get(row, {}), report.get("flower_dp", {})
            if key in mine and key in theirs_dp:
                report[f"ratio_{row}_over_flower_dp_{key}"] = round(mine[key] / theirs_dp[key], 2)
    if "memory" in rows:
        small_args = argparse.Namespace(**vars(args))
        small_args.passthrough = [*args.passthrough, "--rounds", str(args.memory_rounds)]
        few = child(small_args, "ours", population=args.clients)
        many = child(small_args, "ours", population=args.memory_clients)
        report["memory"] = {str(args.clients): few, str(args.memory_clients): many}
        for key in ("peak_pss_mb", "peak_rss_mb"):
            if key in few and key in many:
                report["memory"][f"ratio_{key}"] = round(many[key] / few[key], 3)
    report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
