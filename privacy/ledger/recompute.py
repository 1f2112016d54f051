"""Recomputing every ledger row's epsilon from the parameters the rows record.

A row's ``epsilon`` is a running total: for a client-level row (``client_level`` or
``discarded_sum``) the composition, by the row's accountant at the row's delta, of every
client-level release up to and including it; for an ``example_level`` row the composition of
that party's DP-SGD steps so far, or the epsilon the client reported if larger
(:meth:`privacy.server_round.ServerPrivacy.round_entries`). A verifier that read the
epsilons instead of recomputing them would accept a ledger whose figures were edited.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fl_secure.errors import PrivacyError
from privacy.ledger.entries import CLIENT_KINDS, Entry

# The accountants (opacus, dp_accounting) are imported where epsilons are composed: reading
# a ledger's rows, and `fl-secure --help`, must not load them.

#: Relative difference tolerated between a recorded and a recomputed epsilon: the server
#: computes the same composition of the same JSON numbers, so only rounding may differ.
REL_TOL = 1e-6


def client_event(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A client-level row's accountant event (one release)."""
    # deferred: privacy.dp.client_level loads the calibration (and its accountants)
    from privacy.dp.client_level import placement_noise

    return {
        "noise_multiplier": payload["noise_multiplier"],
        "sample_rate": payload["sample_rate"],
        "num_steps": 1,
        "sampling": payload.get("sampling", "poisson"),
        "population": payload["population"] if payload.get("sampling") == "fixed_size" else None,
        # by placement, not by the row's noise_distribution: a row written before local noise
        # was integer says "gaussian", and a Gaussian of z has the same zCDP bound, so a
        # resumed run composes its rows with the new ones
        "noise": placement_noise(str(payload.get("noise_placement", "central"))),
    }


def composed_epsilon(accountant: str, history: list[dict[str, Any]], delta: float) -> float:
    """Epsilon of ``history`` under ``accountant`` at ``delta`` (0 for no event)."""
    # deferred: the accountants (opacus, dp_accounting) load only when an epsilon is composed
    from privacy.dp.accountants.registry import create_accountant

    if not history:
        return 0.0
    acc = create_accountant(accountant)
    acc.load_state_dict({"mechanism": accountant, "history": history})
    return acc.get_epsilon(delta)


def recompute_problems(entries: Sequence[Entry]) -> list[str]:
    """One problem per row whose recorded epsilon is not what its parameters give.

    Rows are read in seq order; each problem names the seq, both figures and the history
    the figure was composed from.
    """
    # deferred: privacy.dp.example_level loads DP-SGD's accounting
    from privacy.dp.example_level import example_event

    problems: list[str] = []
    client: list[dict[str, Any]] = []
    example: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        p = e.payload
        try:
            if e.kind in CLIENT_KINDS:
                client.append(client_event(p))
                expected = composed_epsilon(str(p["accountant"]), client, float(p["delta"]))  # type: ignore[arg-type]
                what = f"the {len(client)} client-level releases up to it"
            elif e.kind == "example_level":
                history = example.setdefault(e.party, [])
                history.extend(example_event(p))
                composed = composed_epsilon(str(p["accountant"]), history, float(p["delta"]))  # type: ignore[arg-type]
                reported = p.get("client_reported_epsilon", 0.0)
                reported = float(reported) if isinstance(reported, int | float) else 0.0
                expected = max(composed, reported)
                what = f"party {e.party}'s DP-SGD steps up to it (or its reported epsilon)"
            else:
                continue
        except (KeyError, TypeError, ValueError, PrivacyError) as exc:
            problems.append(f"seq {e.seq}: its epsilon cannot be recomputed ({exc})")
            continue
        recorded = p.get("epsilon")
        if not isinstance(recorded, int | float) or not math.isclose(
            float(recorded), expected, rel_tol=REL_TOL, abs_tol=1e-12
        ):
            problems.append(
                f"seq {e.seq}: {e.kind} epsilon {recorded!r} is not the {expected:.6g} that "
                f"{what} give ({p.get('accountant')} accountant, delta {p.get('delta')}): "
                "epsilon edited"
            )
    return problems
