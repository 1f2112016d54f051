"""SecAgg+'s ``k`` and ``t`` from the cohort size and the rates a run assumes (Bell et al.).

Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead" (CCS 2020),
choose the neighbours ``k`` and threshold ``t`` from ``n``, the fraction ``gamma`` of clients
that may be corrupt (collude with each other or with the server), the fraction ``delta`` that
may drop out and a statistical security parameter ``sigma``. The graph here is a Harary graph
``H_{k,n}`` whose ring order is a uniformly random permutation (:mod:`privacy.secagg.graph`),
so the ``k`` neighbours of a client are a uniformly random ``k``-subset of the other ``n - 1``
clients and three probabilities are exact or exactly bounded with integer arithmetic
(``math.comb``, no floating point in the comparisons):

* **privacy** (Bell et al.'s "fewer than ``t`` corrupt neighbours" condition): with
  ``c = floor(gamma n)`` corrupt clients, an honest client's corrupt neighbours are
  hypergeometric ``X ~ H(n - 1, c, k)``; ``t`` of them pool its shares of both ``b_u`` and
  ``s_u^SK``. Required: ``(n - c) P[X >= t] <= 2^-sigma`` (union over the honest clients).
* **connected honest survivors**: the ``r = c + floor(delta n)`` corrupt or dropped clients
  are random positions on the ring; the honest survivors' subgraph is disconnected only if two
  separate runs of ``k / 2`` consecutive positions are all removed, which has probability at
  most ``n^2 / 2 * C(n - k, r - k) / C(n, r)``. Required: ``<= 2^-sigma``.
* **correctness**: with ``d = floor(delta n)`` dropouts a client's dropped neighbours are
  ``Y ~ H(n - 1, d, k)`` and it needs ``t`` surviving ones. Required:
  ``n P[Y > k - t] <= 2^-eta`` (a failure only aborts the round).

:func:`derive` returns the smallest even ``k`` (and for it the smallest ``t > k / 2``) that
meets all three; :func:`check` refuses a user-set pair that does not, naming the bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from fl_secure.errors import PrivacyError


@dataclass(frozen=True)
class Rates:
    """What a run assumes: corrupt and dropout fractions, security and correctness bits."""

    corrupt_fraction: float
    dropout_fraction: float
    security_bits: int = 40
    correctness_bits: int = 20

    def corrupt(self, n: int) -> int:
        """``c = floor(gamma n)``: the most clients that may collude in a cohort of ``n``."""
        return math.floor(Fraction(str(self.corrupt_fraction)) * n)  # exact: 0.3 * 10 is 3

    def dropped(self, n: int) -> int:
        """``d = floor(delta n)``: the most clients that may drop out of a cohort of ``n``."""
        return math.floor(Fraction(str(self.dropout_fraction)) * n)


def hypergeom_sf(population: int, marked: int, draws: int, at_least: int) -> Fraction:
    """Exactly ``P[X >= at_least]`` for ``X ~ H(population, marked, draws)`` (no replacement)."""
    hi = min(marked, draws)
    if at_least > hi:
        return Fraction(0)
    lo = max(at_least, 0, draws - (population - marked))
    num = sum(
        math.comb(marked, i) * math.comb(population - marked, draws - i) for i in range(lo, hi + 1)
    )
    return Fraction(num, math.comb(population, draws))


def exposure(n: int, corrupt: int, k: int, t: int) -> Fraction:
    """``P[X >= t]``, ``X ~ H(n - 1, corrupt, k)``: one honest client's secrets are pooled."""
    return hypergeom_sf(n - 1, corrupt, k, t)


def disconnection_bound(n: int, removed: int, k: int) -> Fraction:
    """Upper bound on ``P[the survivors of H_{k,n} minus `removed` random clients split]``.

    On the ring each client reaches ``k / 2`` positions either side, so the survivors split
    only if two maximal runs of at least ``k / 2`` removed positions exist; each starts a
    window of ``k / 2`` removed positions, and the two windows are disjoint.
    """
    if k >= n - 1:
        return Fraction(0)  # complete graph
    m = k // 2
    if removed < 2 * m:
        return Fraction(0)
    pairs = n * n // 2
    p = Fraction(pairs * math.comb(n - 2 * m, removed - 2 * m), math.comb(n, removed))
    return min(p, Fraction(1))


