"""The server's side of one secure round over the wire: stages, deadlines, the protocol.

:class:`ServerSecureRound` holds the server's :class:`~privacy.secagg.server.SecAggServer`
and the stage bookkeeping (:class:`~privacy.secagg.stages.StagedRound`): which stage is open,
its deadline, who answered; a stage closes when everyone expected has answered or its
deadline passes, and the late ones count as dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fl_secure.errors import PrivacyError, ProtocolError, RoundAborted
from fl_secure.messages import TensorSpec
from privacy.dp.discrete_gaussian import ddg_decode
from privacy.secagg.consistency import ConsistencySignature
from privacy.secagg.messages import (
    AdvertiseKeys,
    EncryptedShare,
    MaskedInput,
    UnmaskRequest,
    UnmaskResponse,
)
from privacy.secagg.round_setup import RoundSetup, ddg_peak
from privacy.secagg.server import SecAggServer
from privacy.secagg.stages import (
    ADVERTISE,
    CONSISTENCY,
    MASKED,
    MASKED_TENSOR,
    SHARE,
    STAGE_NAMES,
    UNMASK,
    StagedRound,
    pack,
    unpack,
    wire_dtype,
)


@dataclass
class ServerSecureRound(StagedRound):
    """The server's side of one secure round: stages, deadlines, the protocol state."""

    setup: RoundSetup
    registry: Mapping[str, Ed25519PublicKey]
    stage_timeout: float
    clock: Callable[[], float] = time.monotonic
    stage: int = ADVERTISE
    deadline: float = 0.0
    answered: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)
    routed: dict[str, bytes] = field(default_factory=dict)
    unmask_payload: bytes = b""
    signatures_payload: bytes = b""  # the consistency signatures relayed to the signers
    aborted: str = ""
    dropped: dict[str, str] = field(default_factory=dict)  # client -> the stage it missed
    result: np.ndarray | None = None
    decoded: np.ndarray | None = None  # the float64 sum, decoded when unmasking closes

    def __post_init__(self) -> None:
        self.server = SecAggServer(self.setup.config(), self.registry, self.setup.vector_length)
        self.deadline = self.clock() + self.stage_timeout

    @property
    def upload_specs(self) -> list[TensorSpec]:
        """What a masked upload must contain."""
        return [TensorSpec(MASKED_TENSOR, wire_dtype(self.setup), (self.setup.vector_length,))]

    @property
    def max_upload_bytes(self) -> int:
        """Bytes of a masked upload."""
        return sum(s.num_bytes for s in self.upload_specs)

    def record(self) -> dict[str, object]:
        """The round record's scheme-specific fields (reports read them)."""
        setup = self.setup
        return {
            "scheme": "secagg" if setup.neighbours == 0 else "secagg+",
            "cohort": list(setup.cohort),
            "neighbours": setup.neighbours or len(setup.cohort) - 1,
            "threshold": setup.threshold,
            "modulus_bits": setup.modulus_bits,
        }

    def expected(self) -> set[str]:
        """Who must answer the open stage."""
        if self.stage == ADVERTISE:
            return set(self.setup.cohort)
        if self.stage == SHARE:
            return set(self.routed)
        if self.stage == CONSISTENCY:
            return set(self.server.survivors)
        return set(self.server.signers) if self.stage == UNMASK else set()

    def submit(self, stage: int, client_id: str, payload: bytes) -> None:
        """One client's message of ``stage`` (advertise, share, signature or unmask reply)."""
        if self.aborted:
            raise RoundAborted(self.aborted)
        if stage != self.stage:
            raise ProtocolError(
                f"{STAGE_NAMES.get(stage, stage)} message from {client_id} while the round is "
                f"at {STAGE_NAMES[self.stage]}"
            )
        if client_id in self.answered:
            raise ProtocolError(f"client {client_id} already answered {STAGE_NAMES[stage]}")
        if stage == ADVERTISE:
            advert = AdvertiseKeys.from_bytes(payload)
            if advert.client_id != client_id:
                raise ProtocolError(f"{client_id} sent the advertisement of {advert.client_id!r}")
            self.server.add_advert(advert)
        elif stage == SHARE:
            shares = [EncryptedShare.from_bytes(b) for b in unpack(payload, "shares")]
            self.server.add_shares(client_id, shares)
        elif stage == CONSISTENCY:
            try:
                sig = ConsistencySignature.from_bytes(payload)
                if sig.client_id != client_id:
                    raise ProtocolError(f"it sent the signature of {sig.client_id!r}")
                self.server.add_consistency(sig)
            except (ProtocolError, PrivacyError) as exc:  # this client alone is refused
                raise type(exc)(f"consistency signature from {client_id} refused: {exc}") from exc
        elif stage == UNMASK:
            response = UnmaskResponse.from_bytes(payload)
            if response.client_id != client_id:
                raise ProtocolError(f"{client_id} sent the unmask reply of {response.client_id!r}")
            self.server.add_unmask_response(response)
        else:
            raise ProtocolError(f"no messages are taken at {STAGE_NAMES.get(stage, stage)}")
        self.answered.add(client_id)

    def add_masked(self, client_id: str, vector: np.ndarray) -> None:
        """A masked input uploaded through ``SubmitUpdate``."""
        if self.aborted:
            raise RoundAborted(self.aborted)
        if self.stage != MASKED:
            raise ProtocolError(f"masked input from {client_id} outside the masked-input stage")
        masked = MaskedInput(client_id, self.setup.round_id, self.setup.modulus_bits, vector)
        self.server.add_masked_input(masked)

    def close_stage(self) -> None:
        """Close the open stage: route its messages, record who dropped, open the next."""
        self._close(self._route, "secure aggregation")

    def _route(self) -> None:
        if self.stage == ADVERTISE:
            routed = self.server.route_adverts()
            # every client gets the same set (the graph's seed): each distinct set packed once
            packed: dict[int, bytes] = {}  # id of the tuple (kept alive by ``routed``)
            self.routed = {}
            for c, ads in routed.items():
                if id(ads) not in packed:
                    packed[id(ads)] = pack([a.to_bytes() for a in ads])
                self.routed[c] = packed[id(ads)]
        elif self.stage == SHARE:
            shares = self.server.route_shares()
            self.routed = {c: pack([s.to_bytes() for s in sh]) for c, sh in shares.items()}
        elif self.stage == MASKED:
            request: UnmaskRequest = self.server.unmask_request()
            self.unmask_payload = request.to_bytes()
        elif self.stage == CONSISTENCY:
            signatures = self.server.route_signatures()
            self.signatures_payload = pack([s.to_bytes() for s in signatures])
        elif self.stage == UNMASK:  # decoded here, so a corrupted sum aborts the attempt
            self.result = self.server.finish()
            self.decoded = self._decode(self.result)

    def reply(self, stage: int, client_id: str) -> bytes:
        """What ``client_id`` receives once ``stage`` has closed."""
        if self.aborted:
            raise RoundAborted(self.aborted)
        if stage in (ADVERTISE, SHARE):
            if client_id not in self.routed:
                raise ProtocolError(f"client {client_id} was dropped from the secure round")
            return self.routed[client_id]
        if stage == MASKED:
            return self.unmask_payload
        if stage == CONSISTENCY:
            if client_id not in self.server.signers:
                raise ProtocolError(f"client {client_id} did not sign the survivor set in time")
            return self.signatures_payload
        return b"ok"

    def survivors(self) -> tuple[str, ...]:
        """Clients whose input is in the sum."""
        return self.server.survivors

    def sum_seen(self) -> bool:
        """Whether the server has unmasked the sum (even one it then could not decode)."""
        return self.result is not None

    def decoded_sum(self) -> np.ndarray:
        """The float64 sum of the survivors' (clipped, fixed-point) updates."""
        if self.decoded is None:
            raise RoundAborted(self.aborted or "the secure round has no result")
        return self.decoded

    def _decode(self, total: np.ndarray) -> np.ndarray:
        """The unmasked sum as floats (:func:`decode_total`)."""
        return decode_total(self.setup, total, len(self.server.survivors))


def decode_total(setup: RoundSetup, total: np.ndarray, m: int) -> np.ndarray:
    """The unmasked sum of ``m`` inputs as floats; :class:`ProtocolError` when it cannot be one.

    A masked input that is well-formed but not an encoding (a faulty or hostile client)
    unmasks to values no survivors' clipped inputs can sum to: fixed-point checks each
    coordinate against ``n B``; the discrete Gaussian against the same peak the modulus
    was sized for (clipped values plus 10 standard deviations of the summed noise).
    """
    if setup.encoding != "ddg":
        return setup.config().decode(total, m)
    peak = ddg_peak(m, setup.clip_norm * setup.scale, setup.ddg_sigma)
    return ddg_decode(total, gamma=1.0 / setup.scale, modulus_bits=setup.modulus_bits, bound=peak)
