"""``privacy`` sub-commands: ``epsilon``, ``calibrate``, ``ledger`` and ``site``.

Each leaf sets ``func`` to a function ``(argparse.Namespace) -> int`` (exit code). With
``--json`` one JSON object goes to stdout with keys ``epsilon``, ``delta``,
``noise_multiplier``, ``accountant``, ``sample_rate``, ``steps``, ``sampling``,
``adjacency`` (plus ``population`` / ``target_epsilon`` where relevant).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from fl_secure.app.cli.common import Subparsers, number_arg, positive_int
from fl_secure.errors import CheckpointError, PrivacyError
from fl_secure.runs import RunDir
from privacy.dp.rounding import round_up
from privacy.ledger.anchors import run_anchors
from privacy.ledger.entries import LedgerError
from privacy.ledger.formatting import format_ledger, ledger_json
from privacy.ledger.guarantee import released_model_of_run
from privacy.ledger.run_ledger import Ledger
from privacy.ledger.signed_head import read_public_key
from privacy.ledger.verification import recorded_head

# Imports that load torch, grpc or tenseal are inside the functions: `fl-secure --help` stays
# fast (fl_secure.app.cli.common says why). The accountants are among them (opacus, torch):
# the parser's choices are kept here, and a test ties them to the registry's.

#: privacy.dp.accountants.registry.ACCOUNTANTS, sorted as the parser lists them.
ACCOUNTANT_NAMES = ("pld", "prv", "rdp")
#: privacy.dp.accountants.registry.DEFAULT_CLIENT_LEVEL: calibrate's default accountant.
DEFAULT_CLIENT_LEVEL = "pld"
#: privacy.dp.accountants.accountant.SAMPLINGS.
SAMPLINGS = ("poisson", "fixed_size")


def _common(p: argparse.ArgumentParser, default_accountant: str | None) -> None:
    p.add_argument(
        "--sample-rate",
        required=True,
        type=number_arg("--sample-rate", lambda q: 0 < q <= 1, "in (0, 1]"),
        help="sampling rate q per step (Poisson rate, or cohort / population for fixed_size)",
    )
    p.add_argument("--steps", required=True, type=positive_int("--steps"), help="number of steps T")
    p.add_argument(
        "--delta",
        required=True,
        type=number_arg("--delta", lambda d: 0 < d < 1, "in (0, 1)"),
        help="target delta",
    )
    p.add_argument(
        "--accountant",
        choices=ACCOUNTANT_NAMES,
        required=default_accountant is None,
        default=default_accountant,
        help="rdp (loose), prv (what training uses for example- and identity-level DP), pld "
        "(for client-level)"
        + ("; required here" if default_accountant is None else f"; default: {default_accountant}"),
    )
    p.add_argument(
        "--sampling",
        choices=SAMPLINGS,
        default="poisson",
        help="poisson (add/remove adjacency) or fixed_size cohorts (replace-one; pld only)",
    )
    p.add_argument(
        "--population",
        type=positive_int("--population"),
        default=None,
        help="records sampled from; required with --sampling fixed_size",
    )
    p.add_argument(
        "--noise",
        choices=("gaussian", "discrete_gaussian"),
        default="gaussian",
        help="gaussian (central noise, DP-SGD) or discrete_gaussian (client-level local and "
        "distributed noise: integers, accounted by their zCDP bound without amplification)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def add_parser(sub: Subparsers) -> None:
    """Add ``privacy`` and its sub-commands ``epsilon``, ``calibrate``, ``ledger``, ``site``."""
    p = sub.add_parser(
        "privacy", help="privacy accounting: epsilon of a schedule, noise for a budget"
    )
    sub = p.add_subparsers(dest="privacy_command", required=True)

    e = sub.add_parser("epsilon", help="epsilon spent by a noise multiplier and schedule")
    e.add_argument(
        "--noise-multiplier",
        required=True,
        type=number_arg("--noise-multiplier", lambda z: z > 0, "> 0"),
        help="noise standard deviation / clipping norm",
    )
    _common(e, default_accountant=None)
    e.set_defaults(func=cmd_epsilon)

    c = sub.add_parser("calibrate", help="smallest noise multiplier meeting a target epsilon")
    c.add_argument(
        "--target-epsilon",
        required=True,
        type=number_arg("--target-epsilon", lambda x: x > 0, "> 0"),
        help="privacy budget to meet",
    )
    _common(c, default_accountant=DEFAULT_CLIENT_LEVEL)
    c.set_defaults(func=cmd_calibrate)

    g = sub.add_parser("ledger", help="print a run's privacy ledger; --verify checks its chain")
    g.add_argument("--run", type=Path, required=True, help="run directory (has ledger.sqlite)")
    g.add_argument(
        "--verify",
        action="store_true",
        help="check the hash chain, recompute every row's epsilon from its parameters, check "
        "the server's signed head (ledger.head.json) and its copies in checkpoints/latest.json "
        "and summary.json (catches a dropped tail or a rewritten chain), and the latest "
        "parameters file against the SHA-256 its round's rows name; exit 1 on any problem",
    )
    g.add_argument(
        "--ledger-key",
        type=Path,
        help="the server's ledger public key (ledger_signing.pub, or the server's certificate "
        "folder holding it): the signed head must be signed by it. Without it the key the "
        "run folder names is used, which a forger of the whole folder could replace",
    )
    g.add_argument(
        "--site",
        type=Path,
        action="append",
        default=[],
        metavar="STATE_DIR",
        help="a site's --state-dir (repeatable): the newest signed head the server sent that "
        "site must be part of the ledger (a copy outside the run folder)",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.set_defaults(func=cmd_ledger)

    t = sub.add_parser(
        "site",
        help="a site's own ledger: its releases and its epsilon against the server",
        description="Read the site ledger a client keeps in its --state-dir (one row per "
        "update that left the site) and print the site's client-level epsilon against the "
        "server: exact composition of Gaussian releases, no amplification by the server's "
        "sampling; with honest peers, and if every other site colludes with the server. "
        "Then its example-level epsilon (one training image) over the same releases, with "
        "the site's own DP-SGD sampling.",
    )
    t.add_argument("--state-dir", type=Path, required=True, help="the client's --state-dir")
    t.add_argument(
        "--delta",
        type=number_arg("--delta", lambda d: 0 < d < 1, "in (0, 1)"),
        default=1e-5,
        help="delta of the figures (default: 1e-5)",
    )
    t.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    t.set_defaults(func=cmd_site)


def cmd_site(args: argparse.Namespace) -> int:
    """``privacy site``: the site ledger's summary."""
    from privacy.ledger.site_ledger import FILE_NAME, SiteLedger

    if not (args.state_dir / FILE_NAME).is_file():
        sys.stderr.write(f"error: {args.state_dir / FILE_NAME} does not exist\n")
        return 2
    try:
        summary = SiteLedger(args.state_dir, delta=args.delta).summary()
    except PrivacyError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(summary, sort_keys=True) + "\n")
        return 0

    runs = ", ".join(f"{run} ({n})" for run, n in summary["releases_by_run"].items())
    sys.stdout.write(
        f"{summary['releases']} updates released: {runs or 'none'}\n"
        f"epsilon against the server = {round_up(summary['epsilon'], 5)} at delta = "
        f"{summary['delta']:g} (peers honest)\n"
        f"  if every other site colludes: {round_up(summary['epsilon_colluding_peers'], 5)}\n"
        f"  {summary['accounting']}; adjacency {summary['adjacency']}\n"
        f"example-level epsilon (one training image) = "
        f"{round_up(summary['example_epsilon'], 5)} (peers honest), "
        f"{round_up(summary['example_epsilon_colluding_peers'], 5)} if they collude; "
        f"{summary['dpsgd_steps']} DP-SGD steps\n"
        f"  {summary['example_accounting']}\n"
    )
    if summary["releases_without_client_level_noise"]:
        sys.stdout.write(
            f"  {summary['releases_without_client_level_noise']} release(s) carried no "
            "client-level noise against the server (no DP, example level or central noise)\n"
        )
    return 0