def failure(n: int, dropped: int, k: int, t: int) -> Fraction:
    """``n P[Y > k - t]``, ``Y ~ H(n - 1, dropped, k)``: some client keeps fewer than ``t``."""
    return min(Fraction(1), n * hypergeom_sf(n - 1, dropped, k, k - t + 1))


def problems(n: int, k: int, t: int, rates: Rates) -> list[str]:
    """Which of the three conditions ``(k, t)`` fails for a cohort of ``n`` (empty: none)."""
    c, d = rates.corrupt(n), rates.dropped(n)
    sigma, eta = Fraction(1, 2**rates.security_bits), Fraction(1, 2**rates.correctness_bits)
    out = []
    p = (n - c) * exposure(n, c, k, t)
    if p > sigma:
        out.append(
            f"with {c} of {n} clients colluding (corrupt_fraction {rates.corrupt_fraction:g}) "
            f"an honest client has >= t = {t} corrupt neighbours among k = {k} with "
            f"probability {float(p):.3g} (over the honest clients) > 2^-{rates.security_bits}"
        )
    q = disconnection_bound(n, c + d, k)
    if q > sigma:
        out.append(
            f"with {c} corrupt and {d} dropped of {n} clients the honest survivors may split "
            f"(bound {float(q):.3g} > 2^-{rates.security_bits})"
        )
    f = failure(n, d, k, t)
    if f > eta:
        out.append(
            f"with {d} of {n} clients dropping (dropout_fraction {rates.dropout_fraction:g}) "
            f"some client keeps fewer than t = {t} of its k = {k} neighbours with probability "
            f"{float(f):.3g} > 2^-{rates.correctness_bits}"
        )
    return out


def smallest_threshold(n: int, k: int, rates: Rates) -> int | None:
    """The smallest ``t`` in ``k // 2 + 1 .. k`` meeting the privacy condition, or None."""
    c = rates.corrupt(n)
    sigma = Fraction(1, 2**rates.security_bits)
    for t in range(k // 2 + 1, k + 1):
        if (n - c) * exposure(n, c, k, t) <= sigma:
            return t
    return None


@lru_cache(maxsize=256)
def derive(n: int, rates: Rates) -> tuple[int, int]:
    """``(k, t)``: the smallest even ``k < n - 1`` and its smallest ``t`` meeting all three.

    ``k = n - 1`` (the complete graph, SecAgg) when no sparser graph does.

    Raises:
        PrivacyError: If even the complete graph cannot meet them (too many corrupt or
            dropped clients for any threshold).
    """
    for k in range(2, n - 1, 2):
        t = smallest_threshold(n, k, rates)
        if t is not None and not problems(n, k, t, rates):
            return k, t
    k = n - 1
    t = smallest_threshold(n, k, rates) or k
    found = problems(n, k, t, rates)
    if found:
        raise PrivacyError(
            f"no neighbours/threshold protect a cohort of {n} at the stated rates: "
            + "; ".join(found)
        )
    return k, t


def check(n: int, k: int, t: int, rates: Rates) -> None:
    """Refuse a configured ``(k, t)`` that fails a condition, naming the derived bound.

    Raises:
        PrivacyError: Naming each failed condition and the derived ``(k, t)``.
    """
    found = problems(n, k, t, rates)
    if found:
        try:
            dk, dt = derive(n, rates)
            hint = f"the rates allow k >= {dk} with t = {dt} (0 derives them)"
        except PrivacyError as exc:
            hint = str(exc)
        raise PrivacyError(
            f"secure_aggregation: neighbours = {k}, threshold = {t} are too small for a cohort "
            f"of {n}: " + "; ".join(found) + f"; {hint}"
        )
