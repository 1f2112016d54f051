"""The server's side of one CKKS round over the wire (``secure_aggregation.scheme = "ckks"``).

The homomorphic core is :mod:`privacy.ckks`; a round runs it through the same messages as
pairwise-mask secure aggregation (``Task.secagg_setup``, ``SubmitUpdate``, ``SecAggExchange``):

1. The task carries a :class:`~privacy.ckks.round_setup.CkksSetup` (round id, cohort,
   encrypted layers, the smallest number of updates a decryptor will open, how many
   decryptors).
2. Each client encrypts its update with the clients' shared secret context and uploads the
   serialized :class:`~privacy.ckks.update.EncryptedUpdate` as one ``uint8`` tensor
   (:data:`~privacy.ckks.round_setup.CKKS_TENSOR`); the server adds it to a running encrypted
   sum (:class:`~privacy.ckks.aggregator.CkksAggregator`, public context only: it cannot
   decrypt).
3. When the uploads are in, the server sends the encrypted sum to ``decryptors`` randomly
   chosen survivors (stage "masked input" of the exchange); each decrypts it and returns the
   plain float64 sum (stage "unmasking"). With two decryptors the server checks that both
   returned the same bits, so one faulty or lying decryptor aborts the round instead of
   corrupting the model.

Trust model (see :mod:`privacy.ckks.context`): all clients hold one secret key, distributed
with the certificates (``CERTS/ckks/clients.secret``, never through the server); the server
holds only ``CERTS/ckks/server.public``. An honest-but-curious server that colludes with no
client learns the sum only; a single client colluding with the server can decrypt every update
the server saw. A decryptor refuses an encrypted sum that claims fewer than ``min_count``
updates, which stops an honest server's bug, not a malicious server (the count is not
authenticated). The decrypted sum is rounded to the layers' dtypes before it leaves the
decryptor (mitigates the Li-Micciancio key-recovery attack on raw approximate decryptions).
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import tenseal as ts

from fl_secure.errors import ProtocolError, RoundAborted
from fl_secure.messages import TensorSpec
from privacy.ckks.aggregator import CkksAggregator
from privacy.ckks.layout import CkksLayout
from privacy.ckks.round_setup import CKKS_TENSOR, CkksSetup
from privacy.ckks.update import EncryptedUpdate
from privacy.secagg.stages import MASKED, STAGE_NAMES, UNMASK, StagedRound


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
    return layout.num_ciphertexts * per_ciphertext + plain + 1_048_576  # + header


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

    def __post_init__(self) -> None:
        self.aggregator = CkksAggregator(self.public_ctx, self.specs, layers=self.setup.layers)
        self._survivors: list[str] = []
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
        """An encrypted update uploaded through ``SubmitUpdate``: add it to the sum."""
        if self.aborted:
            raise RoundAborted(self.aborted)
        if self.stage != MASKED:
            raise ProtocolError(f"encrypted update from {client_id} after the upload stage")
        if client_id in self._survivors:
            raise ProtocolError(f"two encrypted updates from {client_id}")
        update = EncryptedUpdate.from_bytes(np.ascontiguousarray(vector, np.uint8).tobytes())
        if update.count != 1 or update.weight != 1.0:
            raise ProtocolError(
                f"{client_id} sent an update of count {update.count} and weight "
                f"{update.weight:g}; one unweighted update is expected"
            )
        self.aggregator.add(update)
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
            self.payload = self.aggregator.result().to_bytes()
        elif self.stage == UNMASK:
            if not self.responses:
                raise RoundAborted(f"no decryptor of {list(self.chosen)} answered")
            first, *others = self.responses.values()
            if any(not np.array_equal(first, o) for o in others):
                raise RoundAborted(
                    f"the decryptors {sorted(self.responses)} returned different sums"
                )
            self.result = first

    def reply(self, stage: int, client_id: str) -> bytes:
        """After uploads: the encrypted sum for a decryptor, nothing for the others."""
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
        }
