"""Privacy-loss-random-variable (PRV) accountant.

Thin wrapper over ``opacus.accountants.PRVAccountant``, which implements Gopi, Lee &
Wutschitz, "Numerical Composition of Differential Privacy" (NeurIPS 2021,
arXiv:2106.02848): the PRV of each step is discretised on a safe domain (Sec. 5, Thm. 5.5)
and composed by FFT. The value returned is the *upper* bound of the epsilon estimate, so it
is a guarantee within ``eps_error`` of the true epsilon. Adjacency: add/remove-one.
"""

from __future__ import annotations

from typing import ClassVar

from opacus.accountants import PRVAccountant as _OpacusPRV

from privacy.dp.accountants.accountant import Accountant


class PRVAccountant(Accountant):
    """PRV accountant (tight, FFT-based; default for example-level DP)."""

    name: ClassVar[str] = "prv"

    def __init__(self, eps_error: float = 0.01) -> None:
        super().__init__()
        self.eps_error = eps_error

    def _epsilon(self, delta: float) -> float:
        opacus = _OpacusPRV()
        opacus.history = [(e.noise_multiplier, e.sample_rate, e.num_steps) for e in self.history]
        return float(opacus.get_epsilon(delta, eps_error=self.eps_error))
