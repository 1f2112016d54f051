"""Mutual TLS for fl-secure: a small private CA, gRPC credentials and the enrollment check.

Identity on the wire is the client certificate (threat model in ARCHITECTURE.md): the server
trusts only certificates signed by the project's CA and serves a client only when the common
name of its certificate is listed in ``enrolled.json`` (optionally pinned to the certificate's
SHA-256 fingerprint). ``init_certificates`` writes::

    ca.pem  ca.key              the CA; keep ca.key OFFLINE once certificates are issued
    server.pem  server.key      server certificate (SAN = hosts, EKU serverAuth)
    clients/<id>.pem  <id>.key  one per client (CN = id, SAN urn:fl-secure:client:<id>,
                                EKU clientAuth)
    enrolled.json               the server's enrollment list with certificate fingerprints

Modules: ``layout`` (file names, id rules, safe writes), ``certs`` (one certificate),
``ca`` (a directory of them), ``enrollment`` (who may connect), ``grpc_auth`` (credentials and
the per-call check). The plaintext transport is not configured here; code that allows it must
call ``warn_insecure``.
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
from fl_secure.tls.layout import CertificateSet, validate_client_id

__all__ = [
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
