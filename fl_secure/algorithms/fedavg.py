"""FedAvg with a global classification head.

McMahan et al., AISTATS 2017, applied to face recognition as the baseline of the HF-MAML
paper (section III-A): every client trains the whole model, the head's rows are the class
embeddings of *all* identities of the federation, and a client sets the logits of the classes
it does not hold to -inf so that their rows receive exactly zero gradient. The head is shared,
so every party sees every identity template: the design the audits attack.
"""

from __future__ import annotations

from typing import ClassVar

from fl_secure.algorithms.base import Exposure, Strategy


class FedAvg(Strategy):
    """Average backbone and global head, weighted by sample count."""

    name: ClassVar[str] = "fedavg"
    exposure: ClassVar[Exposure] = "global-head"
    shares_head: ClassVar[bool] = True
    local_softmax_only: ClassVar[bool] = True  # absent classes masked (HF-MAML III-A)

    def describe(self) -> str:
        """One line for logs and reports."""
        return "FedAvg, global head with absent-class masking (HF-MAML paper III-A)"
