"""``fl-secure experiment``: a grid of simulated runs, tabulated.

``--backend`` picks where each cell's clients train, as for ``fl-secure simulate``: ``serial``
in this process, ``ray`` on Ray actors (one Ray for the whole grid; each cell starts and stops
its own actors, and every client of a cell stays on one actor). Both give the same figures.
"""

from __future__ import annotations

import argparse
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from fl_secure.app.cli.common import Subparsers, add_output_flags, print_json, torch_threads
from fl_secure.app.cli.simulate import add_backend_args, executor_factory
from fl_secure.errors import FlSecureError

# Imports that load torch, grpc or tenseal are inside the functions: `fl-secure --help` stays
# fast (fl_secure.app.cli.common says why).


def add_parser(sub: Subparsers) -> None:
    """Add ``experiment``."""
    p = sub.add_parser(
        "experiment",
        help="simulate a grid of algorithm x partition x seed (in this process or on Ray); "
        "write tables",
        description="Runs every cell of an experiment file (see fl_secure/app/experiment.py) with "
        "the simulation (the gRPC path's algorithm code, no network) and writes results.csv and "
        "results.md under --out. --backend ray trains each cell's clients on Ray actors (the "
        "same figures as serial; Ray pickles jobs between its processes: run it on a cluster "
        "that you operate, docs/threat-model.md). A run whose training diverges is recorded as "
        "aborted (status and reason columns, no figures) and the grid goes on; the command then "
        "exits with 1.",
    )
    p.add_argument("--config", type=Path, required=True, help="experiment TOML file")
    p.add_argument(
        "--out", type=Path,
        help="output folder (default: runs/experiments/NAME); refused when it is not empty, "
        "so earlier results are not replaced, unless --overwrite",
    )  # fmt: skip
    p.add_argument(
        "--overwrite", action="store_true",
        help="run into a non-empty --out, replacing its results.csv and results.md",
    )  # fmt: skip
    add_backend_args(p)
    add_output_flags(p)
    p.set_defaults(func=cmd_experiment)


def cmd_experiment(args: argparse.Namespace) -> int:
    """Simulate an experiment grid; print where its tables went."""
    from fl_secure.app.experiment import load_experiment, run_experiment

    if args.client_batch != 1:  # a grid's clients all train every round and are kept
        raise FlSecureError(
            "--client-batch applies to sampled cohorts (fl-secure simulate); an experiment "
            "grid trains every client every round, one at a time"
        )
    experiment = load_experiment(args.config)
    factory = executor_factory(args)  # refuses a missing Ray before any cell runs
    torch_threads(1)
    out = args.out or Path("runs") / "experiments" / experiment.name
    session: AbstractContextManager[None] = nullcontext()
    if factory is not None:
        from fl_secure.app.sim.ray_executor import ray_session

        session = ray_session(args.ray_address)  # one Ray start for every cell
    with session:
        rows = run_experiment(
            experiment, out, progress=not args.json, overwrite=args.overwrite, executor=factory
        )
    aborted = sum(r["status"] == "aborted" for r in rows)
    if args.json:
        print_json({"out": str(out), "rows": rows})
    else:
        print((out / "results.md").read_text(encoding="utf-8"))
        print(f"results: {out / 'results.csv'}, {out / 'results.md'}")
        if aborted:
            print(f"{aborted} of {len(rows)} runs aborted (status and reason in results.csv)")
    return 1 if aborted else 0
