"""AdaFedFR: federated face recognition with adaptive inter-class representation learning.

AdaFedFR paper (section 3.4-3.6, Eq. 4-8, supplementary Algorithm 1). Each round the server
extracts, with the global model ``w^t``, one representation per *public* identity (Eq. 4)::

    r_i = normalize( 1/|D_S,i| * sum_{x in D_S,i} normalize(F(x)) ),   R = [r_1; ...; r_G]

and sends ``R`` (``G x d`` floats) with ``w^t`` instead of any public image (Algorithm 1
lines 6-8). Section 3.4 calls ``R`` "normalized mean feature embeddings": the features are
L2-normalised before averaging (the embeddings every loss here compares) and the mean is
normalised again (Eq. 4 as printed shows the plain mean; only its direction is ever used).

The client minimises Eq. 8, ``L_overall = 1 * L_lmc + 5 * L_kcl + 10 * L_bce``, with the
k-negative contrastive loss (Eq. 6) against ``R`` and a private local adapter (Eq. 7); the
losses and their parameters are in :mod:`fl_secure.algorithms.adafedfr_losses`.

Update order, Algorithm 1 lines 17-22: one total loss per batch (line 17), then each parameter
group moves along the gradient of the terms that depend on it (one backward of Eq. 8)::

    z   <- z   - eta grad_z   L_lmc                  (line 19: the private head)
    theta <- theta - eta grad_theta L_bce            (line 20: the adapter; its input feature
                                                      is detached, so ...)
    w   <- w   - eta grad_w (L_lmc + L_kcl)          (line 21: ... the backbone gets no BCE
                                                      gradient)
    phi <- phi - eta grad_phi L_overall              (line 22: plain gradient descent)

The terms keep their Eq. 8 weights (the algorithm box prints them unweighted). ``w`` and ``z``
use the run's optimiser (SGD with momentum and weight decay, or Adam); ``theta`` and ``phi``
take gradient steps (lines 20 and 22) with their own SGD: ``algorithm.adapter_lr`` (default
0.01, constant over the rounds) and ``algorithm.adapter_momentum`` (default 0.9, the paper's
momentum for local training), no weight decay (``A`` starts at ``I``). The paper gives no
learning rate. With the run's ``eta`` (the quickstart's Adam rate 1e-3) plain SGD left them
where they started (``|A - I| / |I| = 1e-3`` and ``phi`` at 0.5 after a run; 1.5e-3 and
``|phi - 1/2|`` 2e-4 after five steps on synthetic faces, against 0.092 and 0.006 with the
defaults: tests/fl_secure/algorithms/test_adafedfr_adapter_step.py), and the run's Adam on
``theta``, which moves every entry of the ``d x d`` map by about ``eta`` per step whatever its
gradient, brought the personalised TAR@FAR=1e-2 on the quickstart data below the backbone's
own (0.79 vs 0.84 over 4 clients).

Exposure ``private-embedding``: only the backbone is aggregated; the head, the adapter and
``phi`` stay on the client. ``R`` comes from public identities only. Algorithm 1 lines 23-26
(clip the local parameters, add Gaussian noise to the upload) are the client-level DP of
:mod:`privacy.dp.client_level`, applied to this strategy's shared update when
``[privacy] unit = "client"`` (:class:`privacy.client_round.ClientPrivacy.release`); this
module adds no noise of its own. With ``unit = "example"`` DP-SGD replaces the local
objective (plain margin-head training), so AdaFedFR's losses are not used there.

Transport of ``R`` (Algorithm 1 lines 6-8): :meth:`AdaFedFR.broadcaster` gives the server a
callable that, before every round, extracts ``R`` with the round's global backbone from
:func:`public_dataset` (synthetic identities disjoint from the run's); ``R`` travels as the
tensor ``broadcast.public_representations`` with the parameters the client downloads (gRPC
``GetParameters``, or the simulation's hand-over: one code path) and
:meth:`AdaFedFR.take_broadcast` checks it (shape ``[G, d]``, finite, unit rows) before the
client trains. The adapter and ``phi`` live beside the model (per model object); a client
with a ``state_dir`` saves them with its private head (:meth:`AdaFedFR.private_state`) and a
restarted client continues with them.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Self

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fl_secure.algorithms.adafedfr_losses import TAU, ClientState, adafedfr_losses
from fl_secure.algorithms.base import BROADCAST_PREFIX, Broadcaster, Exposure, Strategy
from fl_secure.config import AlgorithmConfig, Config
from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces
from fl_secure.training import (
    FaceModel,
    LocalData,
    build_run_model,
    make_optimizer,
    round_start_copy,
    set_tensors,
)

if TYPE_CHECKING:
    from fl_secure.config import Config
    from fl_secure.data.types import FaceDataset
    from fl_secure.messages import LocalTraining, Tensors

#: The broadcast tensor carrying ``R`` (Eq. 4), ``[G, d]`` float32.
REPRESENTATIONS = f"{BROADCAST_PREFIX}public_representations"


@torch.no_grad()
def public_identity_features(
    backbone: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 256
) -> torch.Tensor:
    """Eq. 4 / Algorithm 1 line 6: ``R``, one normalised mean feature per public identity.

    Features are extracted in evaluation mode and L2-normalised, averaged per identity and
    the mean normalised again. Rows follow the sorted unique ``labels``.

    Returns:
        float32 ``[G, d]`` with unit rows.
    """
    was_training = backbone.training
    backbone.eval()
    feats = torch.cat(
        [backbone(images[i : i + batch_size]) for i in range(0, len(images), batch_size)]
    )
    backbone.train(was_training)
    feats = F.normalize(feats.float(), dim=1)
    identities, index = torch.unique(labels, sorted=True, return_inverse=True)
    sums = torch.zeros(len(identities), feats.shape[1]).index_add_(0, index, feats)
    counts = torch.bincount(index, minlength=len(identities)).unsqueeze(1).float()
    return F.normalize(sums / counts, dim=1)


def public_dataset(config: Config) -> FaceDataset:
    """The server's public identities ``D_S``: synthetic faces no client holds.

    ``algorithm.public_identities x algorithm.public_images_per_identity`` images of the
    synthetic generator's identities ``data.num_identities, data.num_identities + 1, ...``
    under the data seed (``partition.seed``, else ``run.seed``): disjoint from the run's own
    (synthetic) identities, including the held-out ones the server evaluates on, so ``R``
    never describes an evaluation identity; an experiment grid's shared pretraining
    (:mod:`fl_secure.app.pretrain`) trains on these same identities, as the paper's backbone
    is pretrained on its public set.
    """
    a = config.algorithm
    return generate_synthetic_faces(
        SyntheticFaceConfig(
            num_identities=a.public_identities,
            images_per_identity=a.public_images_per_identity,
            image_size=config.data.image_size,
            seed=config.data_seed,
            first_identity=config.data.num_identities,
        )
    )


def bytes_per_round(
    shared: Mapping[str, np.ndarray], num_public: int, embedding_size: int, itemsize: int = 4
) -> dict[str, int]:
    """Bytes one client exchanges per round (the paper's communication comparison with FedFR).

    Down: ``R`` (``G x d`` floats of ``itemsize`` bytes) and the shared parameters ``w^t``;
    up: the shared parameters' update (same size). Payload only (no framing, no TLS).
    """
    params = int(sum(np.asarray(v).nbytes for v in shared.values()))
    representations = num_public * embedding_size * itemsize
    return {
        "representations": representations,
        "parameters_down": params,
        "parameters_up": params,
        "total": representations + 2 * params,
    }


class AdaFedFR(Strategy):
    """Backbone averaging; local objective Eq. 8 with the server's public representations."""

    name: ClassVar[str] = "adafedfr"
    exposure: ClassVar[Exposure] = "private-embedding"
    shares_head: ClassVar[bool] = False

    def __init__(
        self,
        num_negatives: int = 10,
        tau: float = TAU,
        *,
        adapter_lr: float = 0.01,
        adapter_momentum: float = 0.9,
    ) -> None:
        self.num_negatives, self.tau = num_negatives, tau
        #: SGD of the adapter ``theta`` and ``phi`` (Algorithm 1 lines 20 and 22)
        self.adapter_lr, self.adapter_momentum = adapter_lr, adapter_momentum
        #: ``R`` of the current round (``[G, d]``, float32); set before each client round.
        self.public_representations: torch.Tensor | None = None
        self._states: weakref.WeakKeyDictionary[FaceModel, ClientState] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def from_config(
        cls,
        params: AlgorithmConfig | None = None,
        *,
        head: str | None = None,
        scale: float | None = None,
    ) -> Self:
        """The run's k of the top-k negatives (Eq. 6) and the adapter's and phi's SGD."""
        del head, scale
        if params is None:
            return cls()
        return cls(
            params.num_negatives,
            adapter_lr=params.adapter_lr,
            adapter_momentum=params.adapter_momentum,
        )

    def describe(self) -> str:
        """One line for logs and reports."""
        return (
            f"AdaFedFR (top-{self.num_negatives} negatives, tau {self.tau:g}, weights 1/5/10, "
            f"adapter and phi SGD lr {self.adapter_lr:g} momentum {self.adapter_momentum:g}): "
            "backbone averaged, public-identity representations R sent to clients, private "
            "head and local adapter (AdaFedFR paper, Eq. 4-8, Algorithm 1)"
        )

    def client_state(self, model: FaceModel, num_public: int | None = None) -> ClientState:
        """The adapter and ``phi`` of ``model``'s client (created on first use)."""
        state = self._states.get(model)
        if state is None or (
            num_public is not None and state.selection.logits.numel() != num_public
        ):
            if num_public is None:
                raise ValueError("this model has no AdaFedFR state yet")
            state = ClientState.for_model(model, num_public)
            self._states[model] = state
        return state

    def private_state(self, model: FaceModel) -> dict[str, torch.Tensor]:
        """The adapter ``theta`` and ``phi`` of ``model``'s client, once they exist.

        The live (detached) tensors: the trainer copies them when it saves them.
        """
        state = self._states.get(model)
        if state is None:
            return {}
        return {k: v.detach() for k, v in state.state_dict().items()}

    def restore_private_state(self, model: FaceModel, tensors: Mapping[str, torch.Tensor]) -> None:
        """A restarted client's saved adapter and ``phi`` (checked against ``model``'s head).

        Raises:
            ValueError: if the tensors are not a :class:`ClientState` for this model.
        """
        if not tensors:
            return
        classes, logits = tensors.get("adapter.classes"), tensors.get("selection.logits")
        weight = model.head.weight
        if classes is None or logits is None or classes.shape != weight.shape:
            raise ValueError(
                "the saved AdaFedFR state does not fit this model: expected adapter.classes "
                f"of shape {tuple(weight.shape)} and selection.logits"
            )
        state = ClientState(int(weight.shape[1]), int(weight.shape[0]), int(logits.numel()))
        try:
            state.load_state_dict(dict(tensors))
        except RuntimeError as exc:
            raise ValueError(f"the saved AdaFedFR state does not fit this model: {exc}") from exc
        if not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
            raise ValueError("the saved AdaFedFR state contains NaN or infinity")
        self._states[model] = state

    def broadcaster(self, config: Config) -> Broadcaster:
        """Algorithm 1 lines 6-8 on the server: ``R`` under each round's global backbone."""
        public = public_dataset(config)
        model = build_run_model(config, 1)
        prefix = "backbone."

        def broadcast(params: Tensors, round_: int) -> Tensors:
            del round_
            backbone = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
            set_tensors(model.backbone, OrderedDict(backbone))
            r = public_identity_features(model.backbone, public.images, public.labels)
            return OrderedDict([(REPRESENTATIONS, r.numpy())])

        return broadcast

    def take_broadcast(self, model: FaceModel, tensors: Tensors) -> None:
        """Check the server's ``R`` (names, shape ``[G, d]``, finite, unit rows) and keep it."""
        if list(tensors) != [REPRESENTATIONS]:
            raise ValueError(
                f"AdaFedFR expects the broadcast {REPRESENTATIONS!r} alone, got {sorted(tensors)}"
            )
        r = np.asarray(tensors[REPRESENTATIONS])
        width = _embedding_size(model)
        if r.ndim != 2 or r.shape[0] < 1 or r.shape[1] != width:
            raise ValueError(
                f"the server's public representations R have shape {r.shape}, expected "
                f"[G >= 1, {width}] (one row per public identity, the embedding size)"
            )
        if not np.all(np.isfinite(r)):
            raise ValueError("the server's public representations R contain NaN or infinity")
        norms = np.linalg.norm(r.astype(np.float64), axis=1)
        if np.any(np.abs(norms - 1.0) > 1e-3):
            raise ValueError(
                "the server's public representations R are not unit rows (Eq. 4 normalises "
                f"each mean feature): norms range {norms.min():.4g}..{norms.max():.4g}"
            )
        self.public_representations = torch.from_numpy(r.astype(np.float32, copy=True))

    def personalized_backbone(self, model: FaceModel) -> nn.Module:
        """The personalised model: backbone followed by the client's adapter map ``A``."""
        return nn.Sequential(model.backbone, self.client_state(model).adapter.transform)

    def personalized(self, model: FaceModel) -> nn.Module:
        """Client-side evaluation uses the personalised model once the adapter exists."""
        if model not in self._states:  # before the first round: the backbone alone
            return model.backbone
        return self.personalized_backbone(model)

    def local_train(
        self,
        model: FaceModel,
        data: LocalData,
        training: LocalTraining,
        *,
        generator: torch.Generator,
    ) -> dict[str, float]:
        """Algorithm 1 lines 15-22 for ``local_epochs`` epochs (or ``local_steps`` batches)."""
        r = self.public_representations
        if r is None:
            raise ValueError(
                "AdaFedFR needs the round's public representations R, which the server sends "
                f"with the parameters as {REPRESENTATIONS!r}; none arrived"
            )
        state = self.client_state(model, num_public=int(r.shape[0]))
        reference = round_start_copy(model.backbone)  # w^t, for f_g
        model.train()
        opt = make_optimizer(list(model.parameters()), training)  # w, z
        plain_opt = torch.optim.SGD(  # lines 20 and 22: gradient steps on theta and phi
            [*state.adapter.parameters(), *state.selection.parameters()],
            lr=self.adapter_lr,
            momentum=self.adapter_momentum,
        )
        n = len(data.train)
        batch = min(training.batch_size, n)
        total_steps = training.local_steps or training.local_epochs * max(1, n // batch)
        order, cursor = torch.randperm(n, generator=generator), 0
        sums = dict.fromkeys(("train_loss", "lmc", "kcl", "bce"), 0.0)
        for _ in range(total_steps):
            if cursor + batch > n:
                order, cursor = torch.randperm(n, generator=generator), 0
            idx = order[cursor : cursor + batch]
            cursor += batch
            losses = adafedfr_losses(
                model,
                state,
                reference,
                data.train.images[idx],
                data.train_targets[idx],
                r,
                k=self.num_negatives,
                tau=self.tau,
                class_mask=data.class_mask,
            )
            opt.zero_grad(set_to_none=True)
            plain_opt.zero_grad(set_to_none=True)
            torch.autograd.backward(losses.total)  # line 17; lines 19-22 below
            opt.step()
            plain_opt.step()
            state.selection.project_()
            for key, value in zip(
                sums, (losses.total, losses.lmc, losses.kcl, losses.bce), strict=True
            ):
                sums[key] += float(value.detach())
        metrics = {k: v / max(total_steps, 1) for k, v in sums.items()}
        metrics["local_steps"] = float(total_steps)
        metrics["phi_mean"] = float(state.selection().mean().detach())
        return metrics


def _embedding_size(model: FaceModel) -> int:
    """Width of the embeddings (the rows of R): the head's class-embedding width."""
    return int(model.head.weight.shape[1])
