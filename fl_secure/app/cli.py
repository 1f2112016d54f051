"""Command line of fl-secure: ``fl-secure {train,server,client,certs,eval} ...``.

It sits in the application layer (:mod:`fl_secure.app`), above ``server``, ``client`` and
``audits``; it imports them inside the sub-command functions so that ``--help`` stays fast
(torch, grpc and tenseal take seconds to import).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fl_secure import __version__
from fl_secure.errors import CheckpointError, FlSecureError

if TYPE_CHECKING:  # imported lazily at run time: `fl-secure --help` stays fast
    from fl_secure.config import Config
    from fl_secure.runs import RunDir

log = logging.getLogger("fl_secure")

HEADLINE = ("tar_at_far_1e-1", "tar_at_far_1e-2", "tar_at_far_1e-3", "rank1")


def _setup_logging(verbose: int, quiet: bool, default: int = logging.INFO) -> None:
    level = logging.WARNING if quiet else default if verbose == 0 else logging.DEBUG
    level = logging.INFO if verbose == 1 and default > logging.INFO else level
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=log_format, stream=sys.stderr)
    # opacus.utils.module_utils calls basicConfig when imported, which made ours a no-op and
    # left the root at WARNING: set the level and format on the handler it installed instead
    # of replacing it (force=True would rebind the root to whatever sys.stderr is now)
    root = logging.getLogger()
    root.setLevel(level)
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(log_format))


def _torch_threads(n: int) -> None:
    """Pin torch's intra-op threads (default 1).

    On a shared or small machine, OpenMP threads that outnumber the free cores make each
    step many times slower (measured: 45x on 2 busy cores).
    """
    import torch

    torch.set_num_threads(max(1, n))


#: Run outcomes that exit with 0: every round ran, or the privacy budget stopped it as asked.
_SUCCESS = ("completed", "budget_exhausted")


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")


def _check_resume(args: argparse.Namespace) -> None:
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
    from fl_secure.runs import RunDir

    run = RunDir(args.resume)
    if run.summary.exists():
        try:
            status = run.read_summary().get("status")
        except CheckpointError:  # damaged: not a record of a run that ended
            status = None
        if status in _SUCCESS:
            raise FlSecureError(
                f"{args.resume} already ended ({status!r} in summary.json): there is nothing "
                "to resume, and resuming would overwrite its summary; start a new run"
            )


def cmd_train(args: argparse.Namespace) -> int:
    """Embedded mode: server and N client processes on localhost over gRPC + mTLS."""
    from fl_secure.config import Config, load_config
    from server.embedded import run_embedded

    config: Config | None = None
    _check_resume(args)
    if args.resume is None:
        if args.config is None:
            raise FlSecureError("train needs --config FILE (or --resume RUN_DIR)")
        config = load_config(args.config, args.set)
    if args.audit:  # refuse before training, not after it (a resumed run: its own config)
        from audits.observations import check_auditable
        from fl_secure.runs import RunDir

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
    _torch_threads(config.train.threads if config is not None else 1)
    if args.centralized:
        from fl_secure.app.centralized import run_centralized

        if config is None:
            raise FlSecureError("--centralized needs --config FILE")
        summary = run_centralized(config, out=args.out, progress=not args.json)
        return _report(summary, Path(summary["run_dir"]), args.json)
    result = run_embedded(
        config if config is not None else Config(),
        out=args.out,
        resume=args.resume,
        insecure=args.insecure,
        progress=not args.json,
    )
    code = 0 if args.json else _report(result.summary, result.run_dir, False)
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
        _print_json({**result.summary, "run_dir": str(result.run_dir), **done})
    return code if result.summary.get("status") in _SUCCESS else 1


def _report(summary: dict[str, Any], run_dir: Path, as_json: bool) -> int:
    if as_json:
        _print_json({**summary, "run_dir": str(run_dir)})
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
                f"(mean ± std across clients, own test images){extra}"
            )
    if summary.get("privacy_unit") not in (None, "none"):
        eps = summary["epsilon"]
        shown = "none accounted" if eps is None else f"{math.ceil(eps * 1e4 - 1e-9) / 1e4:.4f}"
        print(
            f"privacy: ({shown}, {summary['delta']:g})-DP at the "
            f"{summary['privacy_unit']} level, {summary.get('privacy', {}).get('adjacency', '')} "
            f"adjacency, {summary['accountant']} accountant, noise placement "
            f"{summary['noise_placement']}; ledger: {run_dir / 'ledger.sqlite'}"
        )
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
    """N of the delta < 1/N rule: clients, or the smallest client's images (example level)."""
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

        def up(x: float) -> str:  # rounded up: a bound
            return f"{math.ceil(x * 1e4 - 1e-9) / 1e4:.4f}" if math.isfinite(x) else "unbounded"

        def worst(key: str) -> float:  # the report lists an infinite figure as unbounded
            return max(math.inf if key in s["unbounded"] else float(s[key]) for s in figures)

        print(
            f"  each site against the server (its own ledger, no sampling amplification): "
            f"epsilon <= {up(worst('epsilon'))}; {up(worst('epsilon_colluding_peers'))} if "
            f"the other sites collude; one training image: epsilon <= "
            f"{up(worst('example_epsilon'))}, {up(worst('example_epsilon_colluding_peers'))} "
            f"(fl-secure privacy site --state-dir {run_dir / 'clients' / '<id>'})"
        )


