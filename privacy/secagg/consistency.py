"""The consistency round (Bonawitz et al., CCS 2017, Round 3 *ConsistencyCheck*).

Against a malicious server. After the masked inputs, the server sends each survivor the
survivor set ``U3``; each signs, with its long-term Ed25519 identity key, the statement
(:func:`statement`)

    DOMAIN "consistency-check" || round id || digest of the advertisement set U1 it saw
                                || the sorted ids of U3

and the server relays the signatures it collected. A client reveals no share until it holds
valid signatures on exactly its own statement from at least :func:`signature_threshold`
distinct survivors, and it signs one statement per round. Two different statements (two
survivor sets, or two advertisement sets shown to different clients) would then need more
than ``n + c`` signatures between them while at most ``(n - c) + 2c`` exist (honest clients
sign once, the ``c`` corrupt ones may sign both), so every honest client that reveals acts
on the same ``U3``: it reveals shares of ``b_u`` exactly for ``u`` in ``U3`` and shares of
``s_u^SK`` only for its neighbours outside ``U3``, and no client's two secrets can both be
rebuilt from honest shares. ``n`` is the size of the round's cohort, not of ``U1``: the
server picks ``U1`` per client, so a threshold on ``|U1|`` would let two small views each
gather their own majority (see docs/secure-aggregation.md, "Against a malicious server").
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fl_secure.errors import PrivacyError, ProtocolError, RoundAborted
from privacy.secagg.codec import (
    DOMAIN,
    KIND_CONSISTENCY,
    MAX_ROUND_ID_BYTES,
    Reader,
    Writer,
    length_prefixed,
)
from privacy.secagg.graph import describe_groups, survivor_groups
from privacy.secagg.messages import AdvertiseKeys, UnmaskRequest

if TYPE_CHECKING:
    from privacy.secagg.config import SecAggConfig

SIGNATURE_BYTES = 64


class ConsistencyFailed(PrivacyError):
    """A client's consistency check failed: it reveals nothing in this round."""


def signature_threshold(n: int, corrupt: int) -> int:
    """The fewest signatures a client accepts: ``floor((n + c) / 2) + 1``, above ``(n + c) / 2``.

    Args:
        n: The cohort's size.
        corrupt: ``c``, the most clients of the cohort that may collude with the server.
    """
    return (n + corrupt) // 2 + 1


def advert_set_digest(adverts: Iterable[AdvertiseKeys], cohort: Iterable[str]) -> bytes:
    """SHA-256 of the round's cohort and a set of signed advertisements (the ``U1`` a client saw).

    The cohort (from the round's setup) is bound too, so clients given different setups under
    one round id never count each other's signatures.
    """
    ordered = sorted(adverts, key=lambda a: a.client_id)
    members = length_prefixed(*(u.encode("utf-8") for u in sorted(cohort)))
    return hashlib.sha256(
        DOMAIN + b"advert-set" + length_prefixed(members, *(a.to_bytes() for a in ordered))
    ).digest()


def statement(round_id: bytes, u1_digest: bytes, survivors: Collection[str]) -> bytes:
    """The bytes a client signs: context, round id, ``U1`` digest, sorted ``U3``."""
    ids = sorted(survivors)
    return (
        DOMAIN
        + b"consistency-check"
        + length_prefixed(round_id, u1_digest, len(ids).to_bytes(4, "big"))
        + length_prefixed(*(u.encode("utf-8") for u in ids))
    )


@dataclass(frozen=True)
class ConsistencySignature:
    """One survivor's signature over its consistency :func:`statement`.

    Attributes:
        client_id: The signer.
        round_id: The round.
        signature: Ed25519 signature by the signer's enrolled identity key.
    """

    client_id: str
    round_id: bytes
    signature: bytes

    def to_bytes(self) -> bytes:
        """Serialise (the codec of :mod:`privacy.secagg.codec`)."""
        w = Writer(KIND_CONSISTENCY).text(self.client_id).blob(self.round_id)
        return w.blob(self.signature).done()

    @classmethod
    def from_bytes(cls, data: bytes) -> ConsistencySignature:
        """Parse strictly; raises ProtocolError on any deviation from the format."""
        r = Reader(data, KIND_CONSISTENCY, "ConsistencySignature")
        out = cls(
            client_id=r.text("client_id"),
            round_id=r.blob("round_id", max_len=MAX_ROUND_ID_BYTES),
            signature=r.blob("signature", exact=SIGNATURE_BYTES),
        )
        r.end()
        return out


