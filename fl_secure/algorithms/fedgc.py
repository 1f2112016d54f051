"""FedGC: federated face recognition with gradient correction, and its cosine variant FedCos.

Niu & Deng, "Federated Learning for Face Recognition with Gradient Correction" (AAAI 2022),
Algorithm 1. Clients train like FedPE (section 3): the backbone ``theta`` is shared, each
client ``k`` keeps the class embeddings ``W_k`` of its own identities, but it *uploads*
``W_k`` with its backbone update (Algorithm 1, line 6). The server averages the backbone
(line 9), concatenates the cohort's class embeddings ``W~ = [W_1; ...; W_K]`` (line 10) and
takes one gradient step on the softmax regularizer (line 13)::

    W <- W~ - lambda * eta * grad_W~ Reg(W~)

    Reg(W) = sum_k sum_i -log( e^{W'_ki^T W'_ki}
                 / (e^{W'_ki^T W'_ki} + sum_{z != k} sum_j e^{W_zj^T W'_ki}) )          (Eq. 5)

``(.)'`` is a constant (no gradient): an anchor ``W_ki`` only pushes the *other clients'*
embeddings ``W_zj`` away, so the gradient has no within-client term. For one row it is
(Eq. 11, summed over anchors)::

    dReg / dW_zj = sum_{k != z} sum_i p(zj | ki) W'_ki,
    p(zj | ki) = e^{W_zj^T W'_ki} / (e^{W'_ki^T W'_ki} + sum_{z' != k} sum_j' e^{W_z'j'^T W'_ki})

FedCos (the paper's Remark and Table 4) replaces Reg by the cosine regularizer
``sum_k sum_i sum_{z != k} sum_j W_zj^T W'_ki``, whose gradient ``sum_{k != z} sum_i W'_ki``
weights every cross-client pair by 1 instead of ``p <= 1``: with the same lambda its step is
about (number of other clients' classes) times larger.

Choices made here, where the paper is silent:

- With a margin head (CosFace, ArcFace) rows are L2-normalised inside Reg
  (``W -> W / ||W||``, gradient through the normalisation, so the step turns rows and does
  not rescale them): those heads only ever use the direction of a class embedding
  (``CosineClassifier``), and the paper's Remark says margin variants follow "with minor
  modification". The logits of those heads are ``s cos``, so Reg takes the same logit scale
  ``s`` on the unit rows: ``e^{s W'^T W'} = e^s`` over ``e^s + sum e^{s W_zj^T W'_ki}``
  (``algorithm.reg_scale``; 0, the default, is the head's own ``model.scale``, since the
  paper states no scale for Reg). Without ``s`` the logits lie in [-1, 1] and ``p(zj | ki)``
  is almost uniform, which turns Eq. 5 into FedCos's equal weighting; with it the step
  pushes hard negatives (cross-client rows close to an anchor) and leaves near-orthogonal
  ones alone. With a softmax head (``model.head = "softmax"``, the paper's Softmax-FedGC,
  whose logits depend on the row norms) Reg is Eq. 5 verbatim on the raw rows
  (``normalize=False``, no scale; the tests check both against the equation). FedCos's
  cosine regularizer takes no scale (the Remark's ``W^T W``).
- ``eta`` is the server's own step, ``algorithm.reg_eta`` (default 0.1, the paper's
  constant learning rate, Table 5), not the clients' round learning rate: the clients may
  train with Adam at 1e-3 decayed over the rounds, which made ``lambda * eta`` 0.02 to 5e-4
  and turned the class rows by 0.03 degrees in a round. ``lambda`` defaults to 20, the best
  of the paper's Table 2, so ``lambda * eta = 2``.
- Only the cohort's embeddings are concatenated (every client in full participation, as in
  Algorithm 1); a softmax head's bias rows travel with ``W_k`` but are not regularized.
- Exposure ``server-sees-heads``: the server sees every cohort client's identity templates
  (never another client). So FedGC is refused with secure aggregation (the server must see
  individual heads, which SecAgg exists to hide) and with client-level DP (the heads would be
  an unclipped, un-noised per-client release outside the DP-FedAvg guarantee). Example-level
  DP composes: ``W_k`` is trained by DP-SGD with the rest of the model, and uploading it is
  post-processing of that DP-SGD output, covered by the client's own accountant.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import ClassVar, Literal, Self

import numpy as np
import torch
from torch.nn import functional as F  # noqa: N812

from fl_secure.algorithms.base import Exposure, Strategy
from fl_secure.config import AlgorithmConfig, PrivacyUnit
from fl_secure.messages import Tensors
from fl_secure.models.heads import DEFAULT_SCALE_MARGIN

Regularizer = Literal["softmax", "cosine"]
#: The head tensor holding the class embeddings W_k (rows = classes).
WEIGHT = "head.classifier.weight"


def _cross_client_logits(
    w: torch.Tensor, owners: torch.Tensor, normalize: bool, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits[a, b] = s W_b^T W'_a, self-logit s W'_a^T W'_a, cross-client mask [a, b])``."""
    v = F.normalize(w, dim=1) if normalize else w
    anchor = v.detach()  # (.)' of Eq. 5: anchors get no gradient
    logits = scale * (anchor @ v.T)
    self_logit = scale * (anchor * anchor).sum(dim=1)
    cross = owners.unsqueeze(1) != owners.unsqueeze(0)
    return logits, self_logit, cross


