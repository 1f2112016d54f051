"""Mutual TLS for fl-secure: a small private CA, gRPC credentials and the enrollment check.

Identity on the wire is the client certificate (threat model in ARCHITECTURE.md): the server
trusts only certificates signed by the project's CA and serves a client only when the common
name of its certificate is listed in ``enrolled.json`` (optionally pinned to the certificate's
SHA-256 fingerprint). Each party's folder holds its own private keys only::

    ca/            ca.pem ca.key (keep OFFLINE), enrolled.json, signing_keys.*, clients/<id>.pem
    server/        ca.pem, server.pem server.key (SAN = hosts, EKU serverAuth), enrolled.json,
                   signing_keys.*: what ``fl-secure server --certs`` reads, no client secret
    sites/<id>/    ca.pem, clients/<id>.pem <id>.key (CN = id, SAN urn:fl-secure:client:<id>,
                   EKU clientAuth), clients/<id>.sign.key, signing_keys.*

``init_certificates`` writes all three on one machine; on separate machines a site makes its
own keys and a request (``request.create_request``) that the CA signs (``sign_request``).

Modules: ``layout`` (file names, id rules, safe writes), ``certs`` (one certificate),
``ca`` (a directory of them), ``request`` (a site's request and the CA's signature of it),
``enrollment`` (who may connect), ``grpc_auth`` (credentials and the per-call check). The
plaintext transport is not configured here; code that allows it must call ``warn_insecure``.
"""

from fl_secure.tls.ca import init_certificates, issue_client_certificate
from fl_secure.tls.certs import (
    CertifiedKey,
    KeyType,
    Role,
    load_certified_key,
    make_certificate,
)
from fl_secure.tls.enrollment import EnrollmentList, certificate_fingerprint
from fl_secure.tls.grpc_auth import (
    InsecureTransportWarning,
    channel_credentials,
    peer_client_id,
    require_enrolled,
    server_credentials,
    warn_insecure,
)
from fl_secure.tls.layout import Bundle, CertificateSet, validate_client_id

__all__ = [
    "Bundle",
    "CertificateSet",
    "CertifiedKey",
    "EnrollmentList",
    "InsecureTransportWarning",
    "KeyType",
    "Role",
    "certificate_fingerprint",
    "channel_credentials",
    "init_certificates",
    "issue_client_certificate",
    "load_certified_key",
    "make_certificate",
    "peer_client_id",
    "require_enrolled",
    "server_credentials",
    "validate_client_id",
    "warn_insecure",
]