def verify_signature(
    sig: ConsistencySignature,
    signed: bytes,
    round_id: bytes,
    registry: Mapping[str, Ed25519PublicKey],
) -> None:
    """Check one signature over the statement ``signed``.

    Raises:
        ProtocolError: If it is for another round or from a client the registry lacks.
        ConsistencyFailed: If it does not verify (naming its signer).
    """
    if sig.round_id != round_id:
        raise ProtocolError(f"the consistency signature of {sig.client_id!r} is for another round")
    key = registry.get(sig.client_id)
    if key is None:
        raise ProtocolError(f"consistency signature of {sig.client_id!r}, which is not enrolled")
    try:
        key.verify(sig.signature, signed)
    except InvalidSignature as exc:
        raise ConsistencyFailed(
            f"the consistency signature of {sig.client_id!r} does not verify over this round's "
            "survivor set and advertisement set (it signed other sets, or it is forged)"
        ) from exc


def check_signatures(
    signatures: Sequence[ConsistencySignature],
    signed: bytes,
    *,
    round_id: bytes,
    survivors: Collection[str],
    registry: Mapping[str, Ed25519PublicKey],
    needed: int,
    who: str,
) -> frozenset[str]:
    """The signers, once at least ``needed`` distinct survivors signed ``signed``.

    Every signature must verify over the same statement (a server relays only those it
    verified, so one that does not is proof that clients were shown different sets).

    Returns:
        The set of signers.

    Raises:
        ProtocolError: A signature repeated, from a non-survivor, or malformed.
        ConsistencyFailed: A signature does not verify, or fewer than ``needed`` signers.
    """
    signers: set[str] = set()
    for sig in signatures:
        if sig.client_id in signers:
            raise ProtocolError(f"two consistency signatures of {sig.client_id!r}")
        if sig.client_id not in survivors:
            raise ProtocolError(
                f"consistency signature of {sig.client_id!r}, which is not in the survivor set"
            )
        verify_signature(sig, signed, round_id, registry)
        signers.add(sig.client_id)
    if len(signers) < needed:
        raise ConsistencyFailed(
            f"{who!r} refuses to unmask: only {len(signers)} survivors signed the survivor set, "
            f"fewer than the {needed} the consistency check needs (more than half of the "
            "cohort plus its corrupt allowance); the server may have shown clients different sets"
        )
    return frozenset(signers)


def check_survivor_set(
    request: UnmaskRequest,
    config: SecAggConfig,
    client_id: str,
    u1: Collection[str],
    graph: Mapping[str, frozenset[str]],
) -> None:
    """What a client checks before it signs a survivor set (and so before it reveals).

    Args:
        request: The server's request: ``U3`` and the clients it counts as dropped.
        config: The round's configuration.
        client_id: The checking client.
        u1: The clients whose advertisements it received.
        graph: The round's graph as it derived it.

    Raises:
        PrivacyError: If the request would reveal both shares of a client, counts this
            client as dropped, lists fewer than the fewest inputs, or splits the survivors.
        ProtocolError: If the request is malformed or names a client that did not advertise.
        RoundAborted: If fewer than ``t`` survivors are listed.
    """
    if request.round_id != config.round_id:
        raise ProtocolError("unmask request is for another round")
    survivors, dropped = set(request.survivors), set(request.dropped)
    if len(survivors) != len(request.survivors) or len(dropped) != len(request.dropped):
        raise ProtocolError("unmask request lists a client twice")
    unknown = (survivors | dropped) - set(u1)
    if unknown:
        raise ProtocolError(
            f"unmask request names clients that did not advertise keys: {sorted(unknown)}"
        )
    both = sorted(survivors & dropped)
    if both:
        raise PrivacyError(
            f"{client_id!r} refuses to reveal shares of both the self mask b_u and the "
            f"mask key s_u^SK of {', '.join(map(repr, both))}: that would expose the input"
        )
    if client_id not in survivors:
        raise PrivacyError(
            f"the server lists {client_id!r} as dropped although it sent its masked "
            "input; refusing to help reconstruct its mask key"
        )
    t = config.threshold
    if len(survivors) < t:
        raise RoundAborted(f"only {len(survivors)} survivors, fewer than t = {t}")
    if len(survivors) < config.min_inputs:
        raise PrivacyError(
            f"{client_id!r} refuses to unmask a sum of {len(survivors)} inputs: the round "
            f"needs at least {config.min_inputs} (under distributed DP, the noise shares the "
            "sum must carry)"
        )
    groups = survivor_groups(dict(graph), survivors)
    if len(groups) > 1:
        raise PrivacyError(
            f"{client_id!r} refuses to unmask: the survivors split into {len(groups)} groups "
            f"no pairwise mask joins ({describe_groups(groups)}), so the server would learn "
            "each group's own sum"
        )
