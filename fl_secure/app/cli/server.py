"""``fl-secure server``: the server of a run whose clients connect from other machines."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fl_secure.app.cli.common import SUCCESS, Subparsers, add_output_flags, torch_threads
from fl_secure.app.cli.runs import add_run_args, check_resume, print_summary
from fl_secure.errors import FlSecureError
from fl_secure.runs import RunDir, new_run_dir, removed_if_setup_fails

if TYPE_CHECKING:
    from fl_secure.config import Config

# Imports that load torch, grpc or tenseal are inside the functions: `fl-secure --help` stays
# fast (fl_secure.app.cli.common says why).

log = logging.getLogger("fl_secure")


def add_parser(sub: Subparsers) -> None:
    """Add ``server``."""
    p = sub.add_parser("server", help="run the server for clients on other machines")
    add_run_args(p)
    p.add_argument(
        "--certs", type=Path,
        help="the server's folder (DIR/server of `certs init`); one with a client secret is "
        "refused",
    )  # fmt: skip
    p.add_argument("--address", help="host:port to listen on (default: server.address)")
    p.add_argument("--port-file", help="write the bound port here (useful with port 0)")
    p.add_argument("--no-eval", action="store_true", help="skip held-out evaluation")
    p.add_argument(
        "--insecure", action="store_true", help="plaintext gRPC (loopback tests only; warns)"
    )
    add_output_flags(p)
    p.set_defaults(func=cmd_server)


def cmd_server(args: argparse.Namespace) -> int:
    """Standalone server: clients on other machines connect to it."""
    from fl_secure.algorithms.registry import check_config
    from fl_secure.config import load_config
    from server.app import check_address, load_enrollment
    from server.custody import check_server_folder
    from server.preflight import preflight

    check_resume(args)
    if not args.insecure and args.certs is None:
        raise FlSecureError(
            "server needs --certs DIR (the server's folder: DIR/server of `fl-secure certs init`)"
        )
    run: RunDir | None = None
    if args.resume is not None:
        run = RunDir(args.resume)
        config = load_config(run.config)
    else:
        if args.config is None:
            raise FlSecureError("server needs --config FILE (or --resume RUN_DIR)")
        config = load_config(args.config, args.set)
    check_config(config)
    if args.insecure:
        enrolled = {f"client-{i}" for i in range(config.partition.num_clients)}
    else:
        check_server_folder(args.certs)  # no client key, no CKKS secret: before anything else
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
    from server.app import start_server
    from server.bootstrap import build_server
    from server.run_files import record_start, write_config
    from server.summary import build_summary

    torch_threads(config.train.threads)
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
    code = print_summary(summary, run.path, args.json)
    return code if summary["status"] in SUCCESS else 1
