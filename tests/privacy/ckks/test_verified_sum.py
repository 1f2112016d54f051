"""A CKKS decryptor opens only a sum of signed uploads it checked itself, and floods the output.

Every test drives the decryptor's real code (:func:`privacy.ckks.client_round.
client_ckks_update`) with the request a (possibly malicious) server sends it.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections import OrderedDict

import numpy as np
import pytest
import tenseal as ts
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fl_secure.config import SecureAggregationConfig
from fl_secure.errors import ConfigError, PrivacyError, ProtocolError, RoundAborted
from fl_secure.messages import Tensors, TensorSpec
from privacy.ckks.client_round import CkksMember, client_ckks_update
from privacy.ckks.context import CkksParams, make_secret_context, public_context
from privacy.ckks.encryption import decrypt_sum, encrypt_update
from privacy.ckks.flooding import MAX_FLOODING_STD, error_bound, flooding_std
from privacy.ckks.round_setup import CkksSetup
from privacy.ckks.server_round import ServerCkksRound, answers_agree
from privacy.ckks.signed import SignedUpload, decode_bundle, encode_bundle
from privacy.secagg.stages import MASKED, UNMASK

IDS = [f"client-{i}" for i in range(6)]
SPECS = [
    TensorSpec("w", np.dtype(np.float64), (50, 100)),  # 5000 values: two ciphertexts
    TensorSpec("b", np.dtype(np.float64), (7,)),
]
KEYS = {c: Ed25519PrivateKey.generate() for c in IDS}
REGISTRY = {c: k.public_key() for c, k in KEYS.items()}


@pytest.fixture(scope="module")
def secret_ctx() -> bytes:
    return make_secret_context()


def _setup(min_count: int = 3, cohort: tuple[str, ...] = tuple(IDS[:5])) -> CkksSetup:
    return CkksSetup(
        round_id=secrets.token_bytes(16), cohort=cohort, layers=None, min_count=min_count
    )


def _update(seed: int) -> Tensors:
    rng = np.random.default_rng(seed)
    return OrderedDict((s.name, rng.normal(0, 1e-2, s.shape).astype(s.dtype)) for s in SPECS)


def _flat(tensors: Tensors) -> np.ndarray:
    return np.concatenate([np.asarray(v, np.float64).ravel() for v in tensors.values()])


def _upload(
    secret_ctx: bytes, setup: CkksSetup, client: str, seed: int, *, round_id: bytes | None = None
) -> bytes:
    """``client``'s signed upload of update ``seed`` for ``setup``'s round (or another)."""
    data = encrypt_update(_update(seed), secret_ctx).to_bytes()
    rid = setup.round_id if round_id is None else round_id
    return SignedUpload.sign(KEYS[client], client, rid, data).to_bytes()


def _decrypt_as(
    secret_ctx: bytes, setup: CkksSetup, client: str, seed: int, request: bytes
) -> np.ndarray | None:
    """Run ``client``'s side of the round, the server answering with ``request``.

    Returns what the client sent back at unmasking (None: nothing).
    """
    sent: dict[int, bytes] = {}

    def exchange(stage: int, payload: bytes) -> bytes:
        if stage == MASKED:
            return request
        sent[stage] = payload
        return b"ok"

    member = CkksMember(client, KEYS[client], REGISTRY, min_clients=3)
    client_ckks_update(setup, secret_ctx, member, exchange, lambda: _update(seed), lambda v: None)
    answer = sent.get(UNMASK)
    return None if answer is None else np.frombuffer(answer, "<f8")


class Decryptor:
    """A chosen decryptor whose own upload is fixed first, so a bundle can include it."""

    def __init__(self, secret_ctx: bytes, setup: CkksSetup, client: str, seed: int) -> None:
        self.secret_ctx, self.setup, self.client, self.seed = secret_ctx, setup, client, seed

    def open(self, others: list[bytes], *, min_clients: int = 3, own_first: bool = True):
        """Run the client's round; the server answers with its upload and ``others``."""
        return self._run(others, min_clients, own_first)

    def _run(self, others: list[bytes], min_clients: int, own_first: bool) -> np.ndarray:
        # the client encrypts afresh at every call: its own upload in the bundle is the one
        # it sent in this call
        sent: dict[int, bytes] = {}
        uploaded: list[bytes] = []

        def exchange(stage: int, payload: bytes) -> bytes:
            if stage == MASKED:
                mine = uploaded[0]
                return encode_bundle([mine, *others] if own_first else others)
            sent[stage] = payload
            return b"ok"

        member = CkksMember(self.client, KEYS[self.client], REGISTRY, min_clients=min_clients)
        client_ckks_update(
            self.setup,
            self.secret_ctx,
            member,
            exchange,
            lambda: _update(self.seed),
            lambda v: uploaded.append(v.tobytes()),
        )
        return np.frombuffer(sent[UNMASK], "<f8")


