"""A site handed an older signing-key registry refuses the secure round; the others go on.

Over real gRPC and mutual TLS: after a re-issue (``certs issue --overwrite``) the old
``signing_keys.json`` and ``.sig`` still verify against ``ca.pem``. client-0 accepted the new
registry (copied to its ``sites/client-0/``), restarts, and finds the old pair in its folder
(whoever hands sites their files served it again). It must refuse every secure round, said to
the server as a withdrawal, never a crash; the round completes with the other sites.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from client.app import FlClient
from client.transport import Connection
from fl_secure.config import (
    Config,
    PartitionConfig,
    SecureAggregationConfig,
    ServerConfig,
    config_to_toml,
)
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.runs import RunDir
from fl_secure.tls import init_certificates, issue_client_certificate
from fl_secure.tls.identity import load_signing_registry
from fl_secure.tls.layout import CertificateSet
from privacy.ledger.site_ledger import SiteLedger
from server.app import load_enrollment, start_server
from server.coordinator import Coordinator
from server.settings import CoordinatorSettings

REGISTRY = ("signing_keys.json", "signing_keys.sig")


class _Shift:
    def __init__(self, shift: float) -> None:
        self.shift, self.num_examples = shift, 5

    def train(self, shared: Tensors, training: LocalTraining):
        update = OrderedDict((k, np.full_like(v, self.shift)) for k, v in shared.items())
        return update, self.num_examples, {"local_steps": 1.0}

    def evaluate(self, shared: Tensors):
        return self.num_examples, {}


def _site_folder(certs: CertificateSet, site: Path, client_id: str) -> None:
    """What a site holds: ca.pem, its own certificate and keys, the registry pair."""
    given = certs.site_dir(client_id)
    (site / "clients").mkdir(parents=True, exist_ok=True)
    for name in ("ca.pem", *REGISTRY):
        shutil.copy(given / name, site / name)
    for ext in ("pem", "key", "sign.key"):
        shutil.copy(given / "clients" / f"{client_id}.{ext}", site / "clients")


def _quiet(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001, S110 - a failing client's thread just ends
        pass


def test_a_site_handed_the_registry_before_a_reissue_refuses_the_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: five sites; four take part. client-4 is re-issued after the first registry
    certs = tmp_path / "certs"
    paths = init_certificates(certs, clients=5)
    old = {name: (paths.site_dir("client-0") / name).read_bytes() for name in REGISTRY}
    issue_client_certificate(certs, "client-4", overwrite=True)
    # client-0 has its own folder and state; it joins a masked run and takes the new registry
    site, state = tmp_path / "site-0", tmp_path / "state-0"
    _site_folder(paths, site, "client-0")
    assert (site / REGISTRY[0]).read_bytes() != old[REGISTRY[0]]  # the re-issue reached it
    secure = SecureAggregationConfig(scheme="secagg", clip_range=4.0, stage_timeout=10)
    run_config = config_to_toml(
        Config(
            partition=PartitionConfig(num_clients=5),
            server=ServerConfig(min_clients=3),
            secure_aggregation=secure,
        )
    )
    first = FlClient(Connection("localhost:1", "client-0", cert_dir=site),
                     lambda r: None, site=SiteLedger(state))  # type: ignore[arg-type,return-value]  # fmt: skip
    first._hold_run_config(run_config)
    first._load_signing_keys()  # what the client does at join
    # ...and after its restart the old pair (still CA-signed) is in its folder
    for name, data in old.items():
        (site / name).write_bytes(data)
    settings = CoordinatorSettings(
        rounds=1, min_clients=3, round_timeout=60.0, poll_wait=0.5, final_evaluation=False,
        run_id="registry-test", secure_aggregation=secure, run_config_toml=run_config,
    )  # fmt: skip
    initial = OrderedDict([("w", np.zeros((6, 5), np.float32))])
    coord = Coordinator(
        settings,
        initial,
        # the four that take part (with a frozen clock the server waits for every enrolled)
        enrolled=set(load_enrollment(certs).fingerprints) - {"client-4"},
        run_dir=RunDir(tmp_path / "run"),
        server_step=lambda p, u, r: OrderedDict((k, p[k] + u[k]) for k in p),
        signing_registry=load_signing_registry(paths.server_dir),
        clock=lambda: 0.0,  # no deadline passes: only a withdrawal can leave client-0 out
    )
    server, port = start_server(coord, "127.0.0.1:0", cert_dir=certs)
    # Execute
    caplog.set_level(logging.ERROR, logger="client.app")
    driver = threading.Thread(target=coord.run, daemon=True)
    driver.start()
    shifts = [0.5, 1.0, -0.25, 2.0]
    clients = []
    for i, shift in enumerate(shifts):
        trainer = _Shift(shift)
        client = FlClient(
            Connection(f"localhost:{port}", f"client-{i}", cert_dir=site if i == 0 else certs),
            lambda reply, t=trainer: t,  # type: ignore[misc]
            max_wait=20.0,
            site=SiteLedger(state) if i == 0 else None,
        )
        clients.append(client)
        threading.Thread(target=lambda c=client: _quiet(c.run), daemon=True).start()
    driver.join(timeout=120)
    server.stop(grace=None)
    # Assert: the round completed with the three others; client-0 withdrew, naming both versions
    assert coord.status == "completed", coord.stop_reason
    failed = coord.events[-1]["failed"]
    assert list(failed) == ["client-0"], coord.events[-1]
    assert failed["client-0"].startswith(
        "secure aggregation: withdrew at advertise keys (a message of the round failed its checks"
    )
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts[1:]), atol=4 * 2.0**-20)
    refused = [r.getMessage() for r in caplog.records if "older than version 2" in r.getMessage()]
    assert refused and "signing_keys.json is version 1" in refused[-1]
    assert clients[0].rounds_done == 0
