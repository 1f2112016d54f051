"""CKKS aggregation of one TRAIN round over the wire (``secure_aggregation.scheme = "ckks"``).

The homomorphic core is :mod:`privacy.ckks`; this module runs it through the same messages as
pairwise-mask secure aggregation (``Task.secagg_setup``, ``SubmitUpdate``, ``SecAggExchange``):

1. The task carries a :class:`CkksSetup` (round id, cohort, encrypted layers, the smallest
   number of updates a decryptor will open, how many decryptors).
2. Each client encrypts its update with the clients' shared secret context and uploads the
   serialized :class:`~privacy.ckks.EncryptedUpdate` as one ``uint8`` tensor
   (:data:`CKKS_TENSOR`); the server adds it to a running encrypted sum
   (:class:`~privacy.ckks.CkksAggregator`, public context only: it cannot decrypt).
3. When the uploads are in, the server sends the encrypted sum to ``decryptors`` randomly
   chosen survivors (stage "masked input" of the exchange); each decrypts it and returns the
   plain float64 sum (stage "unmasking"). With two decryptors the server checks that both
   returned the same bits, so one faulty or lying decryptor aborts the round instead of
   corrupting the model.

Trust model (see :mod:`privacy.ckks`): all clients hold one secret key, distributed with the
certificates (``CERTS/ckks/clients.secret``, never through the server); the server holds only
``CERTS/ckks/server.public``. An honest-but-curious server that colludes with no client learns
the sum only; a single client colluding with the server can decrypt every update the server
saw. A decryptor refuses an encrypted sum that claims fewer than ``min_count`` updates, which
stops an honest server's bug, not a malicious server (the count is not authenticated). The
decrypted sum is rounded to the layers' dtypes before it leaves the decryptor (mitigates the
Li-Micciancio key-recovery attack on raw approximate decryptions).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fl_secure.config import Config
from fl_secure.errors import JSON_DOCUMENT_ERRORS, PrivacyError, ProtocolError, RoundAborted
from fl_secure.messages import Tensors, TensorSpec
from privacy.ckks import (
    CkksAggregator,
    CkksLayout,
    CkksParams,
    EncryptedUpdate,
    decrypt_sum,
    encrypt_update,
    make_secret_context,
    public_context,
)
from privacy.secagg.stages import MASKED, STAGE_NAMES, UNMASK, Exchange, StagedRound
from privacy.secagg.vectors import flatten

#: Name of the single tensor a CKKS upload carries (the serialized encrypted update).
CKKS_TENSOR = "ckks.update"
#: Where the contexts live in a certificate folder.
CKKS_DIR, SECRET_FILE, PUBLIC_FILE = "ckks", "clients.secret", "server.public"
_SETUP_KEYS = {"version", "scheme", "round_id", "cohort", "layers", "min_count", "decryptors"}


def secret_context_path(cert_dir: Path) -> Path:
    """The clients' context with the secret key (distribute to clients only)."""
    return cert_dir / CKKS_DIR / SECRET_FILE


def public_context_path(cert_dir: Path) -> Path:
    """The server's context: parameters only, no key."""
    return cert_dir / CKKS_DIR / PUBLIC_FILE


def write_ckks_keys(
    cert_dir: Path, params: CkksParams | None = None, *, overwrite: bool = False
) -> tuple[Path, Path]:
    """Generate a fresh CKKS secret key; write the clients' and the server's contexts.

    The secret context is written ``0600`` (like the clients' TLS keys). Refuses to replace
    existing files unless ``overwrite``: clients that kept the old key could not decrypt.
    Both files are written, or neither: a failed write (a full disk) cannot leave a new
    secret context beside the old public one, which would no longer match it.
    """
    from fl_secure.tls.layout import StagedFiles

    secret_path, public_path = secret_context_path(cert_dir), public_context_path(cert_dir)
    if not overwrite and (secret_path.exists() or public_path.exists()):
        raise PrivacyError(
            f"CKKS contexts already exist in {cert_dir / CKKS_DIR}; pass --overwrite to replace "
            "them (clients holding the old key could no longer decrypt)"
        )
    secret = make_secret_context(params)
    with StagedFiles() as files:
        files.write(secret_path, secret, mode=0o600)
        files.write(public_path, public_context(secret), mode=0o644)
    return secret_path, public_path


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PrivacyError(
            f"{what} {path} does not exist; create the CKKS contexts with "
            f"`fl-secure certs ckks --out {path.parent.parent}`"
        ) from None


def load_secret_context(cert_dir: Path) -> bytes:
    """The clients' secret context from a certificate folder."""
    return _read(secret_context_path(cert_dir), "the clients' CKKS secret context")


def load_public_context(cert_dir: Path) -> bytes:
    """The server's public context (refused if it holds the secret key)."""
    data = _read(public_context_path(cert_dir), "the server's CKKS public context")
    import tenseal as ts

    try:
        ctx = ts.context_from(data)
    except Exception as exc:
        raise PrivacyError(f"{public_context_path(cert_dir)} is not a CKKS context: {exc}") from exc
    if ctx.has_secret_key() or ctx.is_private():
        raise PrivacyError(
            f"{public_context_path(cert_dir)} holds the secret key; the server must hold only "
            "the public context"
        )
    return data