# ------------------------------------------------------------------- (1) the forged sum
def test_a_forged_sum_of_one_victims_ciphertexts_is_not_decrypted(secret_ctx: bytes) -> None:
    # Prepare: the victim's (client-1's) encrypted update; what a decryptor would return if it
    # opened the victim's ciphertexts is the victim's update itself (the attack's payoff)
    setup = _setup(min_count=3)
    victim = encrypt_update(_update(1), secret_ctx)
    payoff = _flat(decrypt_sum(victim, secret_ctx))
    assert np.abs(payoff - _flat(_update(1))).max() < 1e-9
    forged_sum = dataclasses.replace(victim, count=5).to_bytes()  # "a sum of 5 updates"
    signed_victim = SignedUpload.sign(KEYS["client-1"], "client-1", setup.round_id,
                                      victim.to_bytes()).to_bytes()  # fmt: skip
    # the server's own ciphertexts (it has no client's key: signed by a key it made)
    impostor = Ed25519PrivateKey.generate()
    padded = [
        SignedUpload.sign(impostor, c, setup.round_id, victim.to_bytes()).to_bytes()
        for c in ("client-2", "client-3")
    ]
    decryptor = Decryptor(secret_ctx, setup, "client-0", 0)
    # Execute / Assert: the server's "sum" claiming count 5 is not even parsed as a request
    with pytest.raises(ProtocolError, match="not a bundle"):
        _decrypt_as(secret_ctx, setup, "client-0", 0, forged_sum)
    # ... the victim's signed upload five times: duplicates
    with pytest.raises(PrivacyError, match="second one from 'client-1'"):
        decryptor.open([signed_victim] * 4)
    # ... the victim's ciphertexts under other clients' names: not their signatures
    with pytest.raises(PrivacyError, match="'client-2' is not signed by its enrolled key"):
        decryptor.open([signed_victim, *padded])
    # ... the victim's ciphertexts alone, without the decryptor's own
    with pytest.raises(PrivacyError, match="do not include this client's own"):
        decryptor.open([signed_victim], own_first=False, min_clients=1)


# --------------------------------------------------- (2) other rounds, duplicates, members
def test_uploads_of_another_round_or_a_duplicate_or_an_outsider_are_refused(
    secret_ctx: bytes,
) -> None:
    # Prepare: a round over client-0..4; uploads of client-1..3
    setup = _setup(min_count=3)
    decryptor = Decryptor(secret_ctx, setup, "client-0", 0)
    good = [_upload(secret_ctx, setup, c, i) for i, c in enumerate(IDS[1:4], start=1)]
    earlier_attempt = secrets.token_bytes(16)
    replayed = _upload(secret_ctx, setup, "client-4", 4, round_id=earlier_attempt)
    outsider = _upload(secret_ctx, setup, "client-5", 5)  # enrolled, not in the cohort
    parsed = SignedUpload.from_bytes(good[0])
    tampered = dataclasses.replace(parsed, update=parsed.update[:-40] + bytes(40)).to_bytes()
    # Execute / Assert: the honest bundle is opened
    assert decryptor.open(good).shape == (5007,)
    with pytest.raises(PrivacyError, match=f"signed for round id {earlier_attempt.hex()}"):
        decryptor.open([*good, replayed])
    with pytest.raises(PrivacyError, match="second one from 'client-2'"):
        decryptor.open([good[0], good[1], good[1]])
    with pytest.raises(PrivacyError, match="'client-5', who is not in this round's cohort"):
        decryptor.open([*good, outsider])
    with pytest.raises(PrivacyError, match="'client-1' is not signed by its enrolled key"):
        decryptor.open([tampered, *good[1:]])


