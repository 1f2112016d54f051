"""Rényi-DP accountant for the Poisson-subsampled Gaussian mechanism.

Thin wrapper over Opacus' RDP analysis (``opacus.accountants.analysis.rdp``), which
implements Mironov, Talwar & Zhang, "Rényi Differential Privacy of the Sampled Gaussian
Mechanism" (2019, arXiv:1908.10530), Sec. 3.3, and the RDP-to-(epsilon, delta) conversion
of Balle et al., "Hypothesis Testing Interpretations and Rényi DP" (AISTATS 2020), Thm. 21.
Orders are Opacus' ``RDPAccountant.DEFAULT_ALPHAS`` so results equal Opacus' exactly.
Adjacency: add/remove-one.
"""

from __future__ import annotations

from typing import ClassVar

from opacus.accountants import RDPAccountant as _OpacusRDP
from opacus.accountants.analysis import rdp as _rdp_analysis

from privacy.dp.accountants.accountant import Accountant

DEFAULT_ORDERS: tuple[float, ...] = tuple(float(a) for a in _OpacusRDP.DEFAULT_ALPHAS)
"""RDP orders searched for the best conversion (Opacus' defaults: 1.1..10.9, 12..63)."""


class RDPAccountant(Accountant):
    """Rényi-DP accountant (a valid but loose upper bound; fast)."""

    name: ClassVar[str] = "rdp"

    def __init__(self, orders: tuple[float, ...] = DEFAULT_ORDERS) -> None:
        super().__init__()
        self.orders = orders

    def _epsilon(self, delta: float) -> float:
        rdp = sum(
            _rdp_analysis.compute_rdp(
                q=e.sample_rate,
                noise_multiplier=e.noise_multiplier,
                steps=e.num_steps,
                orders=list(self.orders),
            )
            for e in self.history
        )
        eps, _ = _rdp_analysis.get_privacy_spent(orders=list(self.orders), rdp=rdp, delta=delta)
        return float(eps)