def cmd_server(args: argparse.Namespace) -> int:
    """Standalone server: clients on other machines connect to it."""
    from fl_secure.config import load_config
    from fl_secure.runs import RunDir, new_run_dir
    from server.app import check_address, load_enrollment
    from server.preflight import preflight

    _check_resume(args)
    if not args.insecure and args.certs is None:
        raise FlSecureError("server needs --certs DIR (made by `fl-secure certs init`)")
    run: RunDir | None = None
    if args.resume is not None:
        run = RunDir(args.resume)
        config = load_config(run.config)
    else:
        if args.config is None:
            raise FlSecureError("server needs --config FILE (or --resume RUN_DIR)")
        config = load_config(args.config, args.set)
    if args.insecure:
        enrolled = {f"client-{i}" for i in range(config.partition.num_clients)}
    else:
        enrolled = set(load_enrollment(args.certs).fingerprints)
        if (Path(args.certs) / "ca.key").exists():
            log.warning(
                "%s holds the CA key: a server (or whoever breaks into it) holding it can mint "
                "client identities; keep ca.key offline (certs issue --ca-key PATH reads it "
                "from there)",
                args.certs,
            )
    check_address(args.address or config.server.address)
    if args.port_file is not None and not Path(args.port_file).parent.is_dir():
        raise FlSecureError(f"--port-file {args.port_file}: its folder does not exist")
    created = None
    if run is None:  # the checks that need no run directory come first, as in train
        preflight(config, len(enrolled))
        run = RunDir(created := new_run_dir(args.out, config.run.name))
    with run.held():
        return _serve(args, config, run, created, enrolled)


def _serve(
    args: argparse.Namespace,
    config: Config,
    run: RunDir,
    created: Path | None,
    enrolled: set[str],
) -> int:
    """:func:`cmd_server` once this process holds the run directory."""
    from fl_secure.runs import removed_if_setup_fails
    from server.app import start_server
    from server.bootstrap import build_server
    from server.run_files import record_start, write_config
    from server.summary import build_summary

    _torch_threads(config.train.threads)
    with removed_if_setup_fails(created):
        if created is not None:
            write_config(run, config)
        side = build_server(
            config,
            run,
            enrolled=enrolled,
            evaluate=not args.no_eval,
            cert_dir=None if args.insecure else args.certs,
        )
        side.coordinator.resume()
        record_start(run)
        address = args.address or config.server.address
        server, port = start_server(
            side.coordinator, address, cert_dir=args.certs, insecure=args.insecure
        )
    print(f"listening on port {port}; run directory {run.path}", file=sys.stderr, flush=True)
    started = time.time()
    try:
        if args.port_file:
            Path(args.port_file).write_text(str(port))
        side.coordinator.run()
        side.coordinator.wait_clients_finished(timeout=10.0)
    finally:
        server.stop(grace=2.0)
    summary = build_summary(
        config, side.coordinator, side.strategy, side.plan, started=started,
        clients_hold_the_plan=False,
    )  # fmt: skip
    summary["transport"] = "plaintext gRPC (--insecure)" if args.insecure else "gRPC + mutual TLS"
    run.write_summary(summary)
    code = _report(summary, run.path, args.json)
    return code if summary["status"] in _SUCCESS else 1


