"""What ``train`` and ``server`` share: the flags of a run, the resume check, the summary printed.

A run is started from ``--config`` (with ``--set`` overrides) or continued with ``--resume``
under its own ``config.toml``; when it ends, :func:`print_summary` prints its headline
figures and its privacy statement.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from fl_secure.app.cli.common import SUCCESS, print_json
from fl_secure.errors import CheckpointError, FlSecureError
from fl_secure.runs import RunDir
from privacy.dp.rounding import up_to_places

# Imports that load torch, grpc or tenseal are inside the functions: `fl-secure --help` stays
# fast (fl_secure.app.cli.common says why).

HEADLINE = ("tar_at_far_1e-1", "tar_at_far_1e-2", "tar_at_far_1e-3", "rank1")


def add_run_args(p: argparse.ArgumentParser) -> None:
    """``--config``, ``--out``, ``--set``, ``--resume``: train and server start or resume runs."""
    p.add_argument("--config", type=Path, help="TOML config, e.g. examples/quickstart.toml")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs"),
        help="base folder for run dirs (default: runs)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.rounds=3 (not with --resume)",
    )
    p.add_argument(
        "--resume", type=Path, metavar="RUN_DIR", help="continue a crashed run under its config"
    )


def check_resume(args: argparse.Namespace) -> None:
    """--resume continues a run under its own config.toml: refuse flags that would change it."""
    if args.resume is None:
        return
    given = [flag for flag, used in (("--config", args.config), ("--set", args.set)) if used]
    if given:
        raise FlSecureError(
            f"--resume continues {args.resume} with the config it started with (its "
            f"config.toml): drop {' and '.join(given)}; a run's privacy accounting and "
            "partition assume one config throughout"
        )
    run = RunDir(args.resume)
    if run.summary.exists():
        try:
            status = run.read_summary().get("status")
        except CheckpointError:  # damaged: not a record of a run that ended
            status = None
        if status in SUCCESS:
            raise FlSecureError(
                f"{args.resume} already ended ({status!r} in summary.json): there is nothing "
                "to resume, and resuming would overwrite its summary; start a new run"
            )


def print_summary(summary: dict[str, Any], run_dir: Path, as_json: bool) -> int:
    """Print a finished run's summary (headline figures, privacy, run directory); exit code 0.

    With ``as_json`` the summary and the run directory as one JSON object instead.
    """
    if as_json:
        print_json({**summary, "run_dir": str(run_dir)})
        return 0
    print(f"status: {summary.get('status')} ({summary.get('reason', '')})")
    untrained = summary.get("untrained", {})
    initial = (
        "initial, pretrained"
        if str(summary.get("initial_model", "")).startswith("pretrained")
        else "untrained"
    )
    for key in HEADLINE:
        if key in summary:
            before = untrained.get(key)
            extra = f"   ({initial}: {before:.4f})" if isinstance(before, float) else ""
            value = summary[key]  # null: the run scored NaN (metrics.jsonl is strict JSON)
            shown = f"{value:.4f}" if isinstance(value, float) else "n/a"
            print(f"{key:>16}: {shown}{extra}")
    start, final = untrained.get("tar_at_far_1e-2"), summary.get("tar_at_far_1e-2")
    if isinstance(start, float) and isinstance(final, float):
        eps = summary.get("epsilon")
        spent = (
            f"epsilon {up_to_places(eps, 4)} (delta {summary.get('delta'):g}, "
            f"{summary.get('privacy_unit')} level)"
            if isinstance(eps, float)
            else "no differential privacy"
        )
        print(f"summary: held-out TAR@FAR=1e-2 {start:.4f} ({initial}) -> {final:.4f}, {spent}")
    held = summary.get("held_out") or {}
    if isinstance(held.get("expression_accuracy"), float):  # FedAffect: expressions, not ids
        acc, majority = held["expression_accuracy"], held.get("expression_majority")
        before = untrained.get("expression_accuracy")
        line = f"expression accuracy: {acc:.4f}"
        if isinstance(majority, float):
            line += f"   (always the most frequent expression: {majority:.4f})"
        if isinstance(before, float):
            line += f"   ({initial}: {before:.4f})"
        print(line)
        if isinstance(majority, float) and acc <= majority:
            print("  no better than always answering the most frequent expression")
    cs = summary.get("clients_summary", {})
    us = summary.get("untrained_clients_summary", {})
    for key in ("tar_at_far_1e-2", "rank1"):
        if f"{key}_mean" in cs:
            before = us.get(f"{key}_mean")
            extra = f"   ({initial}: {before:.4f})" if isinstance(before, float) else ""
            print(
                f"per-client {key}: {cs[f'{key}_mean']:.4f} ± {cs[f'{key}_std']:.4f} "
                f"(mean ± std across clients, own test images, self-reported){extra}"
            )
    if summary.get("privacy_unit") not in (None, "none"):
        eps = summary["epsilon"]
        shown = "none accounted" if eps is None else up_to_places(eps, 4)
        print(
            f"privacy: ({shown}, {summary['delta']:g})-DP at the "
            f"{summary['privacy_unit']} level, {summary.get('privacy', {}).get('adjacency', '')} "
            f"adjacency, {summary['accountant']} accountant, noise placement "
            f"{summary['noise_placement']}; ledger: {run_dir / 'ledger.sqlite'}"
        )
        if summary["privacy_unit"] == "identity":
            from fl_secure.app.report.units import RECORD_IN_FULL

            print(f"  protected record: {RECORD_IN_FULL['identity']}")
        _print_sites(run_dir, summary)
        n, what = _delta_population(summary)
        if n and summary["delta"] >= 1.0 / n:
            print(
                f"  warning: delta = {summary['delta']:g} is not below 1/N for N = {n} {what}: "
                "the guarantee allows one of them to be released outright"
            )
    else:
        print("privacy: none (no differential privacy in this run)")
    print(f"run directory: {run_dir}")
    return 0


def _delta_population(summary: dict[str, Any]) -> tuple[int | None, str]:
    """N of the delta < 1/N rule: clients, or the smallest client's images (example level).

    At the identity level the records are each site's identities, whose number the server
    does not learn: no N (each client checks its own).
    """
    if summary.get("privacy_unit") == "identity":
        return None, "identities (each site checks its own)"
    if summary.get("privacy_unit") == "example":
        from fl_secure.app.report.build import example_population

        return example_population(summary), "training images (smallest client)"
    return summary.get("num_clients"), "clients"


def _print_sites(run_dir: Path, summary: dict[str, Any]) -> None:
    """The sites' own epsilon against the server (embedded runs keep their site ledgers)."""
    from fl_secure.app.report.build import site_figures

    if summary.get("privacy_unit") != "client":
        return
    figures = [  # a damaged ledger is named by the report
        s for s in site_figures(run_dir, summary)["sites"] if s["problem"] is None and s["releases"]
    ]
    if figures:
        up = up_to_places  # rounded up: a bound; an infinite one reads unbounded

        def worst(key: str) -> float:  # the report lists an infinite figure as unbounded
            return max(math.inf if key in s["unbounded"] else float(s[key]) for s in figures)

        print(
            f"  each site against the server (its own ledger, no sampling amplification): "
            f"epsilon <= {up(worst('epsilon'))}; {up(worst('epsilon_colluding_peers'))} if "
            f"the other sites collude; one training image: epsilon <= "
            f"{up(worst('example_epsilon'))}, {up(worst('example_epsilon_colluding_peers'))} "
            f"(fl-secure privacy site --state-dir {run_dir / 'clients' / '<id>'})"
        )
