"""A whole SecAgg / SecAgg+ round among a simulated cohort, run in one process.

:func:`run_cohort_round` runs the gRPC path's own protocol objects with the network taken
out: the server's :class:`~privacy.secagg.server_round.ServerSecureRound` (stages,
routing, dropout bookkeeping, the unmasking and decoding) and, per client, the
:class:`~privacy.secagg.client_round.SecureRoundMember` that
:func:`~privacy.secagg.client_round.client_secure_update` drives over gRPC (every check a
client makes, the consistency check included). Every message crosses as the bytes the wire
carries (payloads are parsed by the receiver), so the bytes each client sends and receives
are measured, not modelled. Dropouts are injected: a client that drops at a stage sends
nothing from it on and is seen to leave (as when its process dies); a client whose own
checks fail withdraws, as over gRPC.

The simulation engine goes tensors -> :func:`encode_update` -> :func:`run_cohort_round` ->
:func:`mean_update`, with the round's setup from :func:`cohort_setup` (the coordinator's
:func:`~privacy.secagg.round_setup.make_setup`: ``k`` and ``t`` are derived as on the gRPC
path). For cohorts too large to mask, :mod:`privacy.secagg.cost_only` sums in the clear and
says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fl_secure.config import SecureAggregationConfig
from fl_secure.errors import FlSecureError, ProtocolError, RoundAborted, UpdateError
from fl_secure.messages import Tensors, TensorSpec
from privacy.secagg.arithmetic import check_vector
from privacy.secagg.client_round import SecureRoundMember, ddg_encoded
from privacy.secagg.encoding import UniformSource
from privacy.secagg.round_setup import RoundSetup, make_setup
from privacy.secagg.server_round import ServerSecureRound
from privacy.secagg.sharing import SharedVerificationKey, cohort_in_one_process
from privacy.secagg.stages import (
    ADVERTISE,
    CONSISTENCY,
    DONE,
    MASKED,
    SHARE,
    STAGE_NAMES,
    UNMASK,
    wire_dtype,
)
from privacy.secagg.vectors import concatenate, flatten, unflatten

#: ``stats`` keys of the seconds spent in each stage (clients' and server's work together).
STAGE_KEYS = {ADVERTISE: "advertise", SHARE: "share", MASKED: "masked",
              CONSISTENCY: "consistency", UNMASK: "unmask"}  # fmt: skip


@dataclass(frozen=True)
class CohortSum:
    """What one cohort's secure round released.

    Attributes:
        total: The unmasked sum mod ``2^bits`` of the survivors' encoded vectors (None if
            the round aborted).
        survivors: Whose inputs are in ``total`` (sorted).
        aborted: Why the round aborted with no output, else None.
        stats: Seconds per stage (``seconds.<stage>``), the clients' and the server's
            compute (``seconds.clients``, ``seconds.server``), protocol bytes each client
            sent and received (``bytes_up_per_client``, ``bytes_down_per_client``: means over
            the cohort, ``..._max``), ``n``, ``k``, ``t``, ``survivors``, ``secure`` (1.0 for
            a real round, 0.0 for the cost-only mode).
        mode: ``"secagg"``, ``"secagg+"``, or :data:`privacy.secagg.cost_only.COST_ONLY`.
        decoded: ``total`` as the float sum the server decodes (None if aborted).
        left: Client -> why it left the round (an injected dropout, or a withdrawal after
            its own checks failed, with the error).
    """

    total: np.ndarray | None
    survivors: tuple[str, ...]
    aborted: str | None
    stats: dict[str, float]
    mode: str = "secagg"
    decoded: np.ndarray | None = None
    left: Mapping[str, str] = field(default_factory=dict)

    @property
    def secure(self) -> bool:
        """Whether the sum was computed by secure aggregation (False in the cost-only mode)."""
        return self.stats.get("secure", 1.0) == 1.0


def cohort_setup(
    cfg: SecureAggregationConfig,
    cohort: Sequence[str],
    vector_length: int,
    *,
    round_id: bytes,
    ddg: tuple[float, float, int] | None = None,
    min_inputs: int = 0,
) -> RoundSetup:
    """The setup the coordinator would send this cohort, with the caller's round id.

    ``k``, ``t``, ``c`` and the modulus are :func:`~privacy.secagg.round_setup.make_setup`'s.
    ``round_id`` must never repeat within a run (draw it with ``secrets.token_bytes(16)``):
    it is bound into every signature and key of the round.

    Raises:
        PrivacyError: No parameters meet the configured rates for this cohort's size.
        ValueError: The scheme is not ``secagg`` or ``secagg+``.
    """
    if cfg.scheme not in ("secagg", "secagg+"):
        raise ValueError(
            f"secure_aggregation.scheme = {cfg.scheme!r}: an in-process round runs secagg or "
            "secagg+ (CKKS rounds are not simulated)"
        )
    setup = make_setup(
        cfg, run_id="simulation", round_=0, attempt=0, cohort=cohort,
        vector_length=vector_length, ddg=ddg, min_inputs=min_inputs,
    )  # fmt: skip
    return dataclasses.replace(setup, round_id=bytes(round_id))


def resolve_setup(
    setup_or_config: RoundSetup | SecureAggregationConfig,
    encoded: Mapping[str, np.ndarray],
    round_id: bytes,
) -> RoundSetup:
    """The round's setup: the one given (its round id must be ``round_id``) or the config's."""
    if isinstance(setup_or_config, RoundSetup):
        if setup_or_config.round_id != round_id:
            raise ValueError("round_id differs from the round id of the setup given")
        setup = setup_or_config
    else:
        lengths = {np.asarray(v).size for v in encoded.values()}
        if len(lengths) != 1:
            raise ValueError(f"encoded vectors of different lengths {sorted(lengths)}")
        setup = cohort_setup(setup_or_config, list(encoded), lengths.pop(), round_id=round_id)
    if set(encoded) != set(setup.cohort):
        raise ValueError("encoded must hold exactly one vector per cohort member")
    for c, vector in encoded.items():  # a caller's bug, not a client that withdraws
        try:
            check_vector(
                np.asarray(vector), setup.modulus_bits, setup.vector_length, f"encoded[{c!r}]"
            )
        except ProtocolError as exc:
            raise ValueError(str(exc)) from exc
    return setup


def check_dropouts(dropouts: Mapping[str, int] | None, cohort: Sequence[str]) -> dict[str, int]:
    """``dropouts`` as a dict, refusing unknown clients and stages outside ADVERTISE..DONE."""
    drops = dict(dropouts or {})
    strangers = sorted(set(drops) - set(cohort))
    if strangers:
        raise ValueError(f"dropouts name clients outside the cohort: {strangers[:3]}")
    bad = {c: s for c, s in drops.items() if not ADVERTISE <= s <= DONE}
    if bad:
        raise ValueError(f"dropout stages must be {ADVERTISE}..{DONE} (stages.py): {bad}")
    return drops


def random_dropouts(
    cohort: Sequence[str], fraction: float, *, rng: random.Random | None = None
) -> dict[str, int]:
    """``round(fraction n)`` clients of the cohort, each dropping at a uniform stage 0..4.

    ``rng``: a seeded :class:`random.Random` for a reproducible simulation; the CSPRNG
    (:class:`secrets.SystemRandom`) when None.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"dropout fraction {fraction}: expected 0..1")
    draw = rng if rng is not None else secrets.SystemRandom()
    chosen = draw.sample(sorted(cohort), round(fraction * len(cohort)))
    return {c: draw.randrange(ADVERTISE, DONE) for c in chosen}


