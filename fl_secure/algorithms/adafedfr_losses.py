"""AdaFedFR's local objective: the k-negative contrastive loss, the local adapter, Eq. 8.

AdaFedFR paper (section 3.5-3.6, Eq. 6-8). The client minimises (Eq. 8, weights of the
Implementation Details)::

    L_overall = 1 * L_lmc + 5 * L_kcl + 10 * L_bce

* ``L_lmc`` (Eq. 1-2): CosFace, ``s = 30``, ``m = 0.4``, on the client's private head ``z``
  (its own identities' class embeddings; the run's ``[model]`` head, CosFace by default).
* ``L_kcl`` (Eq. 6), the adaptive k-negative contrastive loss, ``tau = 0.5``::

      L_kcl = -log( e^{sim(f, f_g)/tau}
                    / (e^{sim(f, f_g)/tau} + sum_{i in top-k} phi_i e^{sim(f, r_i)/tau}) )

  ``f`` is the local model's feature of a training image, ``f_g`` the feature of the same
  image under the round's global model (a frozen copy of ``w^t``: the positive pair, as in
  MOON), ``r_i`` the public representations (negatives). ``phi in (0,1)^G`` is learnable
  (``sigmoid`` of a parameter); "after the selection, we obtain the top k similarities":
  per sample only the ``k`` negatives with the largest weighted terms
  ``phi_i e^{sim(f, r_i)/tau}`` enter the sum (section 6.2: the hardest negatives).
* ``L_bce`` (Eq. 7), the local adapter, written after SphereFace2 (the paper's [36], whose
  notation Eq. 7 says it follows; ``lambda = 0.7``, ``s' = 40``, ``m' = 0.4``, ``t = 3``,
  learned bias ``b``)::

      L_bce = lambda/s' log(1 + e^{-(s' g(cos xi_i) - m') - b})
            + (1 - lambda)/s' sum_j log(1 + e^{s' g(cos xi_j) + m' + b}),
      g(c) = 2 ((c + 1) / 2)^t - 1

  ``xi_i`` is the adapter output on the local feature, ``xi_j`` on the public
  representations ``r_j`` ("the negatives received directly from public identities"); the
  cosines are taken against the adapter's private vector of the sample's identity. The
  adapter is a ``d x d`` linear map (identity at start) plus one vector per local identity
  and ``b``; it never leaves the client and the personalised model is
  ``normalize(A F(x))`` (:meth:`fl_secure.algorithms.adafedfr.AdaFedFR.personalized_backbone`).

The public representations ``R`` (Eq. 4) and the update order of Algorithm 1 lines 17-22 are
:mod:`fl_secure.algorithms.adafedfr`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

if TYPE_CHECKING:
    from fl_secure.training import FaceModel

#: Eq. 8 weights (alpha_1, alpha_2, alpha_3) of L_lmc, L_kcl, L_bce (Implementation Details).
LOSS_WEIGHTS = (1.0, 5.0, 10.0)
#: Eq. 6 temperature (Implementation Details).
TAU = 0.5
#: phi is squashed into [PHI_EPS, 1 - PHI_EPS] so float32 rounding never yields 0 or 1.
PHI_EPS = 1e-6
#: The selection logits are kept in [-LOGIT_BOUND, LOGIT_BOUND] after each step, where the
#: sigmoid still has a gradient (phi can come back from either end).
LOGIT_BOUND = 12.0


class SelectionVector(nn.Module):
    """Eq. 6's learnable ``phi in (0,1)^G``: ``sigmoid`` of a parameter, bounded away from 0/1."""

    def __init__(self, num_public: int) -> None:
        super().__init__()
        # logit 0 -> phi = 1/2: every public identity starts half-selected
        self.logits = nn.Parameter(torch.zeros(num_public))

    def forward(self) -> torch.Tensor:
        """``phi``, every element in ``[PHI_EPS, 1 - PHI_EPS]``."""
        return PHI_EPS + (1.0 - 2.0 * PHI_EPS) * torch.sigmoid(self.logits)

    @torch.no_grad()
    def project_(self) -> None:
        """Clamp the logits (and clear NaN) after an optimiser step."""
        self.logits.nan_to_num_(0.0).clamp_(-LOGIT_BOUND, LOGIT_BOUND)


def select_negatives(
    similarity: torch.Tensor, phi: torch.Tensor, k: int, tau: float = TAU
) -> torch.Tensor:
    """Indices ``[B, k]`` of the top-k terms ``phi_i e^{sim_i / tau}`` of each row (Eq. 6).

    Ranked by ``log phi_i + sim_i / tau`` (the same order, without overflow).
    """
    k = min(k, similarity.shape[1])
    scores = torch.log(phi).unsqueeze(0) + similarity / tau
    return scores.topk(k, dim=1).indices


def k_negative_contrastive_loss(
    features: torch.Tensor,
    global_features: torch.Tensor,
    representations: torch.Tensor,
    phi: torch.Tensor,
    k: int,
    tau: float = TAU,
) -> torch.Tensor:
    """Eq. 6, mean over the batch.

    Args:
        features: ``[B, d]`` local features ``f`` (need not be normalised).
        global_features: ``[B, d]`` features ``f_g`` of the same images under ``w^t``.
        representations: ``[G, d]`` public representations ``R`` (negatives).
        phi: ``[G]`` selection vector in ``(0,1)``.
        k: number of negatives kept per sample (all ``G`` if ``k >= G``).
        tau: temperature.
    """
    f = F.normalize(features, dim=1)
    positive = (f * F.normalize(global_features, dim=1)).sum(dim=1) / tau  # sim(f, f_g)/tau
    similarity = f @ F.normalize(representations, dim=1).T  # sim(f, r_i), [B, G]
    chosen = select_negatives(similarity.detach(), phi.detach(), k, tau)
    negatives = torch.log(phi)[chosen] + similarity.gather(1, chosen) / tau
    denominator = torch.logsumexp(torch.cat([positive.unsqueeze(1), negatives], dim=1), dim=1)
    return (denominator - positive).mean()


