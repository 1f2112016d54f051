"""The server's side of one CKKS round over the wire (``secure_aggregation.scheme = "ckks"``).

The homomorphic core is :mod:`privacy.ckks`; a round runs it through the same messages as
pairwise-mask secure aggregation (``Task.secagg_setup``, ``SubmitUpdate``, ``SecAggExchange``):

1. The task carries a :class:`~privacy.ckks.round_setup.CkksSetup` (round id, cohort,
   encrypted layers, the smallest number of updates a decryptor will open, how many
   decryptors).
2. Each client encrypts its update with the clients' shared secret context, signs the
   serialized :class:`~privacy.ckks.update.EncryptedUpdate` with its enrolled Ed25519 key
   (:class:`~privacy.ckks.signed.SignedUpload`: context string, round id, client id, SHA-256
   of the update) and uploads it as one ``uint8`` tensor
   (:data:`~privacy.ckks.round_setup.CKKS_TENSOR`). The server checks the signature, the round
   and the sender, and that the ciphertexts parse as fresh ones under the public context
   (:class:`~privacy.ckks.aggregator.CkksAggregator`, which cannot decrypt), and keeps the
   signed upload.
3. When the uploads are in, the server sends the survivors' signed uploads (not a sum: a
   decryptor decrypts only a sum it made and checked itself,
   :func:`~privacy.ckks.verified_sum.verified_sum`) to ``decryptors`` randomly chosen
   survivors (stage "masked input" of the exchange); each sums them, decrypts, floods the
   result with Gaussian noise that hides the decryption error (:mod:`privacy.ckks.flooding`)
   and returns the float64 sum (stage "unmasking"). With two decryptors the server checks that
   the answers agree within the flooding noise and the dtype's rounding
   (:func:`answers_agree`), so one faulty or lying decryptor aborts the round instead of
   corrupting the model.

Trust model (see :mod:`privacy.ckks.context`): all clients hold one secret key, distributed
with the certificates (``CERTS/ckks/clients.secret``, never through the server); the server
holds only ``CERTS/ckks/server.public``. An honest-but-curious server that colludes with no
client learns the sum only, and a malicious server cannot make an honest decryptor open
anything but the sum of at least ``max(server.min_clients, min_count)`` distinct enrolled
clients' signed uploads of this round, its own among them. A decryptor holds the secret key:
a server colluding with one client (any client: the server chooses the decryptors) sees every
update.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import tenseal as ts

from fl_secure.errors import PrivacyError, ProtocolError, RoundAborted
from fl_secure.messages import TensorSpec
from privacy.ckks import signed as signed_format
from privacy.ckks.aggregator import CkksAggregator
from privacy.ckks.context import load_context
from privacy.ckks.flooding import DEFAULT_FLOODING_BITS, flooding_std
from privacy.ckks.layout import CkksLayout
from privacy.ckks.round_setup import CKKS_TENSOR, CkksSetup
from privacy.ckks.signed import SignedUpload, encode_bundle
from privacy.ckks.update import EncryptedUpdate
from privacy.secagg.stages import MASKED, STAGE_NAMES, UNMASK, StagedRound

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

#: Agreement of two decryptors' answers: within this many standard deviations of the
#: difference of their flooding noises (a false alarm has probability < 1e-32 per value).
AGREEMENT_SIGMAS = 12.0


def upload_bound(
    public_ctx: bytes, specs: Sequence[TensorSpec], layers: Sequence[str] | None
) -> int:
    """The most bytes a well-formed encrypted update of ``specs`` can take."""
    ctx = ts.context_from(public_ctx)
    data = ctx.seal_context().data.first_context_data()  # fresh ciphertexts live here
    degree = int(data.parms().poly_modulus_degree())
    primes = int(data.chain_index()) + 1  # data primes of the top level
    layout = CkksLayout.plan(specs, layers, degree // 2)
    per_ciphertext = 2 * degree * primes * 8 + 4096  # two polynomials, 64-bit coefficients
    plain = sum(math.prod(layout.layer(n).shape) * 8 for n in layout.plain_layers)
    # + header, and the signature's envelope (id, round id, signature)
    return layout.num_ciphertexts * per_ciphertext + plain + 1_048_576 + 1024


def answers_agree(
    first: np.ndarray, other: np.ndarray, specs: Sequence[TensorSpec], std: float
) -> bool:
    """Whether two decryptors' flooded sums are the same sum.

    Each decryptor adds its own noise of standard deviation ``std`` and rounds to the layers'
    dtypes, so the answers differ: per value by at most :data:`AGREEMENT_SIGMAS` standard
    deviations of the noises' difference plus one rounding step (the dtype's epsilon, relative,
    or 1 for integer layers).
    """
    if first.shape != other.shape:
        return False
    steps = np.empty_like(first)
    start = 0
    for spec in specs:
        size = math.prod(spec.shape)
        part = slice(start, start + size)
        magnitude = np.maximum(np.abs(first[part]), np.abs(other[part]))
        if spec.dtype.kind == "f":
            steps[part] = 2 * np.finfo(spec.dtype).eps * magnitude
        else:
            steps[part] = 1.0
        start += size
    bound = AGREEMENT_SIGMAS * math.sqrt(2.0) * std + steps
    return bool(np.all(np.abs(first - other) <= bound))


@dataclass
class ServerCkksRound(StagedRound):
    """The server's side of one CKKS round, with the stage surface of the masked rounds."""

    setup: CkksSetup
    public_ctx: bytes
    specs: list[TensorSpec]
    stage_timeout: float
    clock: Callable[[], float] = time.monotonic
    stage: int = MASKED
    deadline: float = 0.0
    answered: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)
    aborted: str = ""
    dropped: dict[str, str] = field(default_factory=dict)
    result: np.ndarray | None = None
    chosen: tuple[str, ...] = ()
    responses: dict[str, np.ndarray] = field(default_factory=dict)
    payload: bytes = b""
    #: The CA-signed registry of the clients' signing keys (every upload is checked against it).
    registry: Mapping[str, Ed25519PublicKey] = field(default_factory=dict)
    flooding_bits: int = DEFAULT_FLOODING_BITS

    def __post_init__(self) -> None:
        self.aggregator = CkksAggregator(self.public_ctx, self.specs, layers=self.setup.layers)
        self._survivors: list[str] = []
        self._signed: dict[str, bytes] = {}  # client -> its signed upload, kept for decryptors
        self._ctx = load_context(self.public_ctx, what="the public context")
        self.flooding_std = 0.0  # of the decryptors' noise, once they are chosen
        # a scale too small for the flooding is refused now, not after everyone trained
        flooding_std(
            self._ctx,
            summed=max(1, len(self.setup.cohort)),
            ciphertexts=self.aggregator.layout.num_ciphertexts,
            bits=self.flooding_bits,
        )
        self._length = sum(math.prod(s.shape) for s in self.specs)
        self.max_upload_bytes = upload_bound(self.public_ctx, self.specs, self.setup.layers)
        self.deadline = self.clock() + self.stage_timeout

    @property
    def upload_specs(self) -> list[TensorSpec]:
        """What a CKKS upload contains: the serialized encrypted update, any length."""
        return [TensorSpec(CKKS_TENSOR, np.dtype(np.uint8), (-1,))]

    def next_stage(self) -> int:
        """From the upload straight to the decryption (no consistency check: no shares)."""
        return UNMASK if self.stage == MASKED else self.stage + 1

    def expected(self) -> set[str]:
        """Who must answer the open stage (the decryptors, at unmasking)."""
        return set(self.chosen) if self.stage == UNMASK else set()

    def add_masked(self, client_id: str, vector: np.ndarray) -> None:
        """A signed encrypted update uploaded through ``SubmitUpdate``: check it, keep it.

        Raises:
            ProtocolError: Naming ``client_id``: a second upload, a malformed one, one signed
                for another round or by another client, or one whose ciphertexts do not parse
                as fresh ciphertexts of the aggregation.
        """
        if self.aborted:
            raise RoundAborted(self.aborted)
        if self.stage != MASKED:
            raise ProtocolError(f"encrypted update from {client_id} after the upload stage")
        if client_id in self._survivors:
            raise ProtocolError(f"two encrypted updates from {client_id}")
        raw = np.ascontiguousarray(vector, np.uint8).tobytes()
        try:
            signed = SignedUpload.from_bytes(raw)
            if signed.client_id != client_id or signed.round_id != self.setup.round_id:
                raise ProtocolError(
                    f"the upload is signed as {signed.client_id!r} for round id "
                    f"{signed.round_id.hex()}, not as {client_id!r} for this round's "
                    f"{self.setup.round_id.hex()}"
                )
            signed.verify(self.registry)
            update = EncryptedUpdate.from_bytes(signed.update)
            if update.count != 1 or update.weight != 1.0:
                raise ProtocolError(
                    f"an update of count {update.count} and weight {update.weight:g}; one "
                    "unweighted update is expected"
                )
            self.aggregator.check(update)
        except (ProtocolError, PrivacyError) as exc:
            raise ProtocolError(f"encrypted update from {client_id} refused: {exc}") from exc
        self._signed[client_id] = raw
        self._survivors.append(client_id)

    def submit(self, stage: int, client_id: str, payload: bytes) -> None:
        """A decryptor's plain sum (stage unmasking): float64, one value per parameter."""
        if self.aborted:
            raise RoundAborted(self.aborted)
        if stage != UNMASK or self.stage != UNMASK or client_id not in self.chosen:
            raise ProtocolError(
                f"{STAGE_NAMES.get(stage, stage)} message from {client_id}: only the chosen "
                "decryptors answer, at the unmasking stage"
            )
        if client_id in self.answered:
            raise ProtocolError(f"client {client_id} already returned the decrypted sum")
        if len(payload) != 8 * self._length:
            raise ProtocolError(
                f"decrypted sum from {client_id} has {len(payload)} bytes, expected "
                f"{8 * self._length} (float64 x {self._length})"
            )
        vector = np.frombuffer(payload, dtype="<f8").astype(np.float64)
        if not np.isfinite(vector).all():
            raise ProtocolError(f"decrypted sum from {client_id} holds NaN or infinity")
        self.responses[client_id] = vector
        self.answered.add(client_id)

    def close_stage(self) -> None:
        """Close uploads (choose decryptors) or unmasking (check and keep the sum)."""
        self._close(self._step, "CKKS aggregation")

    def _step(self) -> None:
        if self.stage == MASKED:
            if len(self._survivors) < self.setup.min_count:
                raise RoundAborted(
                    f"only {len(self._survivors)} encrypted updates arrived, fewer than the "
                    f"{self.setup.min_count} a decryptor may open"
                )
            pool = list(self._survivors)
            chosen = []
            for _ in range(min(self.setup.decryptors, len(pool))):
                chosen.append(pool.pop(secrets.randbelow(len(pool))))
            self.chosen = tuple(sorted(chosen))
            self.flooding_std = flooding_std(
                self._ctx,
                summed=len(self._survivors),
                ciphertexts=self.aggregator.layout.num_ciphertexts,
                bits=self.flooding_bits,
            )
            # the decryptors sum these themselves: a sum made here would not be checkable
            self.payload = encode_bundle([self._signed[c] for c in sorted(self._survivors)])
            if len(self.payload) > signed_format.MAX_BUNDLE_BYTES:
                raise RoundAborted(
                    f"the {len(self._survivors)} signed uploads take {len(self.payload)} bytes, "
                    f"more than the {signed_format.MAX_BUNDLE_BYTES} a decryptor is sent in one "
                    "message; encrypt fewer layers (secure_aggregation.ckks_layers) or use a "
                    "smaller cohort"
                )
        elif self.stage == UNMASK:
            if not self.responses:
                raise RoundAborted(f"no decryptor of {list(self.chosen)} answered")
            first, *others = self.responses.values()
            if any(not answers_agree(first, o, self.specs, self.flooding_std) for o in others):
                raise RoundAborted(
                    f"the decryptors {sorted(self.responses)} returned different sums (beyond "
                    f"their flooding noise of std {self.flooding_std:.3g} and the rounding)"
                )
            self.result = first

    def reply(self, stage: int, client_id: str) -> bytes:
        """After uploads: the signed uploads for a decryptor, nothing for the others."""
        if self.aborted:
            raise RoundAborted(self.aborted)
        if stage == MASKED:
            return self.payload if client_id in self.chosen else b""
        return b"ok"

    def survivors(self) -> tuple[str, ...]:
        """Clients whose update is in the sum."""
        return tuple(sorted(self._survivors))

    def sum_seen(self) -> bool:
        """Whether a decryptor returned the sum to the server (even sums that disagree)."""
        return bool(self.responses)

    def decoded_sum(self) -> np.ndarray:
        """The float64 sum of the survivors' updates (as decrypted by a client)."""
        if self.result is None:
            raise RoundAborted(self.aborted or "the CKKS round has no result")
        return self.result

    def record(self) -> dict[str, object]:
        """The round record's scheme-specific fields (reports read them)."""
        return {
            "scheme": "ckks",
            "cohort": list(self.setup.cohort),
            "threshold": self.setup.min_count,
            "encrypted_layers": (
                "all"
                if self.setup.layers is None
                else list(self.aggregator.layout.encrypted_layers)
            ),
            "ciphertexts": self.aggregator.layout.num_ciphertexts,
            "decryptors": list(self.chosen),
            "flooding_bits": self.flooding_bits,
            "flooding_std": self.flooding_std,
        }