def encode_update(
    setup: RoundSetup, update: Tensors | np.ndarray, *, rounding: UniformSource | None = None
) -> np.ndarray:
    """An update encoded mod ``2^bits`` as the gRPC client encodes it before masking.

    Fixed point: clipped per coordinate, scaled, stochastically rounded (``rounding``, a
    CSPRNG when None). Distributed discrete Gaussian: clipped in L2, rounded, with the
    client's integer noise added (:func:`~privacy.secagg.client_round.ddg_encoded`).

    Raises:
        UpdateError: The update has the wrong size or is not finite.
    """
    tensors = OrderedDict([("update", update)]) if isinstance(update, np.ndarray) else update
    vector = flatten(tensors) if setup.encoding == "ddg" else concatenate(tensors)
    if vector.size != setup.vector_length:
        raise UpdateError(
            f"update has {vector.size} values, the round expects {setup.vector_length}"
        )
    if setup.encoding == "ddg":
        return ddg_encoded(setup, vector)
    return setup.config().encode(vector, rounding)


def mean_update(result: CohortSum, specs: Sequence[TensorSpec]) -> Tensors:
    """The survivors' mean update, shaped as ``specs`` (the gRPC server's plain mean).

    Under client-level DP the server divides by the expected cohort instead
    (:meth:`privacy.server_round.ServerPrivacy.finish_sum`): use ``result.decoded`` then.

    Raises:
        RoundAborted: The round released no sum.
    """
    if result.decoded is None or not result.survivors:
        raise RoundAborted(result.aborted or "the secure round has no result")
    total = unflatten(result.decoded, specs)
    m = len(result.survivors)
    return OrderedDict((s.name, (total[s.name] / m).astype(s.dtype)) for s in specs)


