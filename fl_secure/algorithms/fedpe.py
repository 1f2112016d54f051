"""FedPE: federated averaging with private class embeddings.

FedGC paper (Niu & Deng, "Federated Learning for Face Recognition with Gradient Correction"),
section 3, the FedPE baseline (also FedPav in FedFR): each client keeps the rows of its own
identities (its class embeddings W_k) private; only the backbone is averaged, weighted by the
clients' sample counts. No party other than the client ever sees its identity templates.
"""

from __future__ import annotations

from typing import ClassVar

from fl_secure.algorithms.base import Exposure, Strategy


class FedPE(Strategy):
    """Average the backbone only; heads stay on the clients."""

    name: ClassVar[str] = "fedpe"
    exposure: ClassVar[Exposure] = "private-embedding"
    shares_head: ClassVar[bool] = False
    local_softmax_only: ClassVar[bool] = True

    def describe(self) -> str:
        """One line for logs and reports."""
        return "FedPE, private class embeddings, backbone-only averaging (FedGC paper)"
