"""``fl-secure report``: a run's compliance report."""

from __future__ import annotations

import argparse
from pathlib import Path

from fl_secure.app.cli.common import Subparsers, add_output_flags, print_json

# Imports that load torch, grpc or tenseal are inside the functions: `fl-secure --help` stays
# fast (fl_secure.app.cli.common says why).


def add_parser(sub: Subparsers) -> None:
    """Add ``report``."""
    p = sub.add_parser(
        "report",
        help="write a run's compliance report (privacy statement, ledger, secure aggregation, "
        "audit, utility, provenance)",
        description="Reads the run's summary.json, metrics.jsonl, ledger.sqlite and (if the run "
        "was audited) audit/results.json; writes RUN/report/report.{html,md,json,pdf}. Every "
        "number is copied from those records. Audit images of real faces are left out unless "
        "--include-images.",
    )
    p.add_argument("--run", type=Path, required=True, help="run directory")
    p.add_argument(
        "--format", default="html,md,json",
        help="comma-separated subset of html,md,json,pdf (pdf needs Chromium; default: "
        "html,md,json)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, help="output folder (default: RUN/report)")
    p.add_argument(
        "--include-images", action="store_true",
        help="embed audit image grids even when the run used real faces",
    )  # fmt: skip
    add_output_flags(p)
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    """Write a run's compliance report; print where it went."""
    from fl_secure.app.report import write_report

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    written = write_report(args.run, formats, include_images=args.include_images, out=args.out)
    if args.json:
        print_json({k: str(v) for k, v in written.items()})
    else:
        for kind, path in written.items():
            print(f"{kind}: {path}")
    return 0
