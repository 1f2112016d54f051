"""Amplification by the server's cohort sampling: when a client-level epsilon may take it.

A client-level round drawn by Poisson sampling at rate ``q`` is, to a party that sees the
released model and nothing else, a subsampled Gaussian: the accountant's epsilon at rate
``q`` ("amplified") is far below the Gaussian's at rate 1. That figure needs the cohort to be
drawn exactly as modelled and kept secret from that party. In a run neither holds:

* every round's cohort and its size are published: the ledger's ``cohort_size``, the client
  ids in ``metrics.jsonl``, a secure round's cohort and survivors; the server, which draws
  it, knows it anyway;
* a draw smaller than ``server.min_clients`` is drawn again (as is a cohort whose attempt
  failed), so the cohort a round is released with is conditioned on its size.

Measured with dp_accounting's PLD on the mechanism actually run (central noise, N = 20,
q = 0.1, T = 20, z = 0.949): the amplified figure 3.99 is exceeded by the exact epsilon of
the redrawn, published draw (``tests/privacy/dp/test_sampling_soundness.py``). So the stated
``epsilon`` of a Poisson-sampled run is accounted **without** amplification (rate 1, every
client in every round: it bounds any draw, redrawn or published, and the server's own, which
may include a client in every round), under zero-out adjacency (the enrolled clients are
public, so add/remove would be told apart by the ids). The amplified figure is stated beside
it as ``epsilon_amplified``, naming whom it trusts.

Fixed-size cohorts (``server.clients_per_round``) keep their replace-one accounting at
``cohort / population``: their size is never redrawn, but their membership is published too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from privacy.dp.client_level import ClientLevelPlan


def accounted_sample_rate(sampling: str, sample_rate: float) -> float:
    """The inclusion probability a run's client-level epsilon is accounted at.

    1 for Poisson cohorts (see the module docstring), ``sample_rate`` for fixed-size ones.
    """
    return sample_rate if sampling == "fixed_size" else 1.0


def amplification_statement(
    plan: ClientLevelPlan, amplified: float | None, redrawn: list[int]
) -> dict[str, Any]:
    """The summary's keys on sampling: the accounted rate, and the amplified figure's terms.

    Args:
        plan: The run's client-level mechanism.
        amplified: The releases composed at the drawn rate (``None``: not computed).
        redrawn: Rounds released by a cohort drawn again after a failed attempt.

    Returns:
        ``accounted_sample_rate``, ``amplification`` (what ``epsilon`` takes) and, for
        Poisson cohorts below rate 1, ``epsilon_amplified`` (``None`` once a round was
        redrawn: not a bound then) and ``epsilon_amplified_trusts``.
    """
    out: dict[str, Any] = {"accounted_sample_rate": plan.accounted_rate}
    if plan.sampling == "fixed_size":
        out["amplification"] = (
            f"fixed-size cohorts: epsilon is amplified at cohort / population "
            f"{plan.sample_rate:g} (replace-one); it trusts the server to draw them uniformly"
        )
        return out
    if plan.sample_rate >= 1.0:
        out["amplification"] = "none: every client in every round"
        return out
    if plan.noise == "discrete_gaussian":
        # zCDP bounds integer noise; amplification by sampling is proven for the continuous
        # Gaussian only, so no amplified figure is offered beside it
        amplified = None
        trusts_end = (
            "not offered: amplification by sampling is not proven for integer (discrete "
            "Gaussian) noise, which is accounted by its zCDP bound"
        )
    elif redrawn:
        trusts_end = (
            f"not a bound here: rounds {redrawn} were released by a cohort drawn again after "
            "a failed attempt (too small a draw, too few updates)"
        )
    else:
        trusts_end = "no round of this run was redrawn"
    out.update(
        {
            "amplification": "none in epsilon: each round's cohort and its size are "
            "published (ledger, metrics.jsonl, secure-aggregation records) and known to the "
            "server, so epsilon counts every client in every round; it holds against anyone, "
            "the server included",
            "epsilon_amplified": None if redrawn else amplified,  # None for integer noise
            "epsilon_amplified_trusts": "the server, to draw each cohort by Poisson sampling "
            f"at rate {plan.sample_rate:g} honestly and in secret, and the party it is stated "
            "to, to see nothing of the cohorts (so not the server, nor a reader of the run "
            f"folder or the ledger); {trusts_end}",
        }
    )
    return out