@dataclass(frozen=True)
class CkksSetup:
    """What every cohort member needs for a CKKS round."""

    round_id: bytes
    cohort: tuple[str, ...]
    layers: tuple[str, ...] | None  # encrypted layers; None = all shared layers
    min_count: int  # a decryptor refuses to open a sum of fewer updates
    decryptors: int = 2

    def to_bytes(self) -> bytes:
        """Canonical JSON (version 1, ``scheme = "ckks"``)."""
        doc = {
            "version": 1,
            "scheme": "ckks",
            "round_id": self.round_id.hex(),
            "cohort": list(self.cohort),
            "layers": None if self.layers is None else list(self.layers),
            "min_count": self.min_count,
            "decryptors": self.decryptors,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> CkksSetup:
        """Strict inverse of :meth:`to_bytes`."""
        try:
            doc = json.loads(data)
            if set(doc) != _SETUP_KEYS or doc["version"] != 1 or doc["scheme"] != "ckks":
                raise ValueError(f"keys {sorted(doc)}")
            layers = doc["layers"]
            setup = cls(
                round_id=bytes.fromhex(doc["round_id"]),
                cohort=tuple(str(c) for c in doc["cohort"]),
                layers=None if layers is None else tuple(str(x) for x in layers),
                min_count=int(doc["min_count"]),
                decryptors=int(doc["decryptors"]),
            )
        except JSON_DOCUMENT_ERRORS as exc:
            raise ProtocolError(f"invalid CKKS round setup: {exc}") from exc
        if setup.min_count < 1 or not 1 <= setup.decryptors <= 2:
            raise ProtocolError("invalid CKKS round setup: min_count or decryptors")
        return setup


def is_ckks_setup(data: bytes) -> bool:
    """Whether a task's ``secagg_setup`` describes a CKKS round (vs pairwise masks)."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("scheme") == "ckks"


def upload_bound(
    public_ctx: bytes, specs: Sequence[TensorSpec], layers: Sequence[str] | None
) -> int:
    """The most bytes a well-formed encrypted update of ``specs`` can take."""
    import tenseal as ts

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


def client_ckks_update(
    setup: CkksSetup,
    secret_ctx: bytes,
    exchange: Exchange,
    compute_update: Callable[[], Tensors],
    upload: Callable[[np.ndarray], None],
) -> None:
    """A client's CKKS round: train, encrypt, upload; decrypt the sum if chosen."""
    update = compute_update()
    encrypted = encrypt_update(update, secret_ctx, layers=setup.layers)
    upload(np.frombuffer(encrypted.to_bytes(), dtype=np.uint8))
    request = exchange(MASKED, b"")
    if not request:
        return  # another client decrypts this round's sum
    total = EncryptedUpdate.from_bytes(request)
    if total.count < setup.min_count:
        raise PrivacyError(
            f"refusing to decrypt a sum of {total.count} updates, fewer than {setup.min_count}"
        )
    plain = decrypt_sum(total, secret_ctx, specs=encrypted.layout.specs)
    exchange(UNMASK, flatten(plain).astype("<f8").tobytes())


def check_ckks_setup(setup: CkksSetup, config: Config, shared_names: Sequence[str]) -> None:
    """Refuse a CKKS round setup weaker than the run config this client joined under.

    The encrypted layers must be those ``secure_aggregation.ckks_layers`` selects (a setup
    naming fewer would send the others in the clear), and a decryptor must refuse sums of
    fewer than ``server.min_clients`` updates.

    Raises:
        ProtocolError: naming what differs.
    """
    expected = shared_layers(shared_names, config.secure_aggregation.ckks_layers)
    problems = []
    if setup.layers != expected:
        problems.append(
            f"encrypted layers {'all' if setup.layers is None else list(setup.layers)} (the "
            f"run config gives {'all' if expected is None else list(expected)})"
        )
    if setup.min_count < config.server.min_clients:
        problems.append(f"min_count {setup.min_count} < server.min_clients "
                        f"{config.server.min_clients}")  # fmt: skip
    if problems:
        raise ProtocolError(
            "refusing a CKKS setup weaker than the run this client joined: " + "; ".join(problems)
        )


def shared_layers(names: Sequence[str], prefixes: Sequence[str]) -> tuple[str, ...] | None:
    """The layers to encrypt: those starting with one of ``prefixes`` (all if none given)."""
    if not prefixes:
        return None
    chosen = tuple(n for n in names if any(n.startswith(p) for p in prefixes))
    if not chosen:
        raise PrivacyError(
            f"secure_aggregation.ckks_layers {list(prefixes)} matches none of the shared "
            f"layers (first: {list(names[:3])})"
        )
    return chosen
