"""Over gRPC: a CKKS decryptor refuses a malicious server's request to open one client's upload."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fl_secure.runs import RunDir
from tests.server.test_secagg_grpc import _ckks_initial, _run


def test_a_decryptor_sent_one_victims_upload_withdraws_and_nothing_is_decrypted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a server that sends each chosen decryptor only client-1's signed upload (the
    # victim's), as if it were the round's uploads
    from privacy.ckks import server_round
    from privacy.ckks.signed import encode_bundle

    honest_step = server_round.ServerCkksRound._step

    def forging_step(self) -> None:
        honest_step(self)
        if self.chosen and self.payload and not self.responses:
            self.payload = encode_bundle([self._signed["client-1"]])

    monkeypatch.setattr(server_round.ServerCkksRound, "_step", forging_step)
    # Execute
    with caplog.at_level("WARNING"):
        coord = _run(
            tmp_path, [0.5, 1.0, 1.5], failing=set(), scheme="ckks", initial=_ckks_initial()
        )
    # Assert: no decryptor answered; each chosen one withdrew because the request failed its
    # checks (its own upload missing, or a sum of one client); the model is untouched
    assert coord.status == "aborted", coord.status
    np.testing.assert_array_equal(coord.params["w"], np.zeros((90, 100), np.float32))
    sa = RunDir(tmp_path / "run").read_metrics()[-1]["secure_aggregation"]
    assert "no decryptor" in sa["aborted"], sa
    assert sa["left"] == sorted(sa["decryptors"]) and len(sa["decryptors"]) == 2, sa
    assert sa["dropped"] == dict.fromkeys(sa["decryptors"], "unmasking"), sa
    for decryptor in sa["decryptors"]:
        assert f"{decryptor} left secure aggregation: withdrew at unmasking (a message of the " \
            "round failed its checks" in caplog.text  # fmt: skip
    assert "secure aggregation refused: " in caplog.text
