"""``fl-secure certs {init,issue,resign-registry,ckks}``: mutual TLS certificates, CKKS keys."""

from __future__ import annotations

import argparse
from pathlib import Path

from fl_secure.app.cli.common import Subparsers, add_output_flags, print_json

# Imports that load torch, grpc or tenseal are inside the functions: `fl-secure --help` stays
# fast (fl_secure.app.cli.common says why).


def add_parser(sub: Subparsers) -> None:
    """Add ``certs`` and its sub-commands."""
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
    add_output_flags(q)
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
    add_output_flags(q)
    q.set_defaults(func=cmd_certs_issue)
    q = certs_sub.add_parser(
        "resign-registry",
        help="re-sign signing_keys.json as its next version (migrates an old-format one)",
        description="Re-sign signing_keys.json with the CA key, unchanged but for its next "
        "version and issue time, after checking it against ca.pem (an altered list is "
        "refused). A registry written before versions (which sites refuse) is migrated: its "
        "old signature is checked and its entries signed again as version 1.",
    )
    q.add_argument("--out", type=Path, required=True, help="the folder `certs init` wrote")
    q.add_argument("--ca-key", type=Path, help="the CA key when kept outside --out (offline)")
    add_output_flags(q)
    q.set_defaults(func=cmd_certs_resign_registry)
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
    add_output_flags(q)
    q.set_defaults(func=cmd_certs_ckks)


def cmd_certs_init(args: argparse.Namespace) -> int:
    """Make a CA, a server certificate and client certificates."""
    from fl_secure.tls import init_certificates

    hosts = args.hosts or ["localhost", "127.0.0.1", "::1"]
    cert_set = init_certificates(
        args.out, clients=args.clients, hosts=hosts, days=args.days, overwrite=args.overwrite
    )
    result = {"out": str(args.out), "clients": list(cert_set.client_ids), "hosts": hosts}
    if args.json:
        print_json(result)
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
        print_json({"out": str(args.out), "issued": list(args.ids)})
    else:
        print(f"issued and enrolled {', '.join(args.ids)} in {args.out}")
        print(
            "give each new site ca.pem, clients/<id>.pem, clients/<id>.key, "
            "clients/<id>.sign.key, signing_keys.json and signing_keys.sig; every other site "
            "needs the re-signed signing_keys.json and signing_keys.sig too; a server reads "
            "enrolled.json when it starts"
        )
    return 0


def cmd_certs_resign_registry(args: argparse.Namespace) -> int:
    """Re-sign the signing-key registry as its next version."""
    from fl_secure.tls.ca import resign_registry

    version = resign_registry(args.out, ca_key=args.ca_key)
    if args.json:
        print_json({"out": str(args.out), "registry_version": version})
    else:
        print(f"re-signed {args.out / 'signing_keys.json'} as version {version}")
        print(
            "give every site the new signing_keys.json and signing_keys.sig; a site refuses "
            "a registry older than one it accepted"
        )
    return 0


def cmd_certs_ckks(args: argparse.Namespace) -> int:
    """Make the clients' shared CKKS key and the server's key-less context."""
    from privacy.ckks.context import CkksParams
    from privacy.ckks.keys import write_ckks_keys

    params = CkksParams(poly_modulus_degree=args.poly_modulus_degree)
    secret, public = write_ckks_keys(args.out, params, overwrite=args.overwrite)
    result = {"out": str(args.out), "secret_context": str(secret), "public_context": str(public)}
    if args.json:
        print_json(result)
    else:
        print(f"wrote {secret} (clients only, 0600) and {public} (server)")
        print("give every client the same clients.secret over your own channel, never via the "
              "server; one client colluding with the server can decrypt every update")  # fmt: skip
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