def cmd_client(args: argparse.Namespace) -> int:
    """A client: connects out to the server, trains on its own data."""
    from client.app import Connection, FlClient
    from client.setup import ClientDataSource, trainer_factory
    from fl_secure.config import load_config

    if args.config is not None and args.plan_index is None:
        raise FlSecureError("--config needs --plan-index N (which share of the plan is mine)")
    from privacy.site_ledger import SiteLedger

    # the site ledger first: a budget without a folder to keep it in is refused at once
    site = SiteLedger(
        args.state_dir,
        max_epsilon=args.max_epsilon,
        delta=args.delta,
        colluding_peers=args.assume_colluding_peers,
        max_example_epsilon=args.max_example_epsilon,
        exclusive=True,
    )
    if site.releases:
        logging.getLogger("client.app").info(
            "site ledger %s: %d releases so far, epsilon against the server %.4g (delta %g)",
            site.path,
            len(site.releases),
            site.epsilon(),
            site.delta,
        )
    if args.data is not None:
        # a mistyped or empty --data is named now, not after the server has taken the
        # client into a round (the images are decoded after joining, at the run's size)
        from fl_secure.data.folders import list_identity_folders

        found = list_identity_folders(args.data, check_headers=True)
        logging.getLogger("client.app").info(
            "%s: %d identities, %d images",
            args.data,
            len(found),
            sum(len(files) for _, files in found),
        )
    source = ClientDataSource(
        local_config=load_config(args.config) if args.config else None,
        plan_index=args.plan_index if args.plan_index is not None else -1,
        data_path=args.data,
    )
    conn = Connection(
        address=args.server,
        client_id=args.id,
        cert_dir=args.certs,
        insecure=args.insecure,
        server_name=args.server_name or "",
    )
    make = trainer_factory(
        source,
        state_dir=args.state_dir,
        threads=args.threads,
        accept_seeded_noise=args.accept_seeded_noise,
    )
    client = FlClient(conn, make, site=site)
    import grpc

    from client.app import explain_rpc_error

    try:
        message = client.run()
    except grpc.RpcError as exc:
        raise FlSecureError(explain_rpc_error(exc, args.server)) from exc
    if args.json:
        _print_json({"client_id": args.id, "rounds": client.rounds_done, "message": message})
    else:
        print(f"{args.id}: {client.rounds_done} rounds; {message}")
    return 0


def cmd_certs_init(args: argparse.Namespace) -> int:
    """Make a CA, a server certificate and client certificates."""
    from fl_secure.tls import init_certificates

    hosts = args.hosts or ["localhost", "127.0.0.1", "::1"]
    cert_set = init_certificates(
        args.out, clients=args.clients, hosts=hosts, days=args.days, overwrite=args.overwrite
    )
    result = {"out": str(args.out), "clients": list(cert_set.client_ids), "hosts": hosts}
    if args.json:
        _print_json(result)
    else:
        print(f"wrote CA, server and {len(cert_set.client_ids)} client certificates to {args.out}")
        print(
            "keep ca.key offline; give each site ca.pem, clients/<id>.pem, clients/<id>.key, "
            "clients/<id>.sign.key (secure aggregation's signing key), signing_keys.json and "
            "signing_keys.sig"
        )
    return 0


