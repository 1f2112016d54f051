"""``fl-secure client``: one site; it connects out to the server and trains on its own data."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from fl_secure.app.cli.common import (
    Subparsers,
    add_output_flags,
    number_arg,
    positive_int,
    print_json,
)
from fl_secure.errors import FlSecureError

# Imports that load torch, grpc or tenseal are inside the functions: `fl-secure --help` stays
# fast (fl_secure.app.cli.common says why).


def add_parser(sub: Subparsers) -> None:
    """Add ``client``."""
    p = sub.add_parser("client", help="run one client; it connects out to the server")
    p.add_argument("--server", required=True, help="host:port of the server")
    p.add_argument("--id", required=True, help="client id = CN of this client's certificate")
    p.add_argument(
        "--certs", type=Path, help="this site's folder (ca.pem, clients/<id>.pem, .key, .sign.key)"
    )
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
    add_output_flags(p)
    p.set_defaults(func=cmd_client)


def cmd_client(args: argparse.Namespace) -> int:
    """A client: connects out to the server, trains on its own data."""
    import grpc

    from client.app import FlClient
    from client.custody import check_site_folder
    from client.trainer_factory import ClientDataSource, trainer_factory
    from client.transport import Connection, explain_rpc_error
    from fl_secure.algorithms.registry import check_config
    from fl_secure.config import load_config
    from fl_secure.data.folders import list_identity_folders
    from privacy.ledger.site_ledger import SiteLedger

    if args.config is not None and args.plan_index is None:
        raise FlSecureError("--config needs --plan-index N (which share of the plan is mine)")
    if args.certs is not None:
        check_site_folder(args.certs, args.id)  # no other party's key: before anything else
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
        found = list_identity_folders(args.data, check_headers=True)
        logging.getLogger("client.app").info(
            "%s: %d identities, %d images",
            args.data,
            len(found),
            sum(len(files) for _, files in found),
        )
    local_config = load_config(args.config) if args.config else None
    if local_config is not None:
        check_config(local_config)
    source = ClientDataSource(
        local_config=local_config,
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
    try:
        message = client.run()
    except grpc.RpcError as exc:
        raise FlSecureError(explain_rpc_error(exc, args.server)) from exc
    if args.json:
        print_json({"client_id": args.id, "rounds": client.rounds_done, "message": message})
    else:
        print(f"{args.id}: {client.rounds_done} rounds; {message}")
    return 0