def cmd_ledger(args: argparse.Namespace) -> int:
    """``privacy ledger``: the entries of a run's ledger and, with --verify, the chain check."""
    path = args.run / "ledger.sqlite"
    record, record_note = _recorded(args.run) if args.verify else (None, None)
    try:
        pinned = read_public_key(args.ledger_key) if args.ledger_key is not None else None
        anchors = None
        with Ledger.read(path) as ledger:
            if args.verify:
                where = {"sites": args.site, "run_id": ledger.run_id}
                anchors = run_anchors(args.run, path, pinned, **where)
            entries = ledger.entries()
            result = (
                ledger.verify(recorded=record, anchors=anchors, recompute=True)
                if args.verify
                else None
            )
            run_id = ledger.run_id
    except LedgerError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    notes = [record_note] if record_note is not None else []
    if result is not None and result.unsigned_after:
        signed = result.entries - result.unsigned_after
        notes.append(
            f"entries {signed + 1}..{result.entries} follow the signed head (the server "
            "stopped before signing them, or they were added): resume the run to have them "
            "checked and signed"
        )
    if result is not None and notes:
        result = dataclasses.replace(result, ok=False, problems=[*result.problems, *notes])
    model = released_model_of_run(args.run, entries) if result is not None else None
    if result is not None and model is not None and model["problem"]:
        problems = [*result.problems, model["problem"]]
        result = dataclasses.replace(result, ok=False, problems=problems)
    if args.json:
        out = ledger_json(entries, result, run_id=run_id)
        if result is not None:
            out["verify"] = {
                "ok": result.ok,
                "problems": list(result.problems),
                "checked_against_summary": None
                if record is None
                else {"entries": record[0], "head": record[1]},
                "entries_after_summary": result.after_record,
                "signed_head": None
                if anchors is None or anchors.head is None
                else {
                    "entries": anchors.head.entries,
                    "public_key": anchors.head.public_key,
                    "key_pinned": pinned is not None,
                    "copies_checked": list(anchors.copies),
                },
                "released_model": model,
            }
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        print(format_ledger(entries))
        if result is not None:
            print("chain verified: OK" if result.ok else "chain BROKEN:")
            for problem in result.problems:
                print(f"  {problem}")
            if anchors is not None and anchors.head is not None:
                how = "the pinned key" if pinned else "the key it names (pin with --ledger-key)"
                copies = ", ".join(sorted(anchors.copies)) or "no copy found"
                print(
                    f"signed head: {anchors.head.entries} entries, key "
                    f"{anchors.head.public_key[:16]}, checked against {how}; copies: {copies}"
                )
            if record is not None:
                print(
                    f"checked against summary.json: {record[0]} entries, head {record[1][:12]}"
                    + (
                        f" ({result.after_record} appended since: a resumed run still going?)"
                        if result.after_record
                        else ""
                    )
                )
            elif record_note is None and not result.signed:
                print(
                    "note: no summary.json with the ledger's head (the run has not ended): "
                    "entries dropped from the end cannot be detected"
                )
            if model is not None and model["checkpoint"] is not None and model["sha256"]:
                print(f"released model: {model['checkpoint']}, SHA-256 {model['sha256']}")
                if model["matches_ledger"]:
                    print(f"  the file the ledger's rows of round {model['round']} name")
                elif model["matches_ledger"] is None and not model["problem"]:
                    print("  the ledger names no model (written before ledgers recorded it)")
    return 0 if result is None or result.ok else 1