def softmax_regularizer(
    w: torch.Tensor, owners: torch.Tensor, *, normalize: bool = True, scale: float = 1.0
) -> torch.Tensor:
    """Eq. 5 on the concatenated class embeddings ``w`` [C, d]; ``owners`` [C] = client index.

    Returns the sum over anchors of ``-log(e^{s_aa} / (e^{s_aa} + sum_{b cross} e^{s_ab}))``
    with ``s_ab = scale * W_b^T W'_a``; 0 (and zero gradient) when every row belongs to one
    client.
    """
    logits, self_logit, cross = _cross_client_logits(w, owners, normalize, scale)
    others = logits.masked_fill(~cross, float("-inf"))
    denominator = torch.logsumexp(torch.cat([self_logit.unsqueeze(1), others], dim=1), dim=1)
    return (denominator - self_logit).sum()


def cosine_regularizer(
    w: torch.Tensor, owners: torch.Tensor, *, normalize: bool = True, scale: float = 1.0
) -> torch.Tensor:
    """FedCos (Remark, Table 4): ``sum_a sum_{b cross-client} scale * W_b^T W'_a``."""
    logits, _, cross = _cross_client_logits(w, owners, normalize, scale)
    return (logits * cross).sum()


REGULARIZERS = {"softmax": softmax_regularizer, "cosine": cosine_regularizer}


def correct_embeddings(
    weights: list[np.ndarray],
    *,
    step: float,
    regularizer: Regularizer = "softmax",
    normalize: bool = True,
    scale: float = 1.0,
) -> list[np.ndarray]:
    """Algorithm 1 line 13 on the clients' ``W_k`` (in order): ``W - step * grad Reg(W)``.

    Args:
        weights: one ``[C_k, d]`` array per client.
        step: ``lambda * eta``.
        regularizer: ``"softmax"`` (Eq. 5, FedGC) or ``"cosine"`` (FedCos).
        normalize: regularize the rows' directions (see the module docstring).
        scale: the logit scale ``s`` of Reg (1: none).
    """
    if not weights:
        return []
    owners = torch.cat(
        [torch.full((len(wk),), k, dtype=torch.int64) for k, wk in enumerate(weights)]
    )
    w = torch.from_numpy(np.concatenate(weights).astype(np.float64)).requires_grad_(True)
    reg = REGULARIZERS[regularizer](w, owners, normalize=normalize, scale=scale)
    (grad,) = torch.autograd.grad(reg, [w])
    corrected = (w.detach() - step * grad).numpy()
    bounds = np.cumsum([0] + [len(wk) for wk in weights])
    return [
        corrected[a:b].astype(wk.dtype)
        for a, b, wk in zip(bounds[:-1], bounds[1:], weights, strict=True)
    ]


