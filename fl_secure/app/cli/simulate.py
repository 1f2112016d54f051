"""``fl-secure simulate``: a run of virtual clients in this process or on Ray; a run directory.

The simulation engine (:mod:`fl_secure.app.sim`) runs the gRPC coordinator's rounds over a
population of virtual clients (sampled cohorts, client-level DP with its ledger); the
``--backend`` picks where the clients train: ``serial`` in this process, ``ray`` on Ray
actors (:class:`fl_secure.app.sim.ray_executor.RayExecutor`; an embedded local Ray, or the
cluster at ``--ray-address``). The run directory has ``fl-secure train``'s layout, so
``fl-secure report --run`` and ``fl-secure privacy ledger --run`` read it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from fl_secure.app.cli.common import (
    SUCCESS,
    Subparsers,
    add_output_flags,
    positive_int,
    torch_threads,
)
from fl_secure.app.cli.runs import print_summary
from fl_secure.errors import FlSecureError

if TYPE_CHECKING:
    from fl_secure.app.sim.engine import ExecutorFactory
    from fl_secure.config import Config

# Imports that load torch or ray are inside the functions: `fl-secure --help` stays fast
# (fl_secure.app.cli.common says why).

#: Where virtual clients train: this process, or Ray actors.
BACKENDS = ("serial", "ray")


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """``--backend``, ``--ray-address``, ``--workers``: where the virtual clients train."""
    p.add_argument(
        "--backend", choices=BACKENDS, default="serial",
        help="where the virtual clients train: serial (this process, default) or ray (Ray "
        "actors; needs pip install 'fl-secure[sim]')",
    )  # fmt: skip
    p.add_argument(
        "--ray-address", metavar="ADDR",
        help="with --backend ray: an existing Ray cluster (auto, or ray://HOST:10001); "
        "default: an embedded local Ray",
    )  # fmt: skip
    p.add_argument(
        "--workers", type=positive_int("--workers"), metavar="N",
        help="with --backend ray: Ray actors (default: the cluster's CPUs / train.threads)",
    )  # fmt: skip
    p.add_argument(
        "--client-batch", type=int, default=1, metavar="K",
        help="sampled cohorts: train up to K virtual clients of a worker together in one "
        "vectorised pass where the design allows (FedAvg's objective; equal to one at a time "
        "to float tolerance, not bit for bit; docs/simulation.md); default 1",
    )  # fmt: skip


def add_parser(sub: Subparsers) -> None:
    """Add ``simulate``."""
    p = sub.add_parser(
        "simulate",
        help="simulate a federation of virtual clients (in this process or on Ray)",
        description="Runs a config's rounds on virtual clients with the gRPC coordinator's "
        "round code (sampled cohorts of server.clients_per_round or server.sample_rate from "
        "partition.num_clients, client-level DP with its ledger) and writes a run directory "
        "under --out, as fl-secure train does. Ray pickles jobs between its processes: run "
        "it on a cluster that you operate (docs/threat-model.md).",
    )
    p.add_argument("--config", type=Path, required=True, help="TOML config")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. --set partition.num_clients=1000",
    )  # fmt: skip
    p.add_argument(
        "--out", type=Path, default=Path("runs"), help="base folder for run dirs (default: runs)"
    )
    add_backend_args(p)
    add_output_flags(p)
    p.set_defaults(func=cmd_simulate)


def executor_factory(args: argparse.Namespace) -> ExecutorFactory | None:
    """The engine's executor for ``--backend`` (None: the engine's serial default).

    Raises:
        FlSecureError: a Ray flag without ``--backend ray``.
    """
    batch = getattr(args, "client_batch", 1)
    if batch < 1:
        raise FlSecureError(f"--client-batch must be >= 1, got {batch}")
    if args.backend != "ray":
        flags = (("--ray-address", args.ray_address), ("--workers", args.workers))
        given = [flag for flag, value in flags if value is not None]
        if given:
            raise FlSecureError(f"{' and '.join(given)} need --backend ray")
        if batch == 1:
            return None
        from fl_secure.app.sim.executor import SerialExecutor
        from fl_secure.app.sim.server_side import sampled as is_sampled

        return lambda config: SerialExecutor(
            config, keep_trainers=not is_sampled(config), client_batch=batch
        )
    from fl_secure.app.sim.ray_executor import RayExecutor, import_ray
    from fl_secure.app.sim.server_side import sampled

    import_ray()  # refuse before the data are built: Ray is an optional extra
    address, workers = args.ray_address, args.workers

    def build(config: Config) -> RayExecutor:
        # every client in every round: each keeps its private state on its own actor
        return RayExecutor(
            config, address=address, num_workers=workers, keep_trainers=not sampled(config),
            client_batch=batch,
        )  # fmt: skip

    return build


def cmd_simulate(args: argparse.Namespace) -> int:
    """Simulate a config; print its summary (or one JSON object)."""
    from fl_secure.app.simulated_run import write_simulated_run
    from fl_secure.config import load_config
    from fl_secure.runs import RunDir

    config = load_config(args.config, args.set)
    factory = executor_factory(args)
    torch_threads(config.train.threads)
    run_dir = write_simulated_run(config, args.out, progress=not args.json, executor=factory)
    summary = RunDir(run_dir).read_summary()
    print_summary(summary, run_dir, args.json)
    return 0 if summary.get("status") in SUCCESS else 1