class _Cohort:
    """The clients of one in-process round, their dropouts, timings and bytes."""

    def __init__(
        self, setup: RoundSetup, session: ServerSecureRound, drops: Mapping[str, int]
    ) -> None:
        self.setup, self.session, self.drops = setup, session, drops
        self.members: dict[str, SecureRoundMember] = {}
        self.live: list[str] = list(setup.cohort)
        self.left: dict[str, str] = {}
        self.up = dict.fromkeys(setup.cohort, 0)
        self.down = dict.fromkeys(setup.cohort, 0)
        self.client_seconds = 0.0

    def leave(self, client_id: str, why: str) -> None:
        """The client leaves: the server stops waiting for it (its connection closed)."""
        self.left[client_id] = why
        self.session.mark_gone(client_id)

    def each(self, stage: int, step: Callable[[str], None]) -> None:
        """Run ``step`` for every live client that does not drop at ``stage``."""
        still = []
        for c in self.live:
            if self.drops.get(c, DONE) <= stage:
                self.leave(c, f"dropped at {STAGE_NAMES[stage]} (injected)")
                continue
            start = time.perf_counter()
            try:
                step(c)
            except FlSecureError as exc:  # its own checks failed, or the server refused it
                self.leave(c, f"withdrew at {STAGE_NAMES[stage]}: {exc}")
                continue
            finally:
                self.client_seconds += time.perf_counter() - start
            still.append(c)
        self.live = still

    def reply(self, stage: int, client_id: str) -> bytes:
        """The server's reply to ``client_id`` for the closed ``stage``, counted as received."""
        data = self.session.reply(stage, client_id)
        self.down[client_id] += len(data)
        return data

    def send(self, stage: int, client_id: str, payload: bytes) -> None:
        """``client_id``'s message of ``stage``, counted as sent."""
        self.up[client_id] += len(payload)
        self.session.submit(stage, client_id, payload)


def _run_stages(
    session: ServerSecureRound,
    cohort: _Cohort,
    steps: Mapping[int, Callable[[str], None]],
    stats: dict[str, float],
) -> tuple[float, str | None]:
    """Each stage's steps, then its close; ``(server seconds, why it aborted or None)``."""
    server_seconds = 0.0
    for stage, step in steps.items():
        stage_start = time.perf_counter()
        cohort.each(stage, step)
        close_start = time.perf_counter()
        aborted = None
        try:
            if not session.ready():  # pragma: no cover - everyone answered or is gone
                raise RoundAborted(f"the {STAGE_NAMES[stage]} stage is still waiting")
            session.close_stage()
        except RoundAborted as exc:
            aborted = str(exc)
        server_seconds += time.perf_counter() - close_start
        stats[f"seconds.{STAGE_KEYS[stage]}"] = time.perf_counter() - stage_start
        if aborted:
            return server_seconds, aborted
    return server_seconds, None