class FedGC(Strategy):
    """FedPE clients that upload their class embeddings; the server applies Eq. 5's step."""

    name: ClassVar[str] = "fedgc"
    exposure: ClassVar[Exposure] = "server-sees-heads"
    shares_head: ClassVar[bool] = False
    uploads_head: ClassVar[bool] = True
    local_softmax_only: ClassVar[bool] = True
    regularizer: ClassVar[Regularizer] = "softmax"
    # each client's class embeddings are uploaded in the clear, by design
    refuses_secure_aggregation: ClassVar[str] = (
        "the server must see each client's class embeddings to apply the FedGC correction, "
        "which secure aggregation exists to hide; set secure_aggregation.scheme = 'none' or "
        "use fedpe"
    )
    refused_privacy_units: ClassVar[Mapping[PrivacyUnit, str]] = {
        "client": "the uploaded class embeddings would be an unclipped, un-noised per-client "
        "release outside the client-level guarantee; use privacy.unit = 'example' (DP-SGD "
        "covers the embeddings) or 'none', or fedpe"
    }

    def __init__(
        self,
        reg_lambda: float = 20.0,
        reg_eta: float = 0.1,
        *,
        normalize: bool = True,
        scale: float = DEFAULT_SCALE_MARGIN["cosface"][0],
    ) -> None:
        self.reg_lambda, self.reg_eta = reg_lambda, reg_eta
        self.normalize = normalize  # False for a softmax head: Eq. 5 on the raw rows
        # the softmax regularizer's logit scale on unit rows; FedCos and raw rows take none
        self.scale = scale if normalize and self.regularizer == "softmax" else 1.0

    @classmethod
    def from_config(
        cls,
        params: AlgorithmConfig | None = None,
        *,
        head: str | None = None,
        scale: float | None = None,
    ) -> Self:
        """The run's lambda, eta and logit scale; a softmax ``head``'s rows stay raw.

        A margin head's rows are normalised, at logit scale ``algorithm.reg_scale`` (0:
        ``scale``, the run's ``model.scale``, or else the head's default).
        """
        if params is None:
            return cls()
        defaults = {str(k): v[0] for k, v in DEFAULT_SCALE_MARGIN.items()}
        s = params.reg_scale or scale or defaults.get(head or "cosface", defaults["cosface"])
        return cls(params.reg_lambda, params.reg_eta, normalize=head != "softmax", scale=s)

    @classmethod
    def uses_reg_scale(cls, head: str) -> bool:
        """The softmax regularizer on a margin head's unit rows takes a logit scale."""
        return cls.regularizer == "softmax" and head != "softmax"

    def describe(self) -> str:
        """One line for logs and reports."""
        return (
            f"FedGC ({self.regularizer} regularizer, lambda {self.reg_lambda:g}, eta "
            f"{self.reg_eta:g}, logit scale {self.scale:g}): private "
            "class embeddings uploaded to the server for gradient correction (FedGC paper, "
            "Algorithm 1, Eq. 5)"
        )

    def server_heads(
        self, heads: Mapping[str, Tensors], *, learning_rate: float, round_: int
    ) -> dict[str, Tensors]:
        """Correct the cohort's ``W_k`` jointly (clients in sorted id order); bias untouched.

        The step is ``lambda * eta`` (Algorithm 1 line 13) with the server's own ``eta``:
        the clients' ``learning_rate`` of the round does not enter.
        """
        del round_, learning_rate
        order = sorted(heads)
        corrected = correct_embeddings(
            [np.asarray(heads[c][WEIGHT]) for c in order],
            step=self.reg_lambda * self.reg_eta,
            regularizer=self.regularizer,
            normalize=self.normalize,
            scale=self.scale,
        )
        out: dict[str, Tensors] = {}
        for client, weight in zip(order, corrected, strict=True):
            tensors = OrderedDict(heads[client])
            tensors[WEIGHT] = weight
            out[client] = tensors
        return out


class FedCos(FedGC):
    """FedGC with the cosine regularizer (FedGC paper, Remark and Table 4)."""

    name: ClassVar[str] = "fedcos"
    regularizer: ClassVar[Regularizer] = "cosine"
