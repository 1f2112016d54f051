"""A secure round over the wire: its setup, its stages on the server, a client's side."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fl_secure.config import SecureAggregationConfig, config_from_dict
from fl_secure.errors import ProtocolError, UpdateError
from privacy.ckks.round_setup import CkksSetup, is_ckks_setup
from privacy.secagg.client import SecAggClient
from privacy.secagg.client_round import client_secure_update
from privacy.secagg.messages import (
    AdvertiseKeys,
)
from privacy.secagg.round_setup import RoundSetup, check_setup, make_setup
from privacy.secagg.server_round import ServerSecureRound
from privacy.secagg.stages import ADVERTISE, SHARE, pack, unpack

ROUND = b"round-0007"


def _ids(n: int) -> list[str]:
    return [f"client-{i:03d}" for i in range(n)]


def test_a_client_seen_to_go_is_not_waited_for_and_counts_as_dropped() -> None:
    # Prepare: the server's session of a 4-client SecAgg round (t = 2) on a clock that never
    # moves, so no deadline can close a stage; client-003 never advertises

    ids = _ids(4)
    setup = make_setup(
        SecureAggregationConfig(scheme="secagg"), run_id="gone", round_=1, attempt=0,
        cohort=ids, vector_length=8,
    )  # fmt: skip
    keys = {u: Ed25519PrivateKey.generate() for u in ids}
    registry = {u: k.public_key() for u, k in keys.items()}
    session = ServerSecureRound(setup, registry, stage_timeout=60.0, clock=lambda: 0.0)
    for u in ids[:3]:
        client = SecAggClient(u, keys[u], setup.config(), registry, setup.vector_length)
        session.submit(ADVERTISE, u, client.advertise_keys().to_bytes())
    waiting = session.ready()
    # Execute: its connection is seen to close
    session.mark_gone(ids[3])
    # Assert: the stage closes now, without a deadline, with client-003 dropped at that stage
    assert not waiting and session.ready()
    session.close_stage()
    assert session.stage == SHARE and session.dropped == {ids[3]: "advertise keys"}
    assert set(session.expected()) == set(ids[:3])  # the next stage asks only the others


@pytest.mark.parametrize("encoding", ["fixed_point", "ddg"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_client_refuses_to_mask_an_update_that_is_not_finite(encoding: str, bad: float) -> None:
    # Prepare: a 3-client round driven in-process; client-000's update has one bad value.
    # With the distributed discrete Gaussian ("ddg") a NaN norm would pass the clip and wrap
    # to garbage integers in the sum, so the session must check it itself.

    ids = _ids(3)
    setup = make_setup(
        SecureAggregationConfig(scheme="secagg"), run_id="nan", round_=1, attempt=0,
        cohort=ids, vector_length=8, ddg=(1.0, 1.0, 2) if encoding == "ddg" else None,
    )  # fmt: skip
    assert setup.encoding == encoding
    keys = {u: Ed25519PrivateKey.generate() for u in ids}
    registry = {u: k.public_key() for u, k in keys.items()}
    session = ServerSecureRound(setup, registry, stage_timeout=60.0, clock=lambda: 0.0)
    others = {
        u: SecAggClient(u, keys[u], setup.config(), registry, setup.vector_length) for u in ids[1:]
    }

    def exchange(stage: int, payload: bytes) -> bytes:  # the other two answer in step
        session.submit(stage, ids[0], payload)
        for u, c in others.items():
            if stage == ADVERTISE:
                session.submit(stage, u, c.advertise_keys().to_bytes())
            else:
                adverts = [
                    AdvertiseKeys.from_bytes(b)
                    for b in unpack(session.reply(ADVERTISE, u), "adverts")
                ]
                session.submit(stage, u, pack([s.to_bytes() for s in c.share_keys(adverts)]))
        session.close_stage()
        return session.reply(stage, ids[0])

    update = np.zeros(8, np.float32)
    update[3] = bad
    uploaded: list[np.ndarray] = []
    # Execute / Assert: refused after the key stages, before anything is uploaded
    with pytest.raises(UpdateError, match="NaN or infinity"):
        client_secure_update(
            setup, ids[0], keys[ids[0]], registry, exchange,
            lambda: OrderedDict([("w", update)]), uploaded.append,
        )  # fmt: skip
    assert session.stage == SHARE + 1 and uploaded == []


def test_round_setups_round_trip_and_malformed_ones_are_protocol_errors() -> None:
    setup = make_setup(
        SecureAggregationConfig(scheme="secagg"), run_id="rt", round_=1, attempt=0,
        cohort=_ids(5), vector_length=8, min_inputs=4,
    )  # fmt: skip
    assert RoundSetup.from_bytes(setup.to_bytes()) == setup
    assert setup.config().min_inputs == 4
    raw = setup.to_bytes()
    malformed = [
        raw.replace(b'"threshold":3', b'"threshold":Infinity'),  # int(inf): OverflowError
        raw.replace(b'"min_inputs":4', b'"min_inputs":1e999'),
        raw.replace(b'"version":3', b'"version":2'),  # an older release's setup
        b"[" * 100_000,  # nesting beyond the parser's recursion limit
    ]
    assert all(m != raw for m in malformed[:3])
    for data in malformed:
        with pytest.raises(ProtocolError, match="invalid secure-aggregation setup"):
            RoundSetup.from_bytes(data)
    ckks = CkksSetup(ROUND, tuple(_ids(3)), None, min_count=2, decryptors=1)
    assert CkksSetup.from_bytes(ckks.to_bytes()) == ckks
    for data in (ckks.to_bytes().replace(b'"min_count":2', b'"min_count":1e999'), b"[" * 100_000):
        assert data != ckks.to_bytes()
        with pytest.raises(ProtocolError, match="invalid CKKS round setup"):
            CkksSetup.from_bytes(data)
    assert not is_ckks_setup(b"[" * 100_000)


# ------------------------------------------- a client holds each setup to its joined config


def _joined(placement: str = "distributed") -> object:
    return config_from_dict(
        {
            "partition": {"num_clients": 5},
            "server": {"min_clients": 3},
            "privacy": {"unit": "client", "noise_placement": placement,
                        "noise_multiplier": 1.2, "clip_norm": 1.0},
            "secure_aggregation": {"scheme": "secagg+", "neighbours": 4, "clip_range": 8.0},
        }
    )  # fmt: skip


def test_a_client_accepts_the_setup_its_config_gives_and_refuses_a_weaker_one() -> None:

    config = _joined()
    cohort = [f"client-{i}" for i in range(5)]
    honest = make_setup(
        config.secure_aggregation, run_id="run", round_=4, attempt=1, cohort=cohort,
        vector_length=1000, ddg=(1.2, 1.0, 3), min_inputs=3,
    )  # fmt: skip
    check_setup(honest, config)  # what the coordinator sends: accepted
    assert honest.encoding == "ddg" and honest.ddg_sigma > 0
    weaker = {
        "encoding": dataclasses.replace(honest, encoding="fixed_point", ddg_sigma=0.0),
        "noise sigma": dataclasses.replace(honest, ddg_sigma=honest.ddg_sigma / 2),
        "threshold": dataclasses.replace(honest, threshold=1),
        "min_inputs": dataclasses.replace(honest, min_inputs=0),
        "clip_norm": dataclasses.replace(honest, clip_norm=100.0),
    }
    for name, setup in weaker.items():
        with pytest.raises(
            ProtocolError, match=f"weaker than the run this client joined: .*{name}"
        ):
            check_setup(setup, config)
    # more noise or a larger floor is not weaker
    check_setup(dataclasses.replace(honest, ddg_sigma=2 * honest.ddg_sigma, min_inputs=5), config)


def test_a_client_refuses_a_cohort_without_it_or_with_clients_not_enrolled() -> None:

    config = _joined()
    enrolled = [f"client-{i}" for i in range(5)]

    def setup(cohort: list[str]):  # noqa: ANN202
        return make_setup(
            config.secure_aggregation, run_id="run", round_=1, attempt=0, cohort=cohort,
            vector_length=100, ddg=(1.2, 1.0, 3), min_inputs=3,
        )  # fmt: skip

    check_setup(setup(enrolled), config, "client-2", enrolled)  # accepted
    with pytest.raises(ProtocolError, match=r"does not list this client \(client-9\)"):
        check_setup(setup(enrolled), config, "client-9", enrolled)
    # made-up members (each would cost this client memory; none can sign an advert)
    made_up = [*enrolled, *(f"ghost-{i}" for i in range(5))]
    with pytest.raises(ProtocolError, match="lists 5 client\\(s\\) not in the CA-signed registry"):
        check_setup(setup(made_up), config, "client-2", enrolled)
    twice = dataclasses.replace(setup(enrolled), cohort=(*enrolled, "client-0"))
    with pytest.raises(ProtocolError, match="lists a client twice"):
        check_setup(twice, config, "client-2", enrolled)