def _recorded(run: Path) -> tuple[tuple[int, str] | None, str | None]:
    """The ``(entries, head)`` summary.json recorded, or a problem if it cannot be read."""
    if not RunDir(run).summary.exists():
        return None, None
    try:
        summary = RunDir(run).read_summary()
    except (OSError, CheckpointError) as exc:
        return None, f"summary.json: unreadable ({exc}); the ledger's head cannot be checked"
    return recorded_head(summary), None


def _check_population(args: argparse.Namespace) -> None:
    if args.sampling == "fixed_size" and args.population is None:
        raise PrivacyError("--population is required with --sampling fixed_size")
    if args.sampling == "poisson" and args.population is not None:
        raise PrivacyError("--population is only meaningful with --sampling fixed_size")


def _report(args: argparse.Namespace, noise_multiplier: float, epsilon: float) -> dict[str, Any]:
    from privacy.dp.accountants.accountant import ADJACENCY

    return {
        "epsilon": epsilon,
        "delta": args.delta,
        "noise_multiplier": noise_multiplier,
        "accountant": args.accountant,
        "sample_rate": args.sample_rate,
        "steps": args.steps,
        "sampling": args.sampling,
        "adjacency": ADJACENCY[args.sampling],
        "population": args.population,
        "noise": args.noise,
    }


def _emit(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if args.json:
        sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
        return

    population = f", population {report['population']}" if report["population"] else ""
    target = f" (target {report['target_epsilon']:g})" if "target_epsilon" in report else ""
    # rounded up: epsilon is an upper bound, and a calibrated z rounded up only lowers it
    z = report["noise_multiplier"]
    z_text = round_up(z, 5) if "target_epsilon" in report else f"{z:g}"
    sys.stdout.write(
        f"epsilon = {round_up(report['epsilon'], 5)}{target} at delta = {report['delta']:g}\n"
        f"  noise multiplier {z_text}, sample rate "
        f"{report['sample_rate']:g}, {report['steps']} steps, {report['sampling']} sampling"
        f"{population}\n"
        f"  accountant {report['accountant']}, {report['adjacency']} adjacency"
        + (", discrete Gaussian (zCDP bound)" if report["noise"] == "discrete_gaussian" else "")
        + "\n"
    )


def _epsilon(args: argparse.Namespace, noise_multiplier: float) -> float:
    from privacy.dp.calibration import epsilon_for

    return epsilon_for(
        accountant=args.accountant,
        noise_multiplier=noise_multiplier,
        sample_rate=args.sample_rate,
        steps=args.steps,
        delta=args.delta,
        sampling=args.sampling,
        population=args.population,
        noise=args.noise,
    )


def cmd_epsilon(args: argparse.Namespace) -> int:
    """``privacy epsilon``: print the epsilon of a schedule."""
    try:
        _check_population(args)
        eps = _epsilon(args, args.noise_multiplier)
    except PrivacyError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    _emit(args, _report(args, args.noise_multiplier, eps))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``privacy calibrate``: print the smallest noise multiplier meeting the target."""
    from privacy.dp.calibration import calibrate_noise

    try:
        _check_population(args)
        z = calibrate_noise(
            target_epsilon=args.target_epsilon,
            sample_rate=args.sample_rate,
            steps=args.steps,
            delta=args.delta,
            accountant=args.accountant,
            sampling=args.sampling,
            population=args.population,
            noise=args.noise,
        )
        eps = _epsilon(args, z)
    except PrivacyError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    report = _report(args, z, eps)
    report["target_epsilon"] = args.target_epsilon
    _emit(args, report)
    return 0