def cmd_certs_issue(args: argparse.Namespace) -> int:
    """Issue client certificates from an existing CA and enroll them."""
    from fl_secure.tls import issue_client_certificate

    for client_id in args.ids:
        issue_client_certificate(
            args.out, client_id, days=args.days, ca_key=args.ca_key, overwrite=args.overwrite
        )
    if args.json:
        _print_json({"out": str(args.out), "issued": list(args.ids)})
    else:
        print(f"issued and enrolled {', '.join(args.ids)} in {args.out}")
        print(
            "give each new site ca.pem, clients/<id>.pem, clients/<id>.key, "
            "clients/<id>.sign.key, signing_keys.json and signing_keys.sig; every other site "
            "needs the re-signed signing_keys.json and signing_keys.sig too; a server reads "
            "enrolled.json when it starts"
        )
    return 0


def cmd_certs_ckks(args: argparse.Namespace) -> int:
    """Make the clients' shared CKKS key and the server's key-less context."""
    from privacy.ckks import CkksParams
    from privacy.ckks_session import write_ckks_keys

    params = CkksParams(poly_modulus_degree=args.poly_modulus_degree)
    secret, public = write_ckks_keys(args.out, params, overwrite=args.overwrite)
    result = {"out": str(args.out), "secret_context": str(secret), "public_context": str(public)}
    if args.json:
        _print_json(result)
    else:
        print(f"wrote {secret} (clients only, 0600) and {public} (server)")
        print("give every client the same clients.secret over your own channel, never via the "
              "server; one client colluding with the server can decrypt every update")  # fmt: skip
    return 0


def cmd_experiment(args: argparse.Namespace) -> int:
    """Simulate an experiment grid; print where its tables went."""
    from fl_secure.app.experiment import load_experiment, run_experiment

    experiment = load_experiment(args.config)
    _torch_threads(1)
    out = args.out or Path("runs") / "experiments" / experiment.name
    rows = run_experiment(experiment, out, progress=not args.json, overwrite=args.overwrite)
    aborted = sum(r["status"] == "aborted" for r in rows)
    if args.json:
        _print_json({"out": str(out), "rows": rows})
    else:
        print((out / "results.md").read_text(encoding="utf-8"))
        print(f"results: {out / 'results.csv'}, {out / 'results.md'}")
        if aborted:
            print(f"{aborted} of {len(rows)} runs aborted (status and reason in results.csv)")
    return 1 if aborted else 0


