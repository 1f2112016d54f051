"""``fl-secure train``: embedded mode (server and N client processes), or the pooled baseline."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from fl_secure.app.cli.common import (
    SUCCESS,
    Subparsers,
    add_output_flags,
    print_json,
    torch_threads,
)
from fl_secure.app.cli.runs import add_run_args, check_resume, print_summary
from fl_secure.errors import FlSecureError
from fl_secure.runs import RunDir

# Imports that load torch, grpc or tenseal are inside the functions: `fl-secure --help` stays
# fast (fl_secure.app.cli.common says why).

log = logging.getLogger("fl_secure")


def add_parser(sub: Subparsers) -> None:
    """Add ``train``."""
    p = sub.add_parser("train", help="train in embedded mode (server + N client processes)")
    add_run_args(p)
    p.add_argument(
        "--centralized",
        action="store_true",
        help="baseline: train one model on the union of the clients' data",
    )
    p.add_argument(
        "--insecure", action="store_true", help="plaintext gRPC (loopback tests only; warns)"
    )
    p.add_argument(
        "--audit", action="store_true",
        help="after training, run the attack audit (as `fl-secure audit --run RUN`)",
    )  # fmt: skip
    p.add_argument(
        "--report", action="store_true",
        help="write the compliance report (RUN/report/report.html, .md, .json) at the end",
    )  # fmt: skip
    add_output_flags(p)
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    """Embedded mode: server and N client processes on localhost over gRPC + mTLS."""
    from fl_secure.algorithms.registry import check_config
    from fl_secure.config import Config, load_config
    from server.embedded import run_embedded

    config: Config | None = None
    check_resume(args)
    if args.resume is None:
        if args.config is None:
            raise FlSecureError("train needs --config FILE (or --resume RUN_DIR)")
        config = load_config(args.config, args.set)
        check_config(config)
    if args.audit:  # refuse before training, not after it (a resumed run: its own config)
        from audits.observations import check_auditable

        resumed = RunDir(args.resume).config if args.resume is not None else None
        if resumed is not None and resumed.exists():
            check_auditable(load_config(resumed).algorithm.name)
        elif config is not None:
            check_auditable(config.algorithm.name)
    if args.centralized and (args.audit or args.report):
        given = [f for f, used in (("--audit", args.audit), ("--report", args.report)) if used]
        raise FlSecureError(
            f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} a federated run: "
            "--centralized trains the pooled baseline, which has no parties to attack and no "
            "privacy statement to report"
        )
    if config is not None and not args.centralized:
        p = config.privacy
        if p.unit == "client" and p.delta >= 1.0 / config.partition.num_clients:
            log.warning(
                "privacy.delta = %g is not below 1/N for the N = %d clients: a mechanism with "
                "this delta could release one client's data outright (the report will warn)",
                p.delta,
                config.partition.num_clients,
            )
    torch_threads(config.train.threads if config is not None else 1)
    if args.centralized:
        from fl_secure.app.centralized import run_centralized

        if config is None:
            raise FlSecureError("--centralized needs --config FILE")
        summary = run_centralized(config, out=args.out, progress=not args.json)
        return print_summary(summary, Path(summary["run_dir"]), args.json)
    result = run_embedded(
        config if config is not None else Config(),
        out=args.out,
        resume=args.resume,
        insecure=args.insecure,
        progress=not args.json,
    )
    code = 0 if args.json else print_summary(result.summary, result.run_dir, False)
    done: dict[str, Any] = {}  # with --json: what the audit and report wrote, in the one object
    if args.audit:
        from audits.run_audit import AuditSettings, audit_run, findings, summary_lines

        if not args.json:
            print("auditing the run (what each party could reconstruct) ...")
        results = audit_run(result.run_dir, AuditSettings(), progress=not args.json)
        path = result.run_dir / "audit" / "results.json"
        if args.json:
            done.update(audit=str(path), audit_findings=findings(results))
        else:
            for line in summary_lines(results):
                print(line)
            print(f"audit: {path}")
    if args.report:
        from fl_secure.app.report import write_report

        written = write_report(result.run_dir, ["html", "md", "json"])
        if args.json:
            done["report"] = str(written["html"])
        else:
            print(f"compliance report: {written['html']}")
    if args.json:
        print_json({**result.summary, "run_dir": str(result.run_dir), **done})
    return code if result.summary.get("status") in SUCCESS else 1
