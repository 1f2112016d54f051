"""``fl-secure audit``: attack a run's views; what each party could reconstruct."""

from __future__ import annotations

import argparse
from pathlib import Path

from fl_secure.app.cli.common import (
    Subparsers,
    add_output_flags,
    positive_int,
    print_json,
    torch_threads,
)

# Imports that load torch, grpc or tenseal are inside the functions: `fl-secure --help` stays
# fast (fl_secure.app.cli.common says why).


def add_parser(sub: Subparsers) -> None:
    """Add ``audit``."""
    p = sub.add_parser(
        "audit",
        help="attack a run: what each party could reconstruct of the sites' faces; empirical "
        "epsilon",
        description="Builds what the server and a curious client saw under the run's design "
        "and settings (global model, heads, per-client updates or only their secure sum), "
        "then attacks exactly those views: model inversion of the head rows they hold (else of "
        "the best surrogate), identification of exposed head rows (templates), analytic "
        "recovery of a fully connected layer's inputs from a rebuilt client update, and of who "
        "took part from the clients' summed update (leakage), and a canary audit of the "
        "client-level DP mechanism (empirical epsilon beside the "
        "accountant's). An independent evaluator trained on the targets' own images judges "
        "every reconstruction: top-1 with its 95% interval, and KNN distance, SSIM and PSNR, "
        "each beside its chance level. The output ends with the findings (an attack above "
        "chance at 95% confidence, an empirical epsilon above the accountant's), which "
        "`fl-secure report` lists as warnings. Writes RUN/audit/results.json and PNG grids "
        "(grids of real faces only with --include-images).",
    )
    p.add_argument("--run", type=Path, required=True, help="run directory (fl-secure train)")
    p.add_argument(
        "--attack", default="inversion,templates,leakage,canary",
        help="comma-separated subset of inversion,templates,leakage,canary (default: all)",
    )  # fmt: skip
    p.add_argument(
        "--targets",
        type=int,
        default=10,
        help="target identities (default: 10). Top-1 is printed with its 95%% interval, which "
        "more targets narrow (at 10 a top-1 of 0.30 is [0.07, 0.65], at 30 [0.15, 0.49]); "
        "inversion time grows in proportion",
    )
    p.add_argument(
        "--steps", type=int, default=200, help="optimisation steps per inversion (default: 200)"
    )
    p.add_argument(
        "--public", type=Path,
        help="identity folders of public faces for the attacker's prior (e.g. LFW); default: "
        "the run's held-out identities",
    )  # fmt: skip
    p.add_argument("--public-crop", type=int, default=0, help="centre crop of --public (LFW: 150)")
    p.add_argument(
        "--canary-trials",
        type=positive_int("--canary-trials"),
        default=None,
        help="canaries of the one-run audit and trials of the Clopper-Pearson audit (default: "
        "sized so that the audit can test the run's epsilon, at least 1000 and at most 60000: "
        "about 33000 for epsilon 8; 1000 can show at most about 4.7)",
    )
    p.add_argument("--seed", type=int, default=0, help="attacker and audit randomness (default: 0)")
    p.add_argument(
        "--include-images", action="store_true",
        help="write image grids even when the run used real faces",
    )  # fmt: skip
    add_output_flags(p)
    p.set_defaults(func=cmd_audit)


def cmd_audit(args: argparse.Namespace) -> int:
    """Attack a run's views (inversion, templates, leakage, canary); write RUN/audit/."""
    from audits.run_audit import AuditSettings, audit_run, summary_lines

    torch_threads(1)
    settings = AuditSettings(
        attacks=tuple(a.strip() for a in args.attack.split(",") if a.strip()),
        targets=args.targets,
        steps=args.steps,
        include_images=args.include_images,
        public_dir=args.public,
        public_center_crop=args.public_crop,
        canaries=args.canary_trials,
        trials=args.canary_trials,
        seed=args.seed,
    )
    results = audit_run(args.run, settings, progress=not args.json)
    if args.json:
        print_json(results)
        return 0
    for line in summary_lines(results):
        print(line)
    print(f"results: {Path(results['run']) / 'audit' / 'results.json'}")
    return 0