def run_cohort_round(
    setup_or_config: RoundSetup | SecureAggregationConfig,
    encoded: Mapping[str, np.ndarray],
    *,
    round_id: bytes,
    dropouts: Mapping[str, int] | None = None,
    signing_keys: Mapping[str, Ed25519PrivateKey] | None = None,
    shared_checks: bool = True,
) -> CohortSum:
    """One real SecAgg / SecAgg+ round among ``encoded``'s clients, in this process.

    Args:
        setup_or_config: The round's :class:`RoundSetup` (from :func:`cohort_setup`; its
            round id must be ``round_id``), or the run's secure-aggregation config (the
            setup is then derived for the cohort ``encoded`` names, fixed-point encoding).
        encoded: Client id -> its update encoded mod ``2^bits`` (:func:`encode_update`).
        round_id: The round's never-repeated id.
        dropouts: Client id -> the stage (:mod:`privacy.secagg.stages`: ADVERTISE 0 ..
            UNMASK 4) from which it sends nothing; DONE (5) or absent: it completes.
        signing_keys: The clients' Ed25519 identity keys; fresh ones (a CSPRNG) when None.
        shared_checks: The cohort verifies each distinct signature once
            (:class:`~privacy.secagg.sharing.SharedVerificationKey`), checks each advertised
            key and derives the graph once
            (:func:`~privacy.secagg.sharing.cohort_in_one_process`); False: every client
            computes them itself, as real clients do (the seconds are a real round's compute).

    Returns:
        The survivors' modular sum and its decoding, or the reason the round aborted.

    Raises:
        ValueError: ``encoded`` and the setup disagree, or a dropout is malformed.
    """
    started = time.perf_counter()
    setup = resolve_setup(setup_or_config, encoded, round_id)
    drops = check_dropouts(dropouts, setup.cohort)
    if signing_keys is None:
        keys = {c: Ed25519PrivateKey.generate() for c in setup.cohort}
    elif not set(setup.cohort) <= set(signing_keys):
        raise ValueError("signing_keys must hold a key for every cohort member")
    else:
        keys = dict(signing_keys)
    registry: dict[str, Ed25519PublicKey] = {c: keys[c].public_key() for c in setup.cohort}
    if shared_checks:
        registry = {c: SharedVerificationKey(k) for c, k in registry.items()}
    session = ServerSecureRound(setup, registry, stage_timeout=float("inf"), clock=lambda: 0.0)
    cohort = _Cohort(setup, session, drops)
    dtype = wire_dtype(setup)

    def advertise(c: str) -> None:
        cohort.members[c] = SecureRoundMember(setup, c, keys[c], registry)
        cohort.send(ADVERTISE, c, cohort.members[c].advertise())

    def share(c: str) -> None:
        cohort.send(SHARE, c, cohort.members[c].share(cohort.reply(ADVERTISE, c)))

    def mask(c: str) -> None:
        member = cohort.members[c]
        member.receive_shares(cohort.reply(SHARE, c))
        upload = member.mask_encoded(encoded[c]).astype(dtype, copy=False)
        cohort.up[c] += upload.nbytes
        session.add_masked(c, upload)

    def sign(c: str) -> None:
        cohort.send(CONSISTENCY, c, cohort.members[c].sign(cohort.reply(MASKED, c)))

    def unmask(c: str) -> None:
        payload = cohort.members[c].unmask(cohort.reply(CONSISTENCY, c))
        cohort.send(UNMASK, c, payload)

    steps = {ADVERTISE: advertise, SHARE: share, MASKED: mask, CONSISTENCY: sign, UNMASK: unmask}
    stats: dict[str, float] = {}
    with cohort_in_one_process() if shared_checks else contextlib.nullcontext():
        server_seconds, aborted = _run_stages(session, cohort, steps, stats)
    n = len(setup.cohort)
    stats.update(
        {
            "n": float(n),
            "k": float(setup.config().degree),
            "t": float(setup.threshold),
            "survivors": float(0 if aborted else len(session.survivors())),
            "seconds.clients": cohort.client_seconds,
            "seconds.server": server_seconds,
            "seconds.total": time.perf_counter() - started,
            "bytes_up_per_client": sum(cohort.up.values()) / n,
            "bytes_down_per_client": sum(cohort.down.values()) / n,
            "bytes_up_max": float(max(cohort.up.values())),
            "bytes_down_max": float(max(cohort.down.values())),
            "bytes_masked_per_client": float(setup.vector_length * dtype.itemsize),
            "secure": 1.0,
            "shared_checks": float(shared_checks),
        }
    )
    mode = "secagg" if setup.neighbours == 0 else "secagg+"
    if aborted:
        return CohortSum(None, (), aborted, stats, mode, None, cohort.left)
    return CohortSum(
        session.result, tuple(session.survivors()), None, stats, mode, session.decoded, cohort.left
    )
