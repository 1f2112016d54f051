"""The simulation engine's cost per virtual client, serial, in this process (prints JSON).

A population of ``--clients`` virtual clients (synthetic faces, two identities a client),
``--cohort`` drawn a round, ``--rounds`` rounds of FedAvg, optionally with
client-level DP (central noise) and SecAgg among each cohort. Reports the time to build the
data plan, each round's wall time and client jobs per second, how many clients were built,
what the driver carries between rounds, and the peak RSS.

    python benchmarks/sim_engine.py --clients 1000 --cohort 100 --rounds 2
    python benchmarks/sim_engine.py --clients 1000 --cohort 100 --rounds 2 --dp --secagg
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch

import fl_secure.app.sim.executor as executor_module
from fl_secure.app.sim.engine import SimulationEngine
from fl_secure.config import load_config
from fl_secure.runs import RunDir, new_run_dir

CONFIG = """
[run]
name = "sim-engine"
seed = 1
[data]
source = "synthetic"
image_size = 32
num_identities = {identities}
images_per_identity = 4
held_out_identities = 10
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
local_steps = 1
batch_size = 4
lr = 0.05
[server]
min_clients = 2
clients_per_round = {cohort}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--cohort", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dp", action="store_true", help="client-level DP, central noise z = 1")
    ap.add_argument("--secagg", action="store_true", help="SecAgg among each cohort")
    args = ap.parse_args()
    torch.set_num_threads(1)
    overrides = []
    if args.dp:
        overrides += [
            "privacy.unit=client",
            "privacy.noise_multiplier=1.0",
            "privacy.clip_norm=1.0",
        ]
    if args.secagg:
        overrides += ["secure_aggregation.scheme=secagg"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sim.toml"
        path.write_text(
            CONFIG.format(
                identities=2 * args.clients + 10,
                clients=args.clients,
                rounds=args.rounds,
                cohort=args.cohort,
            )
        )
        config = load_config(path, overrides)
        built = [0]
        original = executor_module.build_local_trainer

        def counted(*a, **k):  # type: ignore[no-untyped-def]
            built[0] += 1
            return original(*a, **k)

        executor_module.build_local_trainer = counted  # type: ignore[assignment]
        started = time.perf_counter()
        run = RunDir(new_run_dir(Path(tmp), "sim")) if args.dp else None
        engine = SimulationEngine(config, run_dir=run, evaluated=0)
        plan_s = time.perf_counter() - started
        rounds = []
        for number in range(1, args.rounds + 1):
            t = time.perf_counter()
            record = engine.train_round(number)
            seconds = time.perf_counter() - t
            rounds.append(
                {
                    "round": number,
                    "cohort": record.get("cohort_size"),
                    "seconds": round(seconds, 2),
                    "client_jobs_per_s": round(args.cohort / seconds, 1),
                    "epsilon": (record.get("privacy") or {}).get("epsilon"),
                }
            )
        engine.close()
    print(
        json.dumps(
            {
                "population": args.clients,
                "cohort": args.cohort,
                "dp": args.dp,
                "secagg": args.secagg,
                "plan_and_server_s": round(plan_s, 1),
                "rounds": rounds,
                "clients_built": built[0],
                "clients_carried": len(engine.carry),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            }
        )
    )


if __name__ == "__main__":
    main()
