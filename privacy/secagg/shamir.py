"""Shamir secret sharing over the prime field GF(2^521 - 1) (Shamir, CACM 22(11), 1979).

SecAgg shares each client's self-mask seed ``b_u`` and mask private key ``s_u^SK`` among its
neighbours with these: any ``t`` shares rebuild a secret, fewer say nothing about it.
Coefficients come from :mod:`secrets`.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from fl_secure.errors import PrivacyError

PRIME = 2**521 - 1  # Mersenne prime: the Shamir field GF(p); 32-byte secrets are < p
FIELD_BYTES = 66  # big-endian width of one field element


def shamir_split(
    secret: int, xs: Sequence[int], threshold: int, *, prime: int = PRIME
) -> list[int]:
    """Shares ``f(x)`` of ``secret`` for each abscissa in ``xs``, ``t``-out-of-``len(xs)``.

    ``f`` is a uniformly random polynomial of degree ``threshold - 1`` with ``f(0) = secret``
    (coefficients from :func:`secrets.randbelow`), so any ``threshold - 1`` shares are
    independent of the secret and any ``threshold`` determine it.

    Args:
        secret: The secret, ``0 <= secret < prime``.
        xs: Distinct abscissae in ``[1, prime)``.
        threshold: ``t >= 1``, at most ``len(xs)``.
        prime: The field modulus.

    Returns:
        The ordinates ``f(x)`` in the order of ``xs``.

    Raises:
        PrivacyError: If the arguments are out of range.
    """
    if not 0 <= secret < prime:
        raise PrivacyError("the secret must be an element of the field")
    _check_abscissae(xs, prime)
    if not 1 <= threshold <= len(xs):
        raise PrivacyError(f"threshold {threshold} must be in [1, {len(xs)}] (number of shares)")
    coeffs = [secret] + [secrets.randbelow(prime) for _ in range(threshold - 1)]
    out = []
    for x in xs:
        acc = 0
        for c in reversed(coeffs):
            acc = (acc * x + c) % prime
        out.append(acc)
    return out


def shamir_interpolate(
    points: Sequence[tuple[int, int]], at: int = 0, *, prime: int = PRIME
) -> int:
    """Value at ``at`` of the polynomial of degree ``< len(points)`` through ``points``.

    With ``at = 0`` and ``t`` shares this reconstructs the secret (Lagrange interpolation,
    exact integer arithmetic mod ``prime``).

    Args:
        points: ``(x, y)`` pairs with distinct abscissae in ``[0, prime)``.
        at: Where to evaluate the polynomial.
        prime: The field modulus.

    Returns:
        ``f(at)`` in ``[0, prime)``.

    Raises:
        PrivacyError: If there are no points or the abscissae are not distinct.
    """
    if not points:
        raise PrivacyError("interpolation needs at least one share")
    xs = [x for x, _ in points]
    _check_abscissae(xs, prime, lowest=0)
    total = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * (at - xj) % prime
                den = den * (xi - xj) % prime
        total = (total + yi * num * pow(den, -1, prime)) % prime
    return total


def _check_abscissae(xs: Sequence[int], prime: int, lowest: int = 1) -> None:
    if len(set(xs)) != len(xs):
        raise PrivacyError("Shamir abscissae must be distinct")
    if any(not lowest <= x < prime for x in xs):
        raise PrivacyError(f"Shamir abscissae must be in [{lowest}, prime)")
