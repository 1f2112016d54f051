"""A site's client loads its signing key when it joins a masked run, not mid-round."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.app import FlClient
from client.transport import Backoff, Connection
from fl_secure.config import config_from_dict, config_to_toml
from fl_secure.errors import TlsError
from fl_secure.tls import init_certificates, issue_client_certificate
from fl_secure.v1 import transport_pb2 as pb


class _Stub:
    """Answers Join with a run config; any later call means the client went on."""

    def __init__(self, client_id: str, config_toml: str) -> None:
        self.reply = pb.JoinReply(client_id=client_id, run_id="run", run_config_toml=config_toml)
        self.polled = False

    def Join(self, request, metadata=(), timeout=None):  # noqa: N802 - gRPC method name
        return self.reply

    def PollTask(self, request, metadata=(), timeout=None):  # noqa: N802
        self.polled = True
        raise AssertionError("the client polled for a task")


def _session(certs: Path, client_id: str, scheme: str) -> tuple[FlClient, _Stub]:
    sa = {"scheme": scheme, **({"neighbours": 2} if scheme == "secagg+" else {})}
    config = config_to_toml(config_from_dict({"secure_aggregation": sa}))
    stub = _Stub(client_id, config)
    client = FlClient(
        Connection("localhost:1", client_id, cert_dir=certs),
        trainer_factory=lambda reply: pytest.fail("no trainer is built before the key check"),
    )
    return client, stub


def test_a_missing_signing_key_stops_the_client_at_join(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    init_certificates(certs, clients=2)
    (certs / "sites" / "client-0" / "clients" / "client-0.sign.key").unlink()
    client, stub = _session(certs, "client-0", "secagg")
    with pytest.raises(TlsError, match=r"client-0\.sign\.key"):
        client._session(stub, Backoff())  # type: ignore[arg-type]
    assert not stub.polled  # it never asked for a round
    # a run without masking needs no signing key
    client, stub = _session(certs, "client-0", "none")
    with pytest.raises(pytest.fail.Exception, match="no trainer is built"):
        client._session(stub, Backoff())  # type: ignore[arg-type]
    assert client._signing is None
    # a site that has its key loads it at join, with the enrolled registry
    client, stub = _session(certs, "client-1", "secagg+")
    with pytest.raises(pytest.fail.Exception):
        client._session(stub, Backoff())  # type: ignore[arg-type]
    assert client._signing is not None and set(client._signing[1]) == {"client-0", "client-1"}


def test_a_stale_signing_key_stops_the_client_at_join(tmp_path: Path) -> None:
    # the site was re-issued but kept its old signing key: peers would reject its signatures
    certs = tmp_path / "certs"
    init_certificates(certs, clients=2)
    stale = (certs / "sites" / "client-0" / "clients" / "client-0.sign.key").read_bytes()
    issue_client_certificate(certs, "client-0", overwrite=True)
    (certs / "sites" / "client-0" / "clients" / "client-0.sign.key").write_bytes(stale)
    client, stub = _session(certs, "client-0", "secagg")
    with pytest.raises(TlsError, match=r"client-0\.sign\.key is not the key enrolled"):
        client._session(stub, Backoff())  # type: ignore[arg-type]
    assert not stub.polled and client._signing is None
    # a damaged key file is named too, not a ValueError traceback
    (certs / "sites" / "client-0" / "clients" / "client-0.sign.key").write_bytes(b"garbage")
    with pytest.raises(TlsError, match=r"client-0\.sign\.key is not a readable"):
        client._session(stub, Backoff())  # type: ignore[arg-type]
