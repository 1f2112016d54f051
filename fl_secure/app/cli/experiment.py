"""``fl-secure experiment``: a grid of simulated runs, tabulated."""

from __future__ import annotations

import argparse
from pathlib import Path

from fl_secure.app.cli.common import Subparsers, add_output_flags, print_json, torch_threads

# Imports that load torch, grpc or tenseal are inside the functions: `fl-secure --help` stays
# fast (fl_secure.app.cli.common says why).


def add_parser(sub: Subparsers) -> None:
    """Add ``experiment``."""
    p = sub.add_parser(
        "experiment",
        help="simulate a grid of algorithm x partition x seed in one process; write tables",
        description="Runs every cell of an experiment file (see fl_secure/app/experiment.py) with "
        "the in-process simulation (the gRPC path's algorithm code, no network) and writes "
        "results.csv and results.md under --out. A run whose training diverges is recorded as "
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
    add_output_flags(p)
    p.set_defaults(func=cmd_experiment)


def cmd_experiment(args: argparse.Namespace) -> int:
    """Simulate an experiment grid; print where its tables went."""
    from fl_secure.app.experiment import load_experiment, run_experiment

    experiment = load_experiment(args.config)
    torch_threads(1)
    out = args.out or Path("runs") / "experiments" / experiment.name
    rows = run_experiment(experiment, out, progress=not args.json, overwrite=args.overwrite)
    aborted = sum(r["status"] == "aborted" for r in rows)
    if args.json:
        print_json({"out": str(out), "rows": rows})
    else:
        print((out / "results.md").read_text(encoding="utf-8"))
        print(f"results: {out / 'results.csv'}, {out / 'results.md'}")
        if aborted:
            print(f"{aborted} of {len(rows)} runs aborted (status and reason in results.csv)")
    return 1 if aborted else 0
