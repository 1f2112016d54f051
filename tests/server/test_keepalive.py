"""A key stage that waits long for a stuck member does not lose the rest of the cohort.

Secure-aggregation stage calls wait until every live member has answered or
``secure_aggregation.stage_timeout`` passed; the attendance call is held for the whole round.
The client's channel sends keepalive pings every 20 s meanwhile
(``client.transport.open_channel``). gRPC servers by default take pings closer than 5 minutes
on a connection without data as abuse and close it on the third strike (GOAWAY
"too_many_pings"), failing every call on it: a stage that waited ~100 s for one stuck member
lost the whole cohort and the attempt aborted (seen with the server-load benchmark).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

import privacy.secagg.client_round as session
from client.app import FlClient
from client.transport import Connection
from fl_secure.config import SecureAggregationConfig
from fl_secure.runs import RunDir
from fl_secure.tls import init_certificates
from fl_secure.tls.identity import load_signing_registry
from server.app import load_enrollment, start_server
from server.coordinator import Coordinator
from server.settings import CoordinatorSettings
from tests.server.test_secagg_grpc import ShiftTrainer, _quiet, _run_config

#: Past the fifth of the clients' 20 s keepalive pings (the link was closed at ~100 s).
STAGE_TIMEOUT = 125.0


@pytest.mark.slow
def test_a_stage_waiting_past_five_keepalive_pings_keeps_its_cohort(
    tmp_path: Path, monkeypatch
) -> None:
    # Prepare: one SecAgg round over mTLS with four clients; client-3 is stuck before its
    # key advertisement (alive, its attendance call open), so the stage waits its timeout
    certs = tmp_path / "certs"
    init_certificates(certs, clients=4)
    secure = SecureAggregationConfig(scheme="secagg", clip_range=4.0, stage_timeout=STAGE_TIMEOUT)
    settings = CoordinatorSettings(
        rounds=1, min_clients=3, round_timeout=300.0, max_retries=0, poll_wait=0.5,
        final_evaluation=False, run_id="keepalive", secure_aggregation=secure,
        run_config_toml=_run_config(4, 3, secure, None),
    )  # fmt: skip
    coord = Coordinator(
        settings, OrderedDict([("w", np.zeros((20, 10), np.float32))]),
        enrolled=set(load_enrollment(certs).fingerprints), run_dir=RunDir(tmp_path / "run"),
        server_step=lambda p, u, r: OrderedDict((k, p[k] + u[k]) for k in p),
        signing_registry=load_signing_registry(certs / "server"),
    )  # fmt: skip
    real = session.client_secure_update

    def stuck(setup, client_id, *args):  # type: ignore[no-untyped-def]
        if client_id == "client-3":
            time.sleep(STAGE_TIMEOUT + 60)  # past the stage's close: dropped there
        return real(setup, client_id, *args)

    monkeypatch.setattr(session, "client_secure_update", stuck)
    server, port = start_server(coord, "127.0.0.1:0", cert_dir=certs)
    driver = threading.Thread(target=coord.run, daemon=True)
    driver.start()
    for i, shift in enumerate([0.5, 1.0, 2.0, 4.0]):
        trainer = ShiftTrainer(shift)
        client = FlClient(
            Connection(f"localhost:{port}", f"client-{i}", cert_dir=certs),
            lambda reply, t=trainer: t,  # type: ignore[misc]
            max_wait=20.0,
        )
        threading.Thread(target=lambda c=client: _quiet(c.run), daemon=True).start()
    # Execute
    driver.join(timeout=STAGE_TIMEOUT + 90)
    server.stop(grace=None)
    # Assert: the three others stayed connected through the wait and were summed exactly
    assert coord.status == "completed", (coord.stop_reason, coord.events[-1:])
    sa = RunDir(tmp_path / "run").read_metrics()[-1]["secure_aggregation"]
    assert sa["survivors"] == ["client-0", "client-1", "client-2"], sa
    assert sa["dropped"] == {"client-3": "advertise keys"} and sa["left"] == [], sa
    np.testing.assert_allclose(coord.params["w"], 3.5 / 3, atol=4 * 2.0**-20)
