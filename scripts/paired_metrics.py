"""Paired differences of any column of an experiment's ``results.csv`` against a baseline.

``results.md`` gives them for the held-out TAR@FAR=1e-2; this prints them for other columns
(the clients' figures, tuned or not), with the same 95% Student-t interval
(:func:`fl_secure.app.paired.paired_differences`)::

    python scripts/paired_metrics.py docs/results/hfmaml_partitions_cpu/results.csv fedavg \
        clients_tar_at_far_1e-2_mean new_tuned_tar_at_far_1e-1_mean
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fl_secure.app.experiment import read_results
from fl_secure.app.paired import paired_differences


def main() -> None:
    """Print one line per (column, algorithm, partition)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", type=Path, help="an experiment's results.csv")
    p.add_argument("baseline", help="the algorithm the differences are taken against")
    p.add_argument("columns", nargs="+", help="results.csv columns")
    args = p.parse_args()
    rows = read_results(args.csv)
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    partitions = list(dict.fromkeys(r["partition"] for r in rows))
    for column in args.columns:
        for d in paired_differences(rows, algorithms, partitions, args.baseline, metric=column):
            interval = f"[{d.low:+.3f}, {d.high:+.3f}]" if d.low is not None else "-"
            mean = f"{d.mean:+.3f}" if d.mean is not None else "-"
            print(f"{column} | {d.algorithm} - {args.baseline} | {d.partition} | {mean} | "
                  f"{interval} | n={d.n}")  # fmt: skip


if __name__ == "__main__":
    main()
