"""The consistency check: its threshold, its statement, its message, the guards around it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fl_secure.config import SecureAggregationConfig
from fl_secure.errors import PrivacyError, ProtocolError
from privacy.secagg.consistency import (
    ConsistencyFailed,
    ConsistencySignature,
    advert_set_digest,
    signature_threshold,
    statement,
)
from privacy.secagg.graph import advert_seed
from privacy.secagg.messages import EncryptedShare, UnmaskRequest
from privacy.secagg.round_setup import make_setup, neighbourhood
from tests.privacy.secagg.helpers import ROUND
from tests.privacy.secagg.helpers import config as _config
from tests.privacy.secagg.test_protocol import Round


def test_two_survivor_sets_can_never_both_gather_the_threshold() -> None:
    # Invariant, exhaustively: with c corrupt clients signing everything and honest ones
    # signing once, sets A and B need (T - c) honest signers each, and 2 (T - c) > n - c
    for n in range(2, 80):
        for c in range(n):
            need = signature_threshold(n, c)
            assert 2 * (need - c) > n - c, (n, c)
            assert need <= n  # reachable when nobody drops
            assert 2 * (need - 1) <= n + c  # and the smallest such threshold


def test_the_statement_binds_round_advertisements_and_the_sorted_survivors() -> None:
    base = statement(ROUND, b"d" * 32, ["client-001", "client-000"])
    assert base == statement(ROUND, b"d" * 32, ["client-000", "client-001"])  # sorted
    others = [
        statement(b"round-0008", b"d" * 32, ["client-000", "client-001"]),
        statement(ROUND, b"e" * 32, ["client-000", "client-001"]),
        statement(ROUND, b"d" * 32, ["client-000"]),
        statement(ROUND, b"d" * 32, ["client-000", "client-001", "client-002"]),
    ]
    assert len({base, *others}) == 5
    # unambiguous: ids are length-prefixed, so "ab" + "c" is not "a" + "bc"
    assert statement(ROUND, b"d", ["a", "bc"]) != statement(ROUND, b"d", ["ab", "c"])
    assert base.startswith(b"fl-secure/secagg/v1/consistency-check")


def test_signature_message_round_trips_and_parsing_is_strict() -> None:
    sig = ConsistencySignature("client-003", ROUND, bytes(range(64)))
    data = sig.to_bytes()
    assert ConsistencySignature.from_bytes(data) == sig
    for bad in (data[:-1], data + b"\0", data[:5] + b"\1" + data[6:]):
        with pytest.raises(ProtocolError, match="ConsistencySignature"):
            ConsistencySignature.from_bytes(bad)
    with pytest.raises(ProtocolError, match="signature has 63 bytes, expected 64"):
        ConsistencySignature.from_bytes(dataclasses.replace(sig, signature=b"x" * 63).to_bytes())


def test_config_refuses_rates_under_which_survivors_cannot_reach_the_threshold() -> None:
    # Prepare: n = 10, c = 4 (0.45), d = 4 (0.4): 8 signatures needed, only 6 may remain
    cfg = SecureAggregationConfig(scheme="secagg", corrupt_fraction=0.45, dropout_fraction=0.4)
    # Execute / Assert
    with pytest.raises(PrivacyError, match="consistency check needs 8 of a cohort of 10.*only 6"):
        neighbourhood(cfg, 10)
    # the defaults (c = 2, d = 1) leave 9 for 7 needed; the setup carries c
    setup = make_setup(
        SecureAggregationConfig(scheme="secagg"), run_id="r", round_=1, attempt=0,
        cohort=[f"c{i}" for i in range(10)], vector_length=4,
    )  # fmt: skip
    assert setup.corrupt == 2 and setup.config().consistency_threshold == 7


def test_a_client_refuses_an_advertisement_set_too_small_to_finish() -> None:
    # Prepare: SecAgg+, n = 10, k = 4, t = 3: 6 signatures needed (c = 0). The server shows
    # client-000 only itself and four others: enough neighbours for t, too few for the round
    rnd = Round.start(_config(10, 3, 4), d=4)
    adverts = [rnd.advert(u) for u in rnd.config.cohort]
    shown = next(  # a set whose graph (seeded by it) gives client-000 >= t neighbours in it
        [adverts[0], *others]
        for others in itertools.combinations(adverts[1:], 4)
        if len(
            rnd.config.graph(advert_seed(a.signed_payload() for a in [adverts[0], *others]))[
                "client-000"
            ]
            & {a.client_id for a in others}
        )
        >= 3
    )
    # Execute / Assert
    with pytest.raises(PrivacyError, match="refuses an advertisement set of 5 clients.*at least 6"):
        rnd.clients["client-000"].share_keys(shown)


def test_clients_shown_different_advertisement_sets_do_not_accept_each_others_signatures() -> None:
    # Prepare: SecAgg, n = 5, t = 3 (4 signatures needed when c = 1); the server hides
    # client-004's advertisement from client-000 (so their statements' U1 digests differ)
    config = dataclasses.replace(_config(5, 3), corrupt=1)
    rnd = Round.start(config, d=3)
    adverts = {u: rnd.advert(u) for u in config.cohort}
    inbox: dict[str, list[EncryptedShare]] = {u: [] for u in config.cohort}
    for u in config.cohort:
        shown = [a for v, a in adverts.items() if u != "client-000" or v != "client-004"]
        for share in rnd.clients[u].share_keys(shown):
            if not (u == "client-004" and share.receiver == "client-000"):
                inbox[share.receiver].append(share)
    for u in config.cohort:
        rnd.clients[u].masked_input(inbox[u], rnd.updates[u])
    request = UnmaskRequest(ROUND, config.cohort, ())
    with pytest.raises(ProtocolError, match="did not advertise keys: \\['client-004'\\]"):
        rnd.clients["client-000"].sign_survivors(request)  # 004 is not in its U1
    shorter = UnmaskRequest(ROUND, config.cohort[:4], ("client-004",))
    unaware = UnmaskRequest(ROUND, config.cohort[:4], ())  # for client-000: same U3
    sigs = {u: rnd.clients[u].sign_survivors(shorter) for u in config.cohort[1:4]}
    sigs["client-000"] = rnd.clients["client-000"].sign_survivors(unaware)
    # Execute / Assert: the four signed the same U3, but over two different U1 digests
    with pytest.raises(ConsistencyFailed, match="signature of 'client-001' does not verify"):
        rnd.clients["client-000"].unmask(unaware, [sigs["client-000"], sigs["client-001"]])
    with pytest.raises(ConsistencyFailed, match="only 1 survivors signed"):
        rnd.clients["client-000"].unmask(unaware, [sigs["client-000"]])
    with pytest.raises(ConsistencyFailed, match="only 3 survivors signed.*fewer than the 4"):
        rnd.clients["client-001"].unmask(shorter, [sigs[u] for u in config.cohort[1:4]])
    digest = advert_set_digest(adverts.values(), config.cohort)
    assert digest != advert_set_digest(
        (a for v, a in adverts.items() if v != "client-004"), config.cohort
    )
    assert digest != advert_set_digest(adverts.values(), (*config.cohort, "client-005"))


def test_the_server_refuses_a_bad_signature_naming_its_signer_and_goes_on() -> None:
    # Prepare: SecAgg, n = 5, t = 3; everyone sent its masked input
    rnd = Round.start(_config(5, 3), d=3)
    request = rnd.masked({})
    forged = Ed25519PrivateKey.generate().sign(b"anything")
    # Execute / Assert: a signature by another key, one from a non-survivor, a repeat
    with pytest.raises(ConsistencyFailed, match="signature of 'client-002' does not verify"):
        rnd.server.add_consistency(ConsistencySignature("client-002", ROUND, forged))
    good = rnd.clients["client-002"].sign_survivors(request)
    rnd.server.add_consistency(good)
    with pytest.raises(ProtocolError, match="'client-002' sent its consistency signature twice"):
        rnd.server.add_consistency(good)
    for u in ("client-000", "client-001", "client-003", "client-004"):
        rnd.server.add_consistency(rnd.clients[u].sign_survivors(request))
    signatures = rnd.server.route_signatures()
    for u in rnd.server.signers:
        rnd.server.add_unmask_response(rnd.clients[u].unmask(request, signatures))
    assert rnd.server.finish().size == 3
