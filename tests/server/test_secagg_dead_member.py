"""A client that died in a secure round is not drawn into the next one's cohort.

Its attendance call closed, so the round it died in went on without it at once. The next
round used to draw it again (it was heard from within ``online_timeout``), and that round's
key advertisement then waited a whole ``stage_timeout`` for a member that would never answer
(120 s by default, every round after a kill; seen with the server-load benchmark).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from client.app import FlClient
from client.transport import Connection
from fl_secure.config import SecureAggregationConfig
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.runs import RunDir
from fl_secure.tls import init_certificates
from fl_secure.tls.identity import load_signing_registry
from server.app import load_enrollment, start_server
from server.coordinator import Coordinator
from server.settings import CoordinatorSettings
from tests.server.test_secagg_grpc import ShiftTrainer, _frozen, _Killed, _quiet, _run_config

SHIFTS = [0.5, 1.0, -0.25, 2.0]


class DiesInTraining(ShiftTrainer):
    """Ends its client's thread in its first local training, as a kill -9 would."""

    def train(self, shared: Tensors, training: LocalTraining):
        raise _Killed("killed while training, after the key stages")


def test_the_round_after_a_member_died_does_not_wait_for_it(tmp_path: Path) -> None:
    # Prepare: two secure rounds over mTLS, four clients; client-3 dies in round 1 after
    # the key stages (its attendance call closes). The clock is frozen: no deadline or
    # timeout ever passes, so a round that drew client-3 again could never end
    certs = tmp_path / "certs"
    init_certificates(certs, clients=4)
    secure = SecureAggregationConfig(scheme="secagg", clip_range=4.0, stage_timeout=10)
    settings = CoordinatorSettings(
        rounds=2, min_clients=3, round_timeout=60.0, max_retries=0, poll_wait=0.5,
        final_evaluation=False, run_id="dead-member", secure_aggregation=secure,
        run_config_toml=_run_config(4, 3, secure, None),
    )  # fmt: skip
    initial = OrderedDict([("w", np.zeros((20, 10), np.float32))])
    coord = Coordinator(
        settings, initial, enrolled=set(load_enrollment(certs).fingerprints),
        run_dir=RunDir(tmp_path / "run"),
        server_step=lambda p, u, r: OrderedDict((k, p[k] + u[k]) for k in p),
        signing_registry=load_signing_registry(certs / "server"), clock=_frozen,
    )  # fmt: skip
    server, port = start_server(coord, "127.0.0.1:0", cert_dir=certs)
    driver = threading.Thread(target=coord.run, daemon=True)
    driver.start()
    for i, shift in enumerate(SHIFTS):
        trainer = DiesInTraining(shift) if i == 3 else ShiftTrainer(shift)
        client = FlClient(
            Connection(f"localhost:{port}", f"client-{i}", cert_dir=certs),
            lambda reply, t=trainer: t,  # type: ignore[misc]
            max_wait=20.0,
        )
        threading.Thread(target=lambda c=client: _quiet(c.run), daemon=True).start()
    # Execute
    driver.join(timeout=60)
    server.stop(grace=None)
    # Assert: both rounds completed; round 2 drew only the three live clients
    assert coord.status == "completed", coord.stop_reason
    rounds = [r for r in RunDir(tmp_path / "run").read_metrics() if r["round"] > 0]
    first, second = (r["secure_aggregation"] for r in rounds)
    assert first["cohort"] == ["client-0", "client-1", "client-2", "client-3"]
    assert first["left"] == ["client-3"] and first["survivors"] == first["cohort"][:3]
    assert second["cohort"] == ["client-0", "client-1", "client-2"]
    assert second["survivors"] == second["cohort"] and second["left"] == []
    # the sums were exact: twice the mean of the three survivors' shifts
    np.testing.assert_allclose(coord.params["w"], 2 * np.mean(SHIFTS[:3]), atol=8 * 2.0**-20)
