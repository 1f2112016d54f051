"""One update that left a site: a row of its site ledger (:mod:`privacy.ledger.site_ledger`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fl_secure.config import Config
from fl_secure.config.values import DPSGD_UNITS
from fl_secure.errors import PrivacyError


@dataclass(frozen=True)
class Release:
    """One update that left the site.

    Attributes:
        run_id: The run (the server's id for it, from the join).
        round: The round.
        nonce: The task's nonce (hex): one attempt of the round.
        unit: The run's ``privacy.unit`` ("none", "client", "example", "identity").
        placement: ``privacy.noise_placement``.
        scheme: ``secure_aggregation.scheme``.
        noise_multiplier: Client level: ``z`` of the released sum with honest peers; 0 when
            the release carries no client-level noise against the server.
        own_noise_multiplier: Client level: ``z`` of this site's own noise alone (0: none).
        time: When it was recorded (UTC, ISO 8601).
        dpsgd_noise_multiplier: Example or identity level: the DP-SGD noise multiplier (0
            otherwise).
        dpsgd_sample_rate: Example or identity level: the Poisson sampling rate ``q`` (of
            images, or of identities; 0 otherwise).
        dpsgd_steps: Example or identity level: DP-SGD steps of the release (0: the
            unchanged parameters, or no DP-SGD; -1: not recorded, as in a version 1 row).
    """

    run_id: str
    round: int
    nonce: str
    unit: str
    placement: str
    scheme: str
    noise_multiplier: float
    own_noise_multiplier: float
    time: str
    dpsgd_noise_multiplier: float = 0.0
    dpsgd_sample_rate: float = 0.0
    dpsgd_steps: int = 0

    @classmethod
    def from_dict(cls, row: Mapping[str, Any], where: str) -> Release:
        """A row read back from the file; PrivacyError names a damaged one."""
        types = {
            "run_id": str,
            "round": int,
            "nonce": str,
            "unit": str,
            "placement": str,
            "scheme": str,
            "noise_multiplier": (int, float),
            "own_noise_multiplier": (int, float),
            "time": str,
        }
        dpsgd = {
            "dpsgd_noise_multiplier": (int, float),
            "dpsgd_sample_rate": (int, float),
            "dpsgd_steps": int,
        }
        if isinstance(row, Mapping) and set(row) == set(types):  # a version 1 row
            row = {**row, "dpsgd_noise_multiplier": 0, "dpsgd_sample_rate": 0}
            row["dpsgd_steps"] = -1 if row["unit"] == "example" else 0
        types |= dpsgd
        if not isinstance(row, Mapping) or set(row) != set(types):
            raise PrivacyError(f"{where}: a release row must have exactly the keys {sorted(types)}")
        for key, kind in types.items():
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, kind):  # type: ignore[arg-type]
                raise PrivacyError(f"{where}: release field {key!r} has the wrong type")
        for key in ("noise_multiplier", "own_noise_multiplier", "dpsgd_noise_multiplier"):
            try:
                value = float(row[key])
            except OverflowError:
                value = math.inf
            if not (math.isfinite(value) and value >= 0):
                raise PrivacyError(f"{where}: release field {key!r} is not a finite number >= 0")
        if not 0 <= row["dpsgd_sample_rate"] <= 1 or row["dpsgd_steps"] < -1:
            raise PrivacyError(
                f"{where}: release fields dpsgd_sample_rate/dpsgd_steps out of range"
            )
        return cls(**{k: row[k] for k in types})

    def example_events(self, *, own: bool) -> tuple[float, tuple[float, float, int] | None]:
        """This release for one image: (Gaussian ``mu`` at sensitivity 1, DP-SGD steps).

        ``mu``: a client-level release, ``2 / z`` (one image moves the clipped update by up
        to ``2 C``); ``inf`` for a release without noise of either kind. The DP-SGD part is
        ``(z, q, steps)`` of an example-level release that trained, else None. An
        identity-level release counts the same: one image belongs to one identity, whose
        clipped gradient bounds its influence, and that identity is sampled at rate ``q``.
        """
        if self.unit in DPSGD_UNITS:
            if self.dpsgd_steps < 0:
                return math.inf, None  # a version 1 row: its steps were not recorded
            if self.dpsgd_steps == 0:
                return 0.0, None  # the unchanged parameters: data-independent
            z, q = self.dpsgd_noise_multiplier, self.dpsgd_sample_rate
            if not (z > 0 and q > 0):
                return math.inf, None
            return 0.0, (z, q, self.dpsgd_steps)
        z = self.own_noise_multiplier if own else self.noise_multiplier
        return (2.0 / z if z > 0 else math.inf), None


def release_for(
    config: Config,
    run_id: str,
    round_: int,
    nonce: bytes,
    dpsgd: tuple[float, float, int] | None = None,
) -> Release:
    """The row of a release under ``config`` (the run config this site joined under).

    ``dpsgd``: example level, the release's DP-SGD ``(z, q, steps)`` as the site ran (or
    plans) it; ``steps`` 0 for the unchanged parameters. An example-level row without it
    records its steps as unknown (-1), which counts as unbounded, never as free.

    Noise from a seeded generator (``privacy.secure_rng = false``: seeded from ``run.seed``
    and the client id, both known to the server) is no noise against the server: the row's
    noise multipliers are 0, so every figure of the site is unbounded (``inf``).
    """
    p, s = config.privacy, config.secure_aggregation
    steps = 0
    if p.dpsgd:
        steps = int(dpsgd[2]) if dpsgd is not None else -1
    z = own = 0.0
    seeded = p.enabled and not p.secure_rng  # the server can regenerate seeded noise
    if p.unit == "client" and p.noise_placement in ("local", "distributed") and not seeded:
        z = p.noise_multiplier
        own = z
        if p.noise_placement == "distributed":
            own = z / math.sqrt(config.server.min_clients)
    return Release(
        run_id=run_id,
        round=round_,
        nonce=nonce.hex(),
        unit=p.unit,
        placement=p.noise_placement,
        scheme=s.scheme,
        noise_multiplier=float(z),
        own_noise_multiplier=float(own),
        time=datetime.now(UTC).isoformat(timespec="seconds"),
        dpsgd_noise_multiplier=float(dpsgd[0]) if dpsgd and p.dpsgd and not seeded else 0.0,
        dpsgd_sample_rate=float(dpsgd[1]) if dpsgd and p.dpsgd else 0.0,
        dpsgd_steps=steps,
    )
