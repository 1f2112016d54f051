"""Secure aggregation of one TRAIN round over the wire: the setup, the stages, both sides.

The protocol itself is :mod:`privacy.secagg` (transport-free). This module is what the
coordinator and the client loop use to run it through ``SecAggExchange`` and
``SubmitUpdate``:

* :class:`RoundSetup` travels in the task (``Task.secagg_setup``): round id, cohort,
  threshold, neighbours, modulus and encoding; every client derives the same
  :class:`~privacy.secagg.SecAggConfig` from it.
* :class:`ServerSecureRound` holds the server's :class:`~privacy.secagg.SecAggServer` and
  the stage bookkeeping: which stage is open, its deadline, who answered; a stage closes when
  everyone expected has answered or its deadline passes, and the late ones count as dropped.
* :func:`client_secure_update` runs a client's side: advertise keys, share keys, train,
  upload the masked input, reveal shares.

Payloads are the protocol messages' own strict encodings; lists of them are packed as a
``u32`` count followed by ``u32``-length-prefixed items (:func:`pack`, :func:`unpack`).
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fl_secure.config import Config, SecureAggregationConfig
from fl_secure.errors import (
    JSON_DOCUMENT_ERRORS,
    PrivacyError,
    ProtocolError,
    RoundAborted,
    UpdateError,
)
from fl_secure.messages import Tensors, TensorSpec
from privacy.secagg import (
    AdvertiseKeys,
    EncryptedShare,
    MaskedInput,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    UnmaskRequest,
    UnmaskResponse,
)

#: Name of the single tensor a masked upload carries.
MASKED_TENSOR = "secagg.masked"
#: Stages of :class:`ServerSecureRound`, in order.
ADVERTISE, SHARE, MASKED, UNMASK, DONE = range(5)
STAGE_NAMES = {ADVERTISE: "advertise keys", SHARE: "share keys", MASKED: "masked input",
               UNMASK: "unmasking", DONE: "done"}  # fmt: skip
_MAX_ITEMS = 100_000

#: Why a client withdrew from a secure round (``fl_secure.v1.WithdrawReason``, same numbers),
#: as the server words it. A category of the client's own failure, never data; like the
#: withdrawal itself (a dropout) it is visible to the server and not covered by DP.
#: ``WithdrawReason`` DECLINED: the site's own policy (its budget) declined the task.
DECLINED = 7
WITHDRAW_REASONS = {
    0: "",  # a client that gave no reason
    1: "local training failed",
    2: "its update was not finite or had the wrong size",
    3: "a message of the round failed its checks (malformed, out of order, or a key or "
    "share that failed verification)",
    4: "too few of its neighbours took part to reach the threshold",
    5: "a call to the server failed",
    6: "an unexpected local error",
    7: "the site's own policy declined the round, such as its privacy budget",
}


def pack(items: Sequence[bytes]) -> bytes:
    """``u32`` count, then each item as ``u32`` length + bytes."""
    out = [struct.pack(">I", len(items))]
    for item in items:
        out += [struct.pack(">I", len(item)), item]
    return b"".join(out)


def unpack(data: bytes, what: str) -> list[bytes]:
    """Inverse of :func:`pack`; strict about lengths and trailing bytes."""
    if len(data) < 4:
        raise ProtocolError(f"{what}: truncated list")
    (count,) = struct.unpack_from(">I", data, 0)
    if count > _MAX_ITEMS:
        raise ProtocolError(f"{what}: {count} items is more than allowed")
    pos, items = 4, []
    for _ in range(count):
        if pos + 4 > len(data):
            raise ProtocolError(f"{what}: truncated list")
        (n,) = struct.unpack_from(">I", data, pos)
        pos += 4
        if pos + n > len(data):
            raise ProtocolError(f"{what}: truncated item")
        items.append(data[pos : pos + n])
        pos += n
    if pos != len(data):
        raise ProtocolError(f"{what}: {len(data) - pos} trailing bytes")
    return items


@dataclass(frozen=True)
class RoundSetup:
    """What every cohort member must agree on before a secure round starts."""

    round_id: bytes
    cohort: tuple[str, ...]
    threshold: int
    neighbours: int
    modulus_bits: int
    clip_range: float
    scale: float
    vector_length: int
    encoding: str = "fixed_point"  # or "ddg": distributed discrete Gaussian (integers)
    ddg_sigma: float = 0.0  # ddg: each client's N_Z(0, sigma^2), in units of 1 / scale
    clip_norm: float = 0.0  # ddg: the L2 bound C every client's update is clipped to
    min_inputs: int = 0  # the fewest masked inputs the sum may be unmasked with (0: t + 1)

    def config(self) -> SecAggConfig:
        """The protocol configuration (validates threshold, graph and modulus)."""
        return SecAggConfig(
            round_id=self.round_id,
            cohort=self.cohort,
            threshold=self.threshold,
            clip_range=self.clip_range,
            scale=self.scale,
            neighbours=self.neighbours,
            modulus_bits=self.modulus_bits,
            min_inputs=self.min_inputs,
        )

    def to_bytes(self) -> bytes:
        """Canonical JSON (version 2: version 1 plus ``min_inputs``)."""
        doc = {
            "version": 2,
            "round_id": self.round_id.hex(),
            "cohort": list(self.cohort),
            "threshold": self.threshold,
            "neighbours": self.neighbours,
            "modulus_bits": self.modulus_bits,
            "clip_range": self.clip_range,
            "scale": self.scale,
            "vector_length": self.vector_length,
            "encoding": self.encoding,
            "ddg_sigma": self.ddg_sigma,
            "clip_norm": self.clip_norm,
            "min_inputs": self.min_inputs,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RoundSetup:
        """Strict inverse of :meth:`to_bytes`."""
        try:
            doc = json.loads(data)
            if doc.pop("version") != 2:
                raise ValueError("unsupported version (server and client releases differ)")
            keys = {"round_id", "cohort", "threshold", "neighbours", "modulus_bits",
                    "clip_range", "scale", "vector_length", "encoding", "ddg_sigma",
                    "clip_norm", "min_inputs"}  # fmt: skip
            if set(doc) != keys:
                raise ValueError(f"keys {sorted(doc)}")
            setup = cls(
                round_id=bytes.fromhex(doc["round_id"]),
                cohort=tuple(str(c) for c in doc["cohort"]),
                threshold=int(doc["threshold"]),
                neighbours=int(doc["neighbours"]),
                modulus_bits=int(doc["modulus_bits"]),
                clip_range=float(doc["clip_range"]),
                scale=float(doc["scale"]),
                vector_length=int(doc["vector_length"]),
                encoding=str(doc["encoding"]),
                ddg_sigma=float(doc["ddg_sigma"]),
                clip_norm=float(doc["clip_norm"]),
                min_inputs=int(doc["min_inputs"]),
            )
        except JSON_DOCUMENT_ERRORS as exc:
            raise ProtocolError(f"invalid secure-aggregation setup: {exc}") from exc
        if setup.vector_length < 1:
            raise ProtocolError("invalid secure-aggregation setup: vector_length < 1")
        if setup.encoding not in ("fixed_point", "ddg") or (
            setup.encoding == "ddg" and not (setup.ddg_sigma > 0 and setup.clip_norm > 0)
        ):
            raise ProtocolError("invalid secure-aggregation setup: encoding parameters")
        return setup


def neighbourhood(cfg: SecureAggregationConfig, n: int) -> tuple[int, int]:
    """``(k, t)``: each client's neighbours in a cohort of ``n``, and the Shamir threshold.

    Raises:
        PrivacyError: The configured threshold is not a strict majority of ``k`` and at most
            ``k`` (:class:`privacy.secagg.SecAggConfig`'s rule). (An odd SecAgg+ ``k``, which
            has no graph on an odd cohort, is refused when the config is read.)
    """
    k = n - 1 if cfg.neighbours == 0 or cfg.neighbours >= n - 1 else cfg.neighbours
    threshold = cfg.threshold or k // 2 + 1
    if threshold > k:
        raise PrivacyError(
            f"secure_aggregation.threshold = {threshold} exceeds the {k} neighbours each "
            f"client has in a cohort of {n}; use a threshold <= {k} (0: a majority)"
        )
    if threshold <= k // 2:
        raise PrivacyError(
            f"secure_aggregation.threshold = {threshold} is not a strict majority of the {k} "
            f"neighbours each client has in a cohort of {n} (two disjoint groups of {threshold} "
            f"could rebuild both secrets of a client); use {k // 2 + 1}..{k} (0: a majority)"
        )
    return k, threshold


def make_setup(
    cfg: SecureAggregationConfig,
    *,
    run_id: str,
    round_: int,
    attempt: int,
    cohort: Sequence[str],
    vector_length: int,
    ddg: tuple[float, float, int] | None = None,
    min_inputs: int = 0,
) -> RoundSetup:
    """The setup of one attempt of a round (a fresh, random round id for every attempt).

    ``min_inputs``: the fewest masked inputs the sum may be unmasked with (the round's
    ``server.min_clients``: a sum of fewer would be discarded anyway, and under distributed
    DP it would carry fewer noise shares than the accounting assumes). With ``ddg`` it is at
    least the ``t`` the noise is split over.

    ``ddg = (noise_multiplier z, clip norm C, min_survivors t)`` selects the distributed
    discrete Gaussian: each client adds ``N_Z(0, sigma^2)`` with ``sigma = z D2 / sqrt(t)``,
    ``D2 = C / gamma + sqrt(d)`` the L2 bound of its rounded integer vector (KLS21).
    """
    n = len(cohort)
    k, threshold = neighbourhood(cfg, n)
    neighbours = 0 if k == n - 1 else k
    # Random as well as named: a resumed run repeats a round's number and attempt, and a
    # repeated id would let adverts signed for the earlier attempt be replayed in this one
    tag = f"fl-secure/secagg/{run_id}/{round_}/{attempt}/".encode() + secrets.token_bytes(16)
    round_id = hashlib.sha256(tag).digest()
    encoding, sigma, clip_norm = "fixed_point", 0.0, 0.0
    if ddg is not None:
        encoding = "ddg"
        sigma, clip_norm = check_ddg(ddg, cfg, n, vector_length)
        min_inputs = max(min_inputs, ddg[2])
    return RoundSetup(
        round_id=round_id[:16],
        cohort=tuple(sorted(cohort)),
        threshold=threshold,
        neighbours=neighbours,
        modulus_bits=cfg.modulus_bits,
        clip_range=cfg.clip_range,
        scale=float(2**cfg.scale_bits),
        vector_length=vector_length,
        encoding=encoding,
        ddg_sigma=sigma,
        clip_norm=clip_norm,
        min_inputs=min_inputs,
    )


def check_setup(
    setup: RoundSetup,
    config: Config,
    client_id: str | None = None,
    enrolled: Collection[str] | None = None,
) -> None:
    """Refuse a round setup weaker than the run config this client joined under.

    With ``client_id`` and ``enrolled`` (the CA-signed registry's ids), the cohort must also
    list this client, name each enrolled site at most once and no one else: a cohort of
    made-up members would cost this client memory quadratic in its size, and could not be
    unmasked anyway (no one else can sign for them).

    The server builds each round's setup with :func:`make_setup` from the same config, so a
    client can rebuild it: the encoding parameters, threshold and neighbourhood must match,
    the distributed noise's sigma and the fewest inputs may only be larger. A setup that
    drops the noise (``fixed_point`` under distributed DP), lowers the threshold or lets a
    sum of fewer than ``server.min_clients`` inputs be unmasked is refused.

    Raises:
        ProtocolError: naming every field that is weaker than the config gives.
    """
    if client_id is not None and client_id not in setup.cohort:
        raise ProtocolError(f"the round's cohort does not list this client ({client_id})")
    if len(set(setup.cohort)) != len(setup.cohort):
        raise ProtocolError("the round's cohort lists a client twice")
    if enrolled is not None:
        strangers = sorted(set(setup.cohort) - set(enrolled))
        if strangers:
            shown = ", ".join(strangers[:3]) + (", ..." if len(strangers) > 3 else "")
            raise ProtocolError(
                f"the round's cohort lists {len(strangers)} client(s) not in the CA-signed "
                f"registry: {shown}"
            )
    p = config.privacy
    ddg = None
    if p.unit == "client" and p.noise_placement == "distributed":
        ddg = (p.noise_multiplier, p.clip_norm, config.server.min_clients)
    try:
        expected = make_setup(
            config.secure_aggregation, run_id="", round_=0, attempt=0, cohort=setup.cohort,
            vector_length=setup.vector_length, ddg=ddg, min_inputs=config.server.min_clients,
        )  # fmt: skip
    except (PrivacyError, ValueError) as exc:
        raise ProtocolError(f"the round's setup cannot be the run config's: {exc}") from exc
    problems = [
        f"{name} {getattr(setup, name)!r} (the run config gives {getattr(expected, name)!r})"
        for name in (
            "threshold",
            "neighbours",
            "modulus_bits",
            "clip_range",
            "scale",
            "encoding",
            "clip_norm",
        )  # fmt: skip
        if getattr(setup, name) != getattr(expected, name)
    ]
    if setup.ddg_sigma < expected.ddg_sigma:
        problems.append(f"noise sigma {setup.ddg_sigma:g} < {expected.ddg_sigma:g}")
    if setup.min_inputs < expected.min_inputs:
        problems.append(f"min_inputs {setup.min_inputs} < {expected.min_inputs}")
    if problems:
        raise ProtocolError(
            "refusing a secure-aggregation setup weaker than the run this client joined: "
            + "; ".join(problems)
        )


def check_ddg(
    ddg: tuple[float, float, int], cfg: SecureAggregationConfig, n: int, d: int
) -> tuple[float, float]:
    """``(sigma, C)`` of the distributed discrete Gaussian, after two checks.

    The sum of any ``t`` clients' noise must be at least as private as the Gaussian the run
    is accounted with (KLS21's ``tau`` term negligible), and the cohort's noisy sum must not
    wrap mod ``2^bits`` (10 standard deviations of headroom).
    """
    from privacy.dp.discrete_gaussian import (
        ddg_client_sigma,
        ddg_noise_multiplier,
        integer_l2_bound,
    )

    z, clip_norm, t = ddg
    if cfg.modulus_bits > 62:
        raise PrivacyError(
            f"secure_aggregation.modulus_bits = {cfg.modulus_bits}: the distributed discrete "
            "Gaussian's integer arithmetic supports up to 62"
        )
    gamma = 2.0**-cfg.scale_bits
    bound = integer_l2_bound(clip_norm, gamma, d)
    sigma = ddg_client_sigma(z, bound, t)
    if ddg_noise_multiplier(sigma, t, bound, d) < z * (1 - 1e-9):
        raise PrivacyError(
            f"the discrete Gaussian with sigma {sigma:.3g} is not as private as z = {z:g} "
            "(KLS21 tau term); raise secure_aggregation.scale_bits"
        )
    peak = ddg_peak(n, clip_norm / gamma, sigma)
    if 2 * peak >= 2.0**cfg.modulus_bits:
        raise PrivacyError(
            f"a cohort of {n} noisy sums could wrap mod 2^{cfg.modulus_bits} (peak {peak:.3g}); "
            "raise secure_aggregation.modulus_bits (up to 62) or lower scale_bits"
        )
    return sigma, clip_norm


def ddg_peak(n: int, clip_units: float, sigma: float) -> float:
    """The largest magnitude a coordinate of ``n`` clients' noisy integer sum may reach.

    Each rounded clipped value is at most ``clip_units + 1`` (the clip norm in integer
    units); the summed noise has std ``sqrt(n) sigma`` and 10 of those are the headroom (a
    coordinate passes it with probability ~1e-23). The modulus is sized for it, and a
    decoded sum beyond it is corrupted.
    """
    return n * (clip_units + 1) + 10 * math.sqrt(n) * sigma


def wire_dtype(setup: RoundSetup) -> np.dtype:
    """Masked vectors travel as 32-bit words when the modulus allows (half the bytes)."""
    return np.dtype("<u4") if setup.modulus_bits <= 32 else np.dtype("<u8")


def flatten(tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """All tensors as one float64 vector, in order."""
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in tensors.values()])


def concatenate(tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """All tensors as one flat vector of their own dtype (a view when there is one tensor).

    The same values as :func:`flatten` without its float64 copy: fixed-point encoding reads
    the vector chunk by chunk in float64 anyway. Tensors of different dtypes are concatenated
    as float64 (exactly :func:`flatten`).
    """
    arrays = [np.asarray(v) for v in tensors.values()]
    if len(arrays) == 1:
        return arrays[0].ravel()
    if arrays and all(a.dtype == arrays[0].dtype for a in arrays):
        return np.concatenate([a.ravel() for a in arrays])
    return flatten(tensors)


def unflatten(vector: np.ndarray, specs: Sequence[TensorSpec]) -> Tensors:
    """Inverse of :func:`flatten` for tensors of ``specs`` (float64 values)."""
    out: Tensors = OrderedDict()
    pos = 0
    for s in specs:
        n = math.prod(s.shape)
        out[s.name] = vector[pos : pos + n].reshape(s.shape)
        pos += n
    if pos != vector.size:
        raise ProtocolError(f"aggregate has {vector.size} values, the model {pos}")
    return out


class StagedRound:
    """Stage bookkeeping shared by the server's secure rounds (masks and CKKS).

    A stage closes when everyone :meth:`expected` answered or its deadline passed; the late
    ones are recorded as dropped at that stage, a protocol failure aborts the round, and the
    next stage gets a fresh deadline. A client whose connection is known to be gone
    (:meth:`mark_gone`) is not waited for. Subclasses are dataclasses holding these attributes.
    """

    stage: int
    deadline: float
    answered: set[str]
    gone: set[str]  # clients whose connection closed: no stage waits for them
    aborted: str
    dropped: dict[str, str]  # client -> the stage it missed
    stage_timeout: float
    clock: Callable[[], float]

    def expected(self) -> set[str]:
        """Who must answer the open stage."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether the open stage may close now."""
        return self.expected() - self.gone <= self.answered or self.clock() >= self.deadline

    def mark_gone(self, client_id: str) -> None:
        """``client_id``'s connection closed: the open and later stages stop waiting for it.

        Only the waiting ends early; what the protocol does with a missing client (recover
        its masks from the survivors' shares, or abort) is what it does at a deadline.
        """
        self.gone.add(client_id)

    def _close(self, step: Callable[[], None], what: str) -> None:
        """Record the missing as dropped, run the stage's ``step``, open the next stage."""
        for c in self.expected() - self.answered:
            self.dropped.setdefault(c, STAGE_NAMES[self.stage])
        try:
            step()
        except (RoundAborted, PrivacyError, ProtocolError) as exc:
            self.aborted = str(exc)
            raise RoundAborted(f"{what} aborted: {exc}") from exc
        self.stage += 1
        self.answered = set()
        self.deadline = self.clock() + self.stage_timeout


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
        return set(self.server.survivors) if self.stage == UNMASK else set()

    def submit(self, stage: int, client_id: str, payload: bytes) -> None:
        """One client's message of ``stage`` (advertise, share, or unmask reply)."""
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
                raise ProtocolError(f"{client_id} sent the advertisement of {advert.client_id}")
            self.server.add_advert(advert)
        elif stage == SHARE:
            shares = [EncryptedShare.from_bytes(b) for b in unpack(payload, "shares")]
            self.server.add_shares(client_id, shares)
        elif stage == UNMASK:
            response = UnmaskResponse.from_bytes(payload)
            if response.client_id != client_id:
                raise ProtocolError(f"{client_id} sent the unmask reply of {response.client_id}")
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
            self.routed = {c: pack([a.to_bytes() for a in ads]) for c, ads in routed.items()}
        elif self.stage == SHARE:
            shares = self.server.route_shares()
            self.routed = {c: pack([s.to_bytes() for s in sh]) for c, sh in shares.items()}
        elif self.stage == MASKED:
            request: UnmaskRequest = self.server.unmask_request()
            self.unmask_payload = request.to_bytes()
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
        """The unmasked sum as floats; :class:`ProtocolError` when no honest cohort made it.

        A masked input that is well-formed but not an encoding (a faulty or hostile client)
        unmasks to values no survivors' clipped inputs can sum to: fixed-point checks each
        coordinate against ``n B``; the discrete Gaussian against the same peak the modulus
        was sized for (clipped values plus 10 standard deviations of the summed noise).
        """
        setup, m = self.setup, len(self.server.survivors)
        if setup.encoding != "ddg":
            return setup.config().decode(total, m)
        from privacy.dp.discrete_gaussian import ddg_decode

        peak = ddg_peak(m, setup.clip_norm * setup.scale, setup.ddg_sigma)
        return ddg_decode(
            total, gamma=1.0 / setup.scale, modulus_bits=setup.modulus_bits, bound=peak
        )


#: (stage, payload) -> the server's reply payload (one SecAggExchange call).
Exchange = Callable[[int, bytes], bytes]


def client_secure_update(
    setup: RoundSetup,
    client_id: str,
    identity_key: Ed25519PrivateKey,
    registry: Mapping[str, Ed25519PublicKey],
    exchange: Exchange,
    compute_update: Callable[[], Tensors],
    upload: Callable[[np.ndarray], None],
) -> None:
    """A client's whole secure round: keys, shares, local training, masked upload, unmasking.

    Keys are exchanged before training, so a client that drops while training is recovered
    by its neighbours' shares.
    """
    client = SecAggClient(client_id, identity_key, setup.config(), registry, setup.vector_length)
    adverts = [
        AdvertiseKeys.from_bytes(b)
        for b in unpack(exchange(ADVERTISE, client.advertise_keys().to_bytes()), "adverts")
    ]
    shares = client.share_keys(adverts)
    incoming = [
        EncryptedShare.from_bytes(b)
        for b in unpack(exchange(SHARE, pack([s.to_bytes() for s in shares])), "shares")
    ]
    update = compute_update()
    # fixed point encodes chunk by chunk in float64: no float64 copy of the whole update here
    vector = flatten(update) if setup.encoding == "ddg" else concatenate(update)
    if vector.size != setup.vector_length:
        raise UpdateError(
            f"update has {vector.size} values, the round expects {setup.vector_length}"
        )
    encoded = None
    if setup.encoding == "ddg":  # integer noise: round, add N_Z(0, sigma^2), reduce mod 2^k
        from privacy.dp.discrete_gaussian import ddg_encode
        from privacy.dp.noise import SecureGaussian

        norm = float(np.linalg.norm(vector))
        if not math.isfinite(norm):  # NaN would pass the clip below and wrap to garbage
            raise UpdateError("the update contains NaN or infinity; refusing to encode it")
        if norm > setup.clip_norm:  # the sensitivity bound D2 assumes ||x|| <= C
            vector = vector * (setup.clip_norm / norm)
        encoded = ddg_encode(
            SecureGaussian(),
            vector,
            gamma=1.0 / setup.scale,
            sigma=setup.ddg_sigma,
            modulus_bits=setup.modulus_bits,
        )
    masked = client.masked_input(incoming, vector, encoded=encoded)
    upload(masked.vector)
    request = UnmaskRequest.from_bytes(exchange(MASKED, b""))
    exchange(UNMASK, client.unmask(request).to_bytes())
