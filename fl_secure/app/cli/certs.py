"""``fl-secure certs {request,sign,init,issue,resign-registry,ckks}``: TLS, signing and CKKS keys.

``request`` (at a site) and ``sign`` (at the CA) enroll a site whose keys never leave it;
``init`` and ``issue`` make every key on one machine and write one folder per party;
``resign-registry`` re-signs the signing-key registry as its next version.
"""

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
    q = certs_sub.add_parser(
        "request",
        help="at a site: make its keys and a request for the CA (the keys stay here)",
        description="Write the site's TLS key and Ed25519 signing key (0600) into --out and "
        "OUT/<id>.request.json (a CSR, the signing public key and the id): send only that "
        "file to the operator, and install what `certs sign` returns into the same folder.",
    )
    q.add_argument("--id", required=True, help="this site's client id (its certificate's CN)")
    q.add_argument("--out", type=Path, required=True, help="this site's folder (its --certs)")
    q.add_argument("--overwrite", action="store_true", help="replace keys made earlier")
    add_output_flags(q)
    q.set_defaults(func=cmd_certs_request)
    q = certs_sub.add_parser(
        "sign",
        help="at the CA: check a site's request, issue its certificate and enroll it",
        description="Check the request (its CSR's signature, CN = id, the id, the key type and "
        "size), issue the certificate, enroll the id in enrolled.json (pinned to the "
        "certificate's fingerprint) and add its signing key to signing_keys.json, re-signed "
        "(only if it verifies). The reply (ca.pem, clients/<id>.pem, signing_keys.json/.sig) "
        "goes to --out (default: the request's folder): it holds no secret. With --ca DIR/ca "
        "of `certs init`, DIR/server and every DIR/sites/<id> are updated too.",
    )
    q.add_argument("--ca", type=Path, required=True, help="the CA's folder (DIR/ca of init)")
    q.add_argument("--request", type=Path, required=True, help="the site's <id>.request.json")
    q.add_argument("--out", type=Path, help="folder for the reply (default: the request's)")
    q.add_argument("--server", type=Path, help="a server folder to enroll the site in as well")
    q.add_argument(
        "--days", type=_certificate_days, default=365, help="certificate validity (default: 365)"
    )
    q.add_argument("--ca-key", type=Path, help="the CA key when kept outside --ca (offline)")
    q.add_argument(
        "--overwrite", action="store_true", help="re-issue an existing id (revokes the old one)"
    )
    add_output_flags(q)
    q.set_defaults(func=cmd_certs_sign)
    q = certs_sub.add_parser(
        "init",
        help="one machine: a CA, a server and N sites, one folder each",
        description="Write DIR/ca (the CA key and records: keep offline), DIR/server (what "
        "`fl-secure server --certs` reads: no client secret) and DIR/sites/<id> (what "
        "`fl-secure client --certs` reads: that site's keys only).",
    )
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
        description="Issue a client certificate and signing key for each ID into "
        "DIR/sites/<id>, enroll it in DIR/ca and DIR/server and re-sign signing_keys.json "
        "(only if it verifies against ca.pem: an altered list is refused, never re-signed). "
        "With --overwrite an existing site's certificate is replaced and, by fingerprint "
        "pinning, the old one is refused from then on (revocation). A server reads "
        "enrolled.json when it starts, so a change applies to the runs started after it.",
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
        description="Write DIR/sites/<id>/ckks/clients.secret (the secret key all clients "
        "share) and DIR/server/ckks/server.public (parameters only: the server adds "
        "ciphertexts, cannot decrypt).",
    )
    q.add_argument("--out", type=Path, required=True, help="the folder `certs init` wrote")
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
            f"keep {cert_set.ca_dir} offline; the server gets {cert_set.server_dir} (no client "
            f"secret in it), each site its own {args.out}/sites/<id>"
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
            f"give each new site its {args.out}/sites/<id>; every other site needs the "
            "re-signed signing_keys.json and signing_keys.sig too (updated in its folder); a "
            "server reads enrolled.json when it starts"
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
    from privacy.ckks.keys import distribute_ckks_keys

    params = CkksParams(poly_modulus_degree=args.poly_modulus_degree)
    secrets, public = distribute_ckks_keys(args.out, params, overwrite=args.overwrite)
    result = {
        "out": str(args.out),
        "secret_contexts": [str(s) for s in secrets],
        "public_context": str(public),
    }
    if args.json:
        print_json(result)
    else:
        print(f"wrote {len(secrets)} site copies of clients.secret (0600) and {public} (server)")
        print("give every client the same clients.secret over your own channel, never via the "
              "server; one client colluding with the server can decrypt every update")  # fmt: skip
    return 0


def cmd_certs_request(args: argparse.Namespace) -> int:
    """At a site: make its keys and the request for the CA."""
    from fl_secure.tls.request import create_request

    request = create_request(args.out, args.id, overwrite=args.overwrite)
    if args.json:
        print_json({"out": str(args.out), "id": args.id, "request": str(request)})
    else:
        print(f"wrote this site's private keys (0600) into {args.out} and the request {request}")
        print("send only the request to the operator; install what `certs sign` returns here")
    return 0


def cmd_certs_sign(args: argparse.Namespace) -> int:
    """At the CA: check a site's request, issue its certificate and enroll it."""
    from fl_secure.tls.request import sign_request

    signed = sign_request(
        args.ca, args.request, days=args.days, out=args.out, server_dir=args.server,
        ca_key=args.ca_key, overwrite=args.overwrite,
    )  # fmt: skip
    result = {
        "id": signed.client_id,
        "certificate": str(signed.certificate),
        "reply": str(signed.reply_dir),
        "updated": [str(p) for p in signed.updated],
    }
    if args.json:
        print_json(result)
    else:
        print(f"issued and enrolled {signed.client_id}: {signed.certificate}")
        print(
            f"send {signed.reply_dir} (ca.pem, clients/{signed.client_id}.pem, signing_keys.json"
            "/.sig: no secret) to the site; the server and every other site need the new "
            "enrolled.json / signing_keys.json and .sig"
            + (f" (updated in {', '.join(map(str, signed.updated))})" if signed.updated else "")
        )
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
