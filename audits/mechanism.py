"""The client-level aggregation a run states it used, as the canary audit runs it.

``summary.json`` names the run's noise multiplier ``z``, clip norm ``C``, denominator ``W``,
noise placement, client sampling rate and number of rounds; :func:`mechanism_of_run` reads
them into a :class:`Mechanism` (a run without client-level DP: plain averaging) and refuses a
damaged field by name. The release carries the noise shares of the fewest honest clients any
released round has (:func:`noise_contributors`), not of every enrolled client: more noise
than a real adversary faces would understate the audit's bound.

The audit itself: :mod:`audits.canary_release` runs the mechanism on canaries, and
:mod:`audits.mechanism_audit` turns their scores into empirical epsilon lower bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from audits.observations import ckks_encrypted_layers
from fl_secure.errors import CheckpointError

NON_PRIVATE_DELTA = 1e-5
"""Delta the bound is stated for when the run claims no DP at all."""


@dataclass(frozen=True)
class Mechanism:
    """The client-level aggregation of a run, as configured."""

    noise_multiplier: float  # z; 0 = no noise
    clip_norm: float | None  # C; None = no clipping (non-private run)
    denominator: float  # W: the sum is divided by it
    placement: str  # central, local, distributed, or none
    rounds: int
    sample_rate: float  # q: probability that a client takes part in a round
    honest_clients: int  # honest cohort members adding noise shares (see noise_contributors)
    min_survivors: int  # t of the distributed placement
    delta: float
    accountant_epsilon: float | None  # None: the run claims no client-level DP
    privacy_unit: str = "client"  # the run's: none, client, example or identity (DP-SGD)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": self.clip_norm,
            "denominator": self.denominator,
            "noise_placement": self.placement,
            "rounds": self.rounds,
            "client_sample_rate": self.sample_rate,
            "honest_clients": self.honest_clients,
            "min_survivors": self.min_survivors,
        }


def noise_contributors(placement: str, *, secure: bool, min_clients: int) -> int:
    """Honest cohort members whose noise shares the audited release carries.

    The fewest any released round has, so that the canaries face no more noise than a real
    adversary does.

    ``distributed``: the ``t = min_clients`` shares that together carry ``z C``. ``local``:
    under secure aggregation the server sees a sum of at least ``min_clients`` updates, each
    with its own ``z C``; without it, each client's update alone, so one share (the canary's
    own). ``central`` (and no DP): honest clients add no noise. ``secure`` is False for a
    CKKS run that encrypted only some layers (:func:`secure_sum_of_every_layer`).
    """
    if placement == "distributed":
        return min_clients
    if placement == "local":
        return min_clients if secure else 1
    return 0


def secure_sum_of_every_layer(summary: dict[str, Any]) -> bool:
    """Whether the server saw only the sum of the clients' updates, in every shared layer.

    Secure aggregation (SecAgg, SecAgg+, CKKS) hides each update behind the sum; a CKKS run
    that encrypted only ``secure_aggregation.ckks_layers`` sent the other layers of each
    client's update in the clear (:func:`audits.observations.ckks_encrypted_layers`, the
    layers the audit's views also treat as seen one client at a time), and a canary on a
    coordinate of those layers reaches the server with its own noise share only.
    """
    scheme = (summary.get("secure_aggregation") or {}).get("scheme") or "none"
    if scheme == "none":
        return False
    return not (scheme == "ckks" and ckks_encrypted_layers(summary) is not None)


def mechanism_of_run(summary: dict[str, Any], *, num_clients: int, min_clients: int,
                     rounds: int, source: str = "summary.json") -> Mechanism:  # fmt: skip
    """The mechanism a run's ``summary.json`` states (no client-level DP: plain averaging).

    Raises:
        CheckpointError: naming ``source`` and the first privacy field of a client-level run
            that is missing or of the wrong type (``privacy.noise_multiplier``,
            ``privacy.clip_norm``, ``epsilon``, ``noise_placement``, ...), as
            :func:`audits.results.check_results` does for ``results.json``.
    """
    privacy = summary.get("privacy", {})
    if privacy is None:
        privacy = {}
    if not isinstance(privacy, dict):
        raise CheckpointError(f"{source} is damaged: privacy is {privacy!r}, not an object")
    unit = summary.get("privacy_unit") or "none"
    rounds_done = int(_number(summary, "rounds_completed", source) or rounds)
    if unit != "client":
        return Mechanism(
            noise_multiplier=0.0,
            clip_norm=None,
            denominator=float(num_clients),
            placement="none",
            rounds=rounds_done,
            sample_rate=1.0,
            honest_clients=num_clients,
            min_survivors=min_clients,
            delta=NON_PRIVATE_DELTA,
            accountant_epsilon=None,
            privacy_unit=str(unit),
        )

    def number(parent: dict[str, Any], key: str, where: str = "") -> float:
        value = _number(parent, key, source, where=where)
        if value is None:
            name = f"{where}{key}"
            raise CheckpointError(
                f"{source} is damaged: {name} is missing (expected a number; a client-level "
                "DP run states it)"
            )
        return value

    placement = summary.get("noise_placement") or privacy.get("noise_placement")
    if placement not in PLACEMENTS:
        raise CheckpointError(
            f"{source} is damaged: noise_placement is {placement!r}, not one of "
            f"{', '.join(PLACEMENTS)} (a client-level DP run states it)"
        )
    delta = _number(summary, "delta", source) or _number(privacy, "delta", source, "privacy.")
    return Mechanism(
        noise_multiplier=number(privacy, "noise_multiplier", "privacy."),
        clip_norm=number(privacy, "clip_norm", "privacy."),
        denominator=_number(privacy, "aggregate_denominator", source, "privacy.")
        or float(num_clients),
        placement=str(placement),
        rounds=int(_number(privacy, "rounds_accounted", source, "privacy.") or rounds_done),
        sample_rate=_number(privacy, "client_sample_rate", source, "privacy.") or 1.0,
        honest_clients=noise_contributors(
            str(placement), secure=secure_sum_of_every_layer(summary), min_clients=min_clients
        ),
        min_survivors=min_clients,
        delta=delta or NON_PRIVATE_DELTA,
        accountant_epsilon=number(summary, "epsilon"),
    )


#: The noise placements of a client-level DP run (``privacy.noise_placement``).
PLACEMENTS = ("central", "local", "distributed")


def _number(parent: dict[str, Any], key: str, source: str, where: str = "") -> float | None:
    """``parent[key]`` as a float; None when absent or null.

    Raises:
        CheckpointError: the value is there but not a number (``where`` prefixes its name).
    """
    value = parent.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"{source} is damaged: {where}{key} is {value!r}, not a number")
    return float(value)
