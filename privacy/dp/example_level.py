"""Example-level DP-SGD releases as the server accounts them: what a client reports, its limits.

With ``privacy.unit = "example"`` each client runs DP-SGD (:mod:`privacy.dp.dpsgd`), with
``"identity"`` identity-level DP-SGD (:mod:`privacy.dp.identity_dpsgd`), and sends,
with each update, the data-independent figures of its release (:data:`EXAMPLE_KEYS`). The
server composes every client's releases in its own accountant, so it refuses figures it could
not account (:func:`check_example_metrics`), and a client refuses to train a round the server
would refuse. Both units report and are accounted alike (a Poisson-subsampled Gaussian per
step over the site's records, images or identities); their ledger rows are of the kind
``example_level`` (one client's DP-SGD release) and say which record in ``privacy_unit``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fl_secure.errors import PrivacyError, ProtocolError
from fl_secure.messages import LocalTraining
from privacy.dp.accountants.accountant import ADJACENCY, MIN_ACCOUNTED_NOISE
from privacy.dp.dpsgd import dpsgd_steps

#: Metrics an example-level client reports with each update (data-independent figures).
EXAMPLE_KEYS = ("dp_epsilon", "dp_steps", "dp_noise_multiplier", "dp_sample_rate")
#: Example level: the smallest per-step sample rate a client may state (a batch of one in a
#: million images). Below it the task's step count ``epochs / q`` grows without bound.
MIN_DP_SAMPLE_RATE = 1e-6
#: Example level: the most DP-SGD steps one client's round may claim. The server's
#: accountant composes them; at 1e5 steps per round over 20 rounds the PRV accountant takes
#: about 3 s and 1.3 GB, and far more steps could exhaust the server's memory.
MAX_DP_STEPS_PER_ROUND = 100_000


def check_example_metrics(
    party: str, metrics: Mapping[str, float], training: LocalTraining
) -> None:
    """Refuse an example-level update whose DP figures the server's accountant could not take.

    ``dp_steps`` may not exceed what the round's task asks for at the stated rate.

    Raises:
        ProtocolError: Naming the key and what it must be.
    """
    missing = [k for k in EXAMPLE_KEYS if k not in metrics]
    if missing:
        raise ProtocolError(
            f"client {party} sent no example-level accounting ({', '.join(missing)}); its "
            "update cannot be released under example-level DP"
        )
    v = {k: float(metrics[k]) for k in EXAMPLE_KEYS}
    bad = [k for k, x in v.items() if not math.isfinite(x)]
    if bad:
        raise ProtocolError(f"client {party}: {', '.join(bad)} not finite")
    q, z, steps = v["dp_sample_rate"], v["dp_noise_multiplier"], v["dp_steps"]
    if not MIN_DP_SAMPLE_RATE <= q <= 1:
        raise ProtocolError(
            f"client {party}: dp_sample_rate = {q:g}, expected [{MIN_DP_SAMPLE_RATE:g}, 1]"
        )
    if z < MIN_ACCOUNTED_NOISE:
        raise ProtocolError(
            f"client {party}: dp_noise_multiplier = {z:g}, below the {MIN_ACCOUNTED_NOISE:g} "
            "the accountants take"
        )
    if v["dp_epsilon"] < 0:
        raise ProtocolError(f"client {party}: dp_epsilon = {v['dp_epsilon']:g} < 0")
    most = min(dpsgd_steps(1, training, q), MAX_DP_STEPS_PER_ROUND)
    if steps != int(steps) or not 0 <= steps <= most:
        raise ProtocolError(
            f"client {party}: dp_steps = {steps:g}, expected an integer in 0..{most} (the "
            f"round's task at q = {q:g}, at most {MAX_DP_STEPS_PER_ROUND} per round)"
        )


def example_payload(
    party: str,
    metrics: Mapping[str, float],
    *,
    delta: float,
    accountant: str,
    clip_norm: float,
    unit: str = "example",
) -> dict[str, Any]:
    """A DP-SGD ledger row's payload from a client's reported figures (no epsilon yet).

    ``unit``: the run's ``privacy.unit``, ``example`` or ``identity`` (the record the row's
    ``sample_rate`` and ``clip_norm`` are per).

    Raises:
        PrivacyError: The client reported no example-level accounting.
    """
    missing = [k for k in EXAMPLE_KEYS if k not in metrics]
    if missing:
        raise PrivacyError(
            f"client {party} sent no example-level accounting ({', '.join(missing)}); "
            "its update cannot be released under example-level DP"
        )
    reported = float(metrics["dp_epsilon"])
    return {
        "client_reported_epsilon": reported,
        "delta": delta,
        "accountant": accountant,
        "steps": int(metrics["dp_steps"]),
        "noise_multiplier": float(metrics["dp_noise_multiplier"]),
        "sample_rate": float(metrics["dp_sample_rate"]),
        "clip_norm": clip_norm,
        "adjacency": ADJACENCY["poisson"],
        "privacy_unit": unit,
        "noise_secure": bool(metrics.get("dp_noise_secure", 0.0) > 0),
    }


def example_event(payload: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An example-level ledger row's accountant event (none when the client took no step)."""
    steps = payload["steps"]
    if not isinstance(steps, int):  # pragma: no cover - validated by the ledger
        raise PrivacyError(f"example-level row with steps {steps!r}")
    if steps <= 0:
        return []
    return [
        {
            "noise_multiplier": payload["noise_multiplier"],
            "sample_rate": payload["sample_rate"],
            "num_steps": steps,
        }
    ]