class LocalAdapter(nn.Module):
    """Eq. 7's private adapter: ``xi = A x``, one vector per local identity, a bias ``b``."""

    def __init__(
        self,
        embedding_size: int,
        num_classes: int,
        *,
        lam: float = 0.7,
        scale: float = 40.0,
        margin: float = 0.4,
        t: float = 3.0,
    ) -> None:
        super().__init__()
        self.transform = nn.Linear(embedding_size, embedding_size, bias=False)
        with torch.no_grad():  # identity: the personalised model starts as the generic one
            self.transform.weight.copy_(torch.eye(embedding_size))
        self.classes = nn.Parameter(torch.empty(num_classes, embedding_size))
        nn.init.normal_(self.classes, std=0.01)  # ClientState starts them at the head's rows
        self.bias = nn.Parameter(torch.zeros(1))
        self.lam, self.scale, self.margin, self.t = lam, scale, margin, t

    def g(self, cosine: torch.Tensor) -> torch.Tensor:
        """SphereFace2's similarity adjustment ``g(c) = 2 ((c + 1)/2)^t - 1``."""
        return 2.0 * ((cosine + 1.0) / 2.0) ** self.t - 1.0

    def bce_loss(
        self, features: torch.Tensor, targets: torch.Tensor, representations: torch.Tensor
    ) -> torch.Tensor:
        """Eq. 7, mean over the batch; positives = local features, negatives = ``R``.

        ``features`` are used as given: the caller detaches them (Algorithm 1 line 20-21).
        """
        w = F.normalize(self.classes, dim=1)[targets]  # [B, d], the sample's identity
        pos = (F.normalize(self.transform(features), dim=1) * w).sum(dim=1)  # cos(xi_i)
        neg = w @ F.normalize(self.transform(representations), dim=1).T  # cos(xi_j), [B, G]
        s, m, b = self.scale, self.margin, self.bias
        pos_term = F.softplus(-(s * self.g(pos) - m) - b)
        neg_term = F.softplus(s * self.g(neg) + m + b).sum(dim=1)
        return (self.lam / s * pos_term + (1.0 - self.lam) / s * neg_term).mean()


class ClientState(nn.Module):
    """What AdaFedFR keeps on a client besides the model: the adapter and ``phi``."""

    def __init__(self, embedding_size: int, num_classes: int, num_public: int) -> None:
        super().__init__()
        self.adapter = LocalAdapter(embedding_size, num_classes)
        self.selection = SelectionVector(num_public)

    @classmethod
    def for_model(cls, model: FaceModel, num_public: int) -> ClientState:
        """A fresh state whose identity vectors start at the private head's rows ``z``.

        Deterministic given the model (no draw from the global RNG), and with ``A = I`` the
        adapter then starts from the head's own view of each local identity.
        """
        weight = model.head.weight.detach()
        state = cls(int(weight.shape[1]), int(weight.shape[0]), num_public)
        with torch.no_grad():
            state.adapter.classes.copy_(weight)
        return state


@dataclass(frozen=True)
class Losses:
    """The three terms of Eq. 8 and their weighted sum (tensors, with graphs)."""

    lmc: torch.Tensor
    kcl: torch.Tensor
    bce: torch.Tensor
    total: torch.Tensor


def adafedfr_losses(
    model: FaceModel,
    state: ClientState,
    reference: nn.Module,
    images: torch.Tensor,
    targets: torch.Tensor,
    representations: torch.Tensor,
    *,
    k: int,
    tau: float = TAU,
    class_mask: torch.Tensor | None = None,
    weights: tuple[float, float, float] = LOSS_WEIGHTS,
) -> Losses:
    """Eq. 8 on one batch: ``a1 L_lmc + a2 L_kcl + a3 L_bce``.

    Args:
        model: the local model (backbone ``w``, private head ``z``).
        state: the client's adapter ``theta`` and selection vector ``phi``.
        reference: the round's global backbone ``w^t`` (frozen; gives ``f_g``).
        images: the batch.
        targets: the batch's classes in the private head.
        representations: ``R`` from the server.
        k: negatives kept per sample (Eq. 6's top-k).
        tau: Eq. 6's temperature.
        class_mask: the head's class mask (``None`` for a private head).
        weights: ``(alpha_1, alpha_2, alpha_3)`` of Eq. 8.
    """
    emb = model.backbone(images)
    lmc = F.cross_entropy(model.head(emb, targets, class_mask), targets)
    with torch.no_grad():
        global_emb = reference(images)
    kcl = k_negative_contrastive_loss(emb, global_emb, representations, state.selection(), k, tau)
    bce = state.adapter.bce_loss(emb.detach(), targets, representations)
    a1, a2, a3 = weights
    return Losses(lmc=lmc, kcl=kcl, bce=bce, total=a1 * lmc + a2 * kcl + a3 * bce)