# ------------------------------------------------------------ (3) too few distinct clients
def test_fewer_than_the_minimum_distinct_clients_are_refused(secret_ctx: bytes) -> None:
    # Prepare: min_count 3 in the setup; the run config may ask for more (server.min_clients)
    setup = _setup(min_count=3)
    decryptor = Decryptor(secret_ctx, setup, "client-0", 0)
    others = [_upload(secret_ctx, setup, c, i) for i, c in enumerate(IDS[1:5], start=1)]
    # Execute / Assert: 2 < 3 distinct clients
    with pytest.raises(PrivacyError, match="sum of 2 distinct clients' updates, fewer than 3"):
        decryptor.open(others[:1])
    # 4 < server.min_clients = 5 of the run config, although the setup asks only for 3
    with pytest.raises(PrivacyError, match="sum of 4 distinct clients' updates, fewer than 5"):
        decryptor.open(others[:3], min_clients=5)
    assert decryptor.open(others[:2]).shape == (5007,)  # 3 of 3: opened
    # never the decryptor's own update alone, whatever the minimum
    lax = Decryptor(secret_ctx, _setup(min_count=1), "client-0", 0)
    with pytest.raises(PrivacyError, match="sum of 1 distinct clients' updates, fewer than 2"):
        lax.open([], min_clients=1)
    # more uploads than the cohort holds are refused before any is parsed
    with pytest.raises(ProtocolError, match="more than the 5 of the cohort"):
        decode_bundle(encode_bundle([b"x"] * 6), max_count=5)


# ------------------------------------------------------- (4) accuracy and fresh flooding
def test_the_flooded_sum_is_accurate_and_its_noise_is_fresh(secret_ctx: bytes) -> None:
    # Prepare: client-0 and client-1 both decrypt the sum of client-0..3
    setup = _setup(min_count=4)
    others = {c: _upload(secret_ctx, setup, c, i) for i, c in enumerate(IDS[:4])}
    expected = sum(_flat(_update(i)) for i in range(4))
    ctx = ts.context_from(secret_ctx)
    std = flooding_std(ctx, summed=4, ciphertexts=2, bits=40)
    # Execute
    first = Decryptor(secret_ctx, setup, "client-0", 0).open(
        [u for c, u in others.items() if c != "client-0"]
    )
    second = Decryptor(secret_ctx, setup, "client-1", 1).open(
        [u for c, u in others.items() if c != "client-1"]
    )
    # Assert: the flooding noise is the documented one: 2^40 x the error bound, ~1e-12 here
    assert std == pytest.approx(2.0**40 * error_bound(8192, 2.0**100, 4, 2), rel=1e-12)
    assert 1e-13 < std < 1e-11
    for answer in (first, second):
        error = answer - expected
        assert np.abs(error).max() <= 7 * std  # 5007 values: P(max > 7 sigma) < 1e-8
        assert np.std(error) == pytest.approx(std, rel=0.1)  # the noise is there, at std
    # fresh noise: the two decryptions differ, by noise of std sqrt(2) x std
    assert not np.array_equal(first, second)
    assert np.std(first - second) == pytest.approx(math.sqrt(2) * std, rel=0.1)
    assert answers_agree(first, second, SPECS, std)
    assert not answers_agree(first, second + 1e-9, SPECS, std)  # a lie of 1e-9 is seen


