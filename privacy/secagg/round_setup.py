"""The setup of one secure round: what every cohort member must agree on before it starts.

:class:`RoundSetup` travels in the task (``Task.secagg_setup``): round id, cohort, threshold,
neighbours, modulus and encoding; every client derives the same
:class:`~privacy.secagg.config.SecAggConfig` from it. The server builds it with
:func:`make_setup` from the run config, and a client rebuilds it to refuse a weaker one
(:func:`check_setup`). With the distributed discrete Gaussian (:func:`check_ddg`) each client
adds integer noise to its encoded update.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from fl_secure.config import Config, SecureAggregationConfig
from fl_secure.errors import JSON_DOCUMENT_ERRORS, PrivacyError, ProtocolError
from privacy.dp.discrete_gaussian import check_ddg_slack, ddg_client_sigma, integer_l2_bound
from privacy.secagg.config import SecAggConfig
from privacy.secagg.consistency import signature_threshold
from privacy.secagg.parameters import Rates, derive, smallest_threshold
from privacy.secagg.parameters import check as check_parameters


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
    corrupt: int = 0  # c: cohort members that may collude (the consistency check's threshold)

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
            corrupt=self.corrupt,
        )

    def to_bytes(self) -> bytes:
        """Canonical JSON (version 3: version 1 plus ``min_inputs`` and ``corrupt``)."""
        doc = {
            "version": 3,
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
            "corrupt": self.corrupt,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RoundSetup:
        """Strict inverse of :meth:`to_bytes`."""
        try:
            doc = json.loads(data)
            if doc.pop("version") != 3:
                raise ValueError("unsupported version (server and client releases differ)")
            keys = {"round_id", "cohort", "threshold", "neighbours", "modulus_bits",
                    "clip_range", "scale", "vector_length", "encoding", "ddg_sigma",
                    "clip_norm", "min_inputs", "corrupt"}  # fmt: skip
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
                corrupt=int(doc["corrupt"]),
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


def rates(cfg: SecureAggregationConfig) -> Rates:
    """The corruption and dropout rates and security parameters a run states."""
    return Rates(
        cfg.corrupt_fraction, cfg.dropout_fraction, cfg.security_bits, cfg.correctness_bits
    )


def neighbourhood(cfg: SecureAggregationConfig, n: int) -> tuple[int, int]:
    """``(k, t)``: each client's neighbours in a cohort of ``n``, and the Shamir threshold.

    SecAgg+ with ``neighbours = 0`` (or ``threshold = 0``) derives them from ``n`` and the
    stated rates (:func:`privacy.secagg.parameters.derive`); set values must meet the same
    bounds (:func:`privacy.secagg.parameters.check`). SecAgg (the complete graph) keeps the
    majority threshold by default, and any threshold must exceed the ``floor(gamma n)``
    clients that may collude. Both must leave, after ``floor(delta n)`` dropouts, the
    signatures the consistency check needs
    (:func:`~privacy.secagg.consistency.signature_threshold`).

    Raises:
        PrivacyError: The configured threshold is not a strict majority of ``k`` and at most
            ``k`` (:class:`privacy.secagg.config.SecAggConfig`'s rule), ``(k, t)`` fails
            the bounds of the stated rates, or too few may remain to sign the survivor set.
            (An odd SecAgg+ ``k``, which has no graph on an
            odd cohort, is refused when the config is read.)
    """
    stated = rates(cfg)
    if cfg.scheme == "secagg+" and (cfg.neighbours == 0 or cfg.threshold == 0):
        dk, dt = derive(n, stated)
        if cfg.neighbours == 0:
            k = dk
        else:
            k = n - 1 if cfg.neighbours >= n - 1 else cfg.neighbours
        threshold = dt if k == dk else (smallest_threshold(n, k, stated) or k)
    else:
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
    if k == n - 1:
        c = stated.corrupt(n)
        if threshold <= c:
            raise PrivacyError(
                f"secure_aggregation.threshold = {threshold}: the {c} of {n} clients that may "
                f"collude (corrupt_fraction {cfg.corrupt_fraction:g}) could pool {c} shares "
                f"of every client's secrets; use a threshold > {c}"
            )
    else:
        check_parameters(n, k, threshold, stated)
    c, d = stated.corrupt(n), stated.dropped(n)
    need = signature_threshold(n, c)
    if n - d < need:
        raise PrivacyError(
            f"the consistency check needs {need} of a cohort of {n} to sign the survivor set "
            f"(more than (n + c) / 2 with c = {c} corrupt, corrupt_fraction "
            f"{cfg.corrupt_fraction:g}), but with dropout_fraction {cfg.dropout_fraction:g} only "
            f"{n - d} may remain; lower corrupt_fraction or dropout_fraction, or use larger cohorts"
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
        corrupt=rates(cfg).corrupt(n),
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
    if setup.corrupt < expected.corrupt:  # a lower c: fewer signatures on the survivor set
        problems.append(f"corrupt {setup.corrupt} < {expected.corrupt}")
    if problems:
        raise ProtocolError(
            "refusing a secure-aggregation setup weaker than the run this client joined: "
            + "; ".join(problems)
        )


def check_ddg(
    ddg: tuple[float, float, int], cfg: SecureAggregationConfig, n: int, d: int
) -> tuple[float, float]:
    """``(sigma, C)`` of the distributed discrete Gaussian, after two checks.

    The sum of any ``t`` to ``n`` clients' noise must be as private as the zCDP bound the run
    is accounted with (KLS21's ``tau`` term within
    :data:`~privacy.dp.discrete_gaussian.ZCDP_SLACK`), and the cohort's noisy sum must not
    wrap mod ``2^bits`` (10 standard deviations of headroom).
    """
    z, clip_norm, t = ddg
    if cfg.modulus_bits > 62:
        raise PrivacyError(
            f"secure_aggregation.modulus_bits = {cfg.modulus_bits}: the distributed discrete "
            "Gaussian's integer arithmetic supports up to 62"
        )
    gamma = 2.0**-cfg.scale_bits
    bound = integer_l2_bound(clip_norm, gamma, d)
    sigma = ddg_client_sigma(z, bound, t)
    check_ddg_slack(sigma, max(n, t), d, z)
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