def cmd_report(args: argparse.Namespace) -> int:
    """Write a run's compliance report; print where it went."""
    from fl_secure.app.report import write_report

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    written = write_report(args.run, formats, include_images=args.include_images, out=args.out)
    if args.json:
        _print_json({k: str(v) for k, v in written.items()})
    else:
        for kind, path in written.items():
            print(f"{kind}: {path}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a checkpoint of a run on the run's held-out identities or an LFW pairs file."""
    from fl_secure.app.evaluate import evaluate_run

    result = evaluate_run(
        args.run,
        round_=args.round,
        lfw_pairs=args.lfw_pairs,
        lfw_root=args.lfw_root,
        center_crop=args.center_crop,
    )
    if args.json:
        _print_json(result)
    else:
        for key, value in result.items():
            if value is None:  # null: a crop that is none; an overlap the server cannot count
                value = "none" if key == "center_crop" else "unknown"
            print(f"{key:>20}: {value}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """Attack a run's views (inversion, templates, leakage, canary); write RUN/audit/."""
    from audits.run_audit import AuditSettings, audit_run, summary_lines

    _torch_threads(1)
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
        _print_json(results)
        return 0
    for line in summary_lines(results):
        print(line)
    print(f"results: {Path(results['run']) / 'audit' / 'results.json'}")
    return 0


def _certificate_days(text: str) -> int:
    """An argparse ``type`` for ``--days``: an integer from 1 to the longest validity."""
    from fl_secure.tls.certs import MAX_DAYS

    try:
        days = int(text)
    except ValueError:
        days = 0
    if not 1 <= days <= MAX_DAYS:
        raise argparse.ArgumentTypeError(
            f"--days must be an integer from 1 to {MAX_DAYS} (100 years), got {text!r}"
        )
    return days


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    from fl_secure.app.privacy_cli import number_arg, positive_int

    parser = argparse.ArgumentParser(
        prog="fl-secure",
        description="Privacy-focused, secure federated training of face-recognition models.",
    )
    parser.add_argument("--version", action="version", version=f"fl-secure {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0,
        help="more logging, and the traceback of an error; before the command: fl-secure -v "
        "train ...",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        p.add_argument("--quiet", action="store_true", help="log warnings only")

    def run_args(p: argparse.ArgumentParser) -> None:  # train and server start or resume runs
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

    p = sub.add_parser("train", help="train in embedded mode (server + N client processes)")
    run_args(p)
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
    common(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("server", help="run the server for clients on other machines")
    run_args(p)
    p.add_argument("--certs", type=Path, help="folder made by `fl-secure certs init`")
    p.add_argument("--address", help="host:port to listen on (default: server.address)")
    p.add_argument("--port-file", help="write the bound port here (useful with port 0)")
    p.add_argument("--no-eval", action="store_true", help="skip held-out evaluation")
    p.add_argument(
        "--insecure", action="store_true", help="plaintext gRPC (loopback tests only; warns)"
    )
    common(p)
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("client", help="run one client; it connects out to the server")
    p.add_argument("--server", required=True, help="host:port of the server")
    p.add_argument("--id", required=True, help="client id = CN of this client's certificate")
    p.add_argument("--certs", type=Path, help="folder with ca.pem and clients/<id>.pem/.key")
    p.add_argument("--data", type=Path, help="identity folders of this client's own faces")
    p.add_argument(
        "--config",
        type=Path,
        help="internal (started by `fl-secure train`): the run config, to take this client's "
        "share of the synthetic plan instead of --data",
    )
    p.add_argument(
        "--plan-index", type=int, help="internal: with --config, which share of the plan is mine"
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        help="where private parameters and the site ledger (this site's releases and epsilon) "
        "are kept",
    )
    p.add_argument(
        "--threads", type=positive_int("--threads"), help="torch threads (default: train.threads)"
    )
    p.add_argument("--server-name", help="TLS name of the server when it differs from --server")
    p.add_argument(
        "--insecure", action="store_true", help="plaintext gRPC (loopback tests only; warns)"
    )
    p.add_argument(
        "--accept-seeded-noise",
        action="store_true",
        help="join a run with privacy.secure_rng = false, whose DP noise the server could "
        "reproduce and subtract (reproducible tests on your own machine only)",
    )
    p.add_argument(
        "--max-epsilon",
        type=number_arg("--max-epsilon", lambda e: e > 0, "> 0"),
        help="this site's own client-level budget against the server (needs --state-dir, "
        "where the site ledger is kept): an update that would bring it above this is not sent, "
        "and a run that cannot keep it (no DP, central noise, example level) is not joined",
    )
    p.add_argument(
        "--max-example-epsilon",
        type=number_arg("--max-example-epsilon", lambda e: e > 0, "> 0"),
        help="this site's own budget for one of its training images, over every update it "
        "releases (needs --state-dir): example-level DP-SGD runs with the site's own sampling, "
        "client-level releases as Gaussians; a round whose planned DP-SGD steps would pass it "
        "is declined before training, and a run without noise against the server is not joined",
    )
    p.add_argument(
        "--delta",
        type=number_arg("--delta", lambda d: 0 < d < 1, "in (0, 1)"),
        default=1e-5,
        help="delta of the site's epsilon (default: 1e-5); the site's choice, not the server's",
    )
    p.add_argument(
        "--assume-colluding-peers",
        action="store_true",
        help="hold --max-epsilon against this site's own noise share alone (the server and "
        "every other site collude), not the noise of the sum",
    )
    common(p)
    p.set_defaults(func=cmd_client)

    p = sub.add_parser("certs", help="certificates for mutual TLS")
    certs_sub = p.add_subparsers(dest="certs_command", required=True)
    q = certs_sub.add_parser("init", help="make a CA, a server and N client certificates")
    q.add_argument("--out", type=Path, required=True, help="folder for the CA and certificates")
    q.add_argument("--clients", type=int, required=True, help="client certificates to make")
    q.add_argument("--hosts", nargs="*", help="server DNS names / IPs (default: localhost)")
    q.add_argument(
        "--days", type=_certificate_days, default=365, help="certificate validity (default: 365)"
    )
    q.add_argument("--overwrite", action="store_true", help="replace an existing CA")
    common(q)
    q.set_defaults(func=cmd_certs_init)
    q = certs_sub.add_parser(
        "issue",
        help="add a site (or re-issue one) to an existing CA and enrollment list",
        description="Issue a client certificate and signing key for each ID, enroll it in "
        "enrolled.json and re-sign signing_keys.json (only if it verifies against ca.pem: an "
        "altered list is refused, never re-signed). With --overwrite an existing site's "
        "certificate is replaced and, by fingerprint pinning, the old one is refused from "
        "then on (revocation). A server reads enrolled.json when it starts, so a change "
        "applies to the runs started after it.",
    )
    q.add_argument("--out", type=Path, required=True, help="the folder `certs init` wrote")
    q.add_argument("--id", nargs="+", required=True, dest="ids", help="client id(s) to issue")
    q.add_argument(
        "--days", type=_certificate_days, default=365, help="certificate validity (default: 365)"
    )
    q.add_argument("--ca-key", type=Path, help="the CA key when kept outside --out (offline)")
    q.add_argument(
        "--overwrite", action="store_true", help="re-issue an existing id (revokes the old one)"
    )
    common(q)
    q.set_defaults(func=cmd_certs_issue)
    q = certs_sub.add_parser(
        "ckks",
        help="make the CKKS contexts for secure_aggregation.scheme = 'ckks'",
        description="Write CERTS/ckks/clients.secret (the secret key all clients share) and "
        "CERTS/ckks/server.public (parameters only: the server adds ciphertexts, cannot decrypt).",
    )
    q.add_argument("--out", type=Path, required=True, help="the certificate folder")
    q.add_argument(
        "--poly-modulus-degree", type=int, default=8192,
        help="CKKS ring dimension; a ciphertext holds half as many values (default: 8192)",
    )  # fmt: skip
    q.add_argument("--overwrite", action="store_true", help="replace existing contexts")
    common(q)
    q.set_defaults(func=cmd_certs_ckks)

    from fl_secure.app.privacy_cli import add_privacy_parser  # privacy epsilon | calibrate | ledger

    add_privacy_parser(sub)

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
    common(p)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("eval", help="evaluate a run's model on held-out identities or LFW pairs")
    p.add_argument("--run", type=Path, required=True, help="run directory")
    p.add_argument("--round", type=int, help="checkpoint round (default: latest)")
    p.add_argument("--lfw-pairs", type=Path, help="pairs file (pairs.txt or pairsDevTest.txt)")
    p.add_argument("--lfw-root", type=Path, help="LFW image root for --lfw-pairs")
    p.add_argument(
        "--center-crop",
        type=int,
        help="centre crop of the LFW images before resizing (default: the run's "
        "data.center_crop, the crop it trained on; 0: none)",
    )
    common(p)
    p.set_defaults(func=cmd_eval)

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
    common(p)
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser(
        "experiment",
        help="simulate a grid of algorithm x partition x seed in one process; write tables",
        description="Runs every cell of an experiment file (see fl_secure/experiment.py) with "
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
    common(p)
    p.set_defaults(func=cmd_experiment)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fl-secure`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # train shows a progress display; its server's per-round log lines come with -v
    default = logging.WARNING if args.command in ("train", "privacy") else logging.INFO
    _setup_logging(args.verbose, getattr(args, "quiet", False), default)
    try:
        code: int = args.func(args)
    except FlSecureError as exc:
        print(f"fl-secure: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path that is a file, not writable, on a missing mount, ...
        if args.verbose:
            raise
        where = f": {exc.filename}" if exc.filename else ""
        print(  # -v belongs before the command: the sub-commands do not take it
            f"fl-secure: error: {exc.strerror or exc}{where} (`fl-secure -v {args.command} "
            "...` shows the traceback)",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("fl-secure: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