# --------------------------------------------------------------- the bound and the scale
def test_the_error_bound_holds_and_a_small_scale_is_refused() -> None:
    # Prepare: at scale 2^40 the decryption error is measurable (~1e-9 per value)
    small = make_secret_context(CkksParams(scale_bits=40))
    ctx = ts.context_from(small)
    rng = np.random.default_rng(0)
    values = [rng.normal(0, 1e-2, 4096) for _ in range(5)]
    total = ts.ckks_vector(ctx, values[0])
    for v in values[1:]:
        total += ts.ckks_vector(ctx, v)
    # Execute
    error = np.linalg.norm(np.asarray(total.decrypt()) - np.sum(values, axis=0))
    bound = error_bound(8192, 2.0**40, 5, 1)
    # Assert: the bound holds, and is not vacuous (within ~50x of the measured error)
    assert 0 < error <= bound < 100 * error
    with pytest.raises(PrivacyError, match="too small a scale"):
        flooding_std(ctx, summed=5, ciphertexts=1, bits=40)
    default = ts.context_from(make_secret_context())
    assert flooding_std(default, summed=1000, ciphertexts=2500, bits=40) < MAX_FLOODING_STD


def test_flooding_bits_are_validated() -> None:
    assert SecureAggregationConfig().ckks_flooding_bits == 40
    for bad in (8, 129, 40.5):
        with pytest.raises(ConfigError, match="ckks_flooding_bits"):
            SecureAggregationConfig(ckks_flooding_bits=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the server's checks
def test_the_server_refuses_unsigned_or_misattributed_uploads_naming_the_client(
    secret_ctx: bytes,
) -> None:
    # Prepare
    setup = _setup(min_count=2, cohort=tuple(IDS[:3]))
    server = ServerCkksRound(
        setup, public_context(secret_ctx), SPECS, 60.0, registry=REGISTRY, flooding_bits=40
    )
    plain = encrypt_update(_update(0), secret_ctx).to_bytes()  # today's unsigned upload
    as_other = _upload(secret_ctx, setup, "client-1", 1)
    other_round = _upload(secret_ctx, setup, "client-0", 0, round_id=bytes(16))
    forged = SignedUpload.sign(Ed25519PrivateKey.generate(), "client-0", setup.round_id, plain)

    def add(client: str, data: bytes) -> None:
        server.add_masked(client, np.frombuffer(data, np.uint8))

    # Execute / Assert
    for data, why in (
        (plain, "not a signed CKKS upload"),
        (as_other, "signed as 'client-1'"),
        (other_round, "for round id 0000"),
        (forged.to_bytes(), "not signed by its enrolled key"),
    ):
        with pytest.raises(ProtocolError, match=f"update from client-0 refused: .*{why}"):
            add("client-0", data)
    mine = _upload(secret_ctx, setup, "client-0", 0)
    add("client-0", mine)
    add("client-1", as_other)
    server.close_stage()
    # the decryptors get the survivors' signed uploads, not a sum
    assert decode_bundle(server.payload, max_count=3) == [mine, as_other]
    assert server.flooding_std == flooding_std(
        ts.context_from(secret_ctx), summed=2, ciphertexts=2, bits=40
    )


def test_decryptors_that_disagree_beyond_the_noise_abort(secret_ctx: bytes) -> None:
    # Prepare: a round with two decryptors over three uploads
    setup = dataclasses.replace(_setup(min_count=3, cohort=tuple(IDS[:3])), decryptors=2)
    server = ServerCkksRound(setup, public_context(secret_ctx), SPECS, 60.0, registry=REGISTRY)
    for i, c in enumerate(IDS[:3]):
        server.add_masked(c, np.frombuffer(_upload(secret_ctx, setup, c, i), np.uint8))
    server.close_stage()
    a, b = server.chosen
    total = sum(_flat(_update(i)) for i in range(3))
    std = server.flooding_std
    rng = np.random.default_rng(0)
    # Execute / Assert: two honest answers (fresh noise each) are accepted ...
    server.submit(UNMASK, a, (total + rng.normal(0, std, total.size)).tobytes())
    server.submit(UNMASK, b, (total + rng.normal(0, std, total.size)).tobytes())
    server.close_stage()
    assert np.abs(server.decoded_sum() - total).max() < 10 * std
    # ... an answer shifted by 1e-9 in one value is not
    liar = ServerCkksRound(setup, public_context(secret_ctx), SPECS, 60.0, registry=REGISTRY)
    for i, c in enumerate(IDS[:3]):
        liar.add_masked(c, np.frombuffer(_upload(secret_ctx, setup, c, i), np.uint8))
    liar.close_stage()
    shifted = total.copy()
    shifted[17] += 1e-9
    a, b = liar.chosen
    liar.submit(UNMASK, a, total.tobytes())
    liar.submit(UNMASK, b, shifted.tobytes())
    with pytest.raises(RoundAborted, match="returned different sums"):
        liar.close_stage()


def test_the_signed_upload_format_is_strict() -> None:
    signed = SignedUpload.sign(KEYS["client-0"], "client-0", bytes(16), b"update")
    data = signed.to_bytes()
    assert SignedUpload.from_bytes(data) == signed
    for bad, why in (
        (data[:-1], "truncated"),
        (data + b"\x00", "unexpected bytes"),
        (b"FLSCKSX\x00" + data[8:], "bad magic"),
        (data[:8] + b"\x00\x02" + data[10:], "format version 2"),
    ):
        with pytest.raises(ProtocolError, match=why):
            SignedUpload.from_bytes(bad)
    short_id = dataclasses.replace(signed, round_id=bytes(8)).to_bytes()
    with pytest.raises(ProtocolError, match="round id of 8 bytes"):
        SignedUpload.from_bytes(short_id)


def test_a_bundle_over_the_message_limit_aborts_the_round(
    secret_ctx: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a limit below the bundle of two uploads (the real one is the client's 1 GiB
    # receive limit);
    # patched where the server round reads it (another test may have re-imported the module)
    from privacy.ckks import server_round

    setup = _setup(min_count=2, cohort=tuple(IDS[:2]))
    server = ServerCkksRound(setup, public_context(secret_ctx), SPECS, 60.0, registry=REGISTRY)
    uploads = [_upload(secret_ctx, setup, c, i) for i, c in enumerate(IDS[:2])]
    for c, u in zip(IDS[:2], uploads, strict=True):
        server.add_masked(c, np.frombuffer(u, np.uint8))
    # (uploads differ in size: TenSEAL compresses them; the bundle adds length prefixes)
    limit = sum(len(u) for u in uploads)
    monkeypatch.setattr(server_round.signed_format, "MAX_BUNDLE_BYTES", limit)
    # Execute / Assert
    with pytest.raises(RoundAborted, match="more than the .* a decryptor is sent"):
        server.close_stage()


def test_a_server_refuses_at_startup_a_context_too_small_for_the_flooding(tmp_path) -> None:
    # Prepare: contexts made with the earlier default scale 2^40, and with today's
    from fl_secure.config import config_from_dict
    from privacy.ckks.keys import write_ckks_keys
    from server.bootstrap import _ckks_public_context

    config = config_from_dict({"secure_aggregation": {"scheme": "ckks"}})
    write_ckks_keys(tmp_path / "old", CkksParams(scale_bits=40))
    write_ckks_keys(tmp_path / "new")
    # Execute / Assert
    with pytest.raises(ConfigError, match="too small a scale"):
        _ckks_public_context(config, tmp_path / "old")
    assert _ckks_public_context(config, tmp_path / "new")
