"""Model inversion of a face backbone towards a target direction (DeepInversion on a margin head).

Implements Yin et al., "Dreaming to Distill: Data-free Knowledge Transfer via DeepInversion",
CVPR 2020, adapted to face recognition's cosine heads. Images ``x`` are optimised from noise
to minimise (Eq. 1 with the regulariser of Eq. 5, ``R_DI = R_prior + alpha_f R_feature``)::

    L(x) = -s cos(f(x), w)                                    (margin head: target logit)
           + alpha_tv1 TV_l1(x) + alpha_tv2 TV_l2(x) + alpha_l2 ||x||^2      (R_prior, Eq. 2)
           + alpha_f sum_l c_l (||mu_l(x) - mu_l||_2 + ||var_l(x) - var_l||_2)   (Eq. 4)

with ``f`` the backbone, ``w`` the target class embedding (a head row, or a surrogate when the
attacker's view holds none), ``mu_l, var_l`` the running statistics of BatchNorm layer ``l``
(``c_1`` = ``first_bn_multiplier``, the other ``c_l = 1``, as in the authors' code). The
CosFace/ArcFace margin only shifts the target logit during training, so at attack time
maximising the target logit is maximising ``cos``. When every class embedding is known
(global head) the cross-entropy over ``s cos`` to all classes can replace the single cosine,
as DeepInversion's cross-entropy does. Optimisation follows the reference implementation:
random jitter (a cyclic shift) and horizontal flips each step, Adam with ``betas=(0.5, 0.9)``,
a linear warm-up then cosine learning-rate schedule, pixels clipped to the valid range, and the
lowest-loss image of each run kept; several restarts run in parallel and the best is kept.

A weak backbone inverted pixel by pixel yields adversarial noise, so a real attacker adds a
face prior learned from public faces (:func:`fit_face_prior`): either the image is
parametrised in a PCA face space (eigenfaces; Turk & Pentland, J. Cogn. Neurosci. 1991) with a
Gaussian penalty on the whitened coefficients (``prior="subspace"``), or pixels stay free with
a per-pixel Gaussian penalty towards the public mean face (``prior="penalty"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

PriorMode = Literal["none", "subspace", "penalty"]


@dataclass(frozen=True)
class InversionConfig:
    """Attack settings; weights are per-image means, so they do not depend on image size."""

    steps: int = 300  # Adam steps per run
    lr: float = 0.1  # peak learning rate
    warmup_fraction: float = 0.1  # linear warm-up, then cosine decay to 0
    restarts: int = 4  # independent runs per target (in one batch); best loss kept
    logit_scale: float = 1.0  # s: weight of the (cosine) target logit
    bn_weight: float = 0.01  # alpha_f, BatchNorm statistics matching (if the backbone has BN)
    first_bn_multiplier: float = 10.0  # weight of the first BatchNorm layer relative to others
    tv_l1: float = 0.0  # alpha_tv1, mean |neighbour difference|
    tv_l2: float = 0.05  # alpha_tv2, mean squared neighbour difference
    l2: float = 1e-3  # alpha_l2, mean squared pixel (images in [-1, 1])
    jitter: int = 2  # maximal cyclic shift in pixels per step
    flip: bool = True  # random horizontal flips
    init_std: float = 0.2  # std of the initial noise (pixels, or whitened coefficients)
    prior: PriorMode = "none"  # face prior: "subspace", "penalty" (need a FacePrior) or none
    prior_weight: float = 1e-3  # weight of the face-prior Gaussian penalty
    seed: int = 0  # attacker randomness (initial noise, jitter); not a secret

    def __post_init__(self) -> None:
        """Reject values that cannot run."""
        if self.steps < 1 or self.restarts < 1:
            raise ValueError("steps and restarts must be >= 1")
        if not self.lr > 0 or not 0 <= self.warmup_fraction < 1:
            raise ValueError("lr must be > 0 and warmup_fraction in [0, 1)")
        weights = (self.bn_weight, self.first_bn_multiplier, self.tv_l1, self.tv_l2, self.l2)
        if min(weights) < 0 or self.prior_weight < 0 or self.jitter < 0 or self.init_std < 0:
            raise ValueError("weights, jitter and init_std must be >= 0")
        if self.prior not in ("none", "subspace", "penalty"):
            raise ValueError(f"prior must be 'none', 'subspace' or 'penalty', got {self.prior!r}")


@dataclass(frozen=True)
class FacePrior:
    """Image statistics of public faces, in the repo's ``[-1, 1]`` normalisation.

    Attributes:
        mean: ``[3, H, W]`` mean face.
        std: ``[3, H, W]`` per-pixel standard deviation.
        basis: ``[K, 3*H*W]`` orthonormal principal directions (eigenfaces).
        scales: ``[K]`` standard deviation of the public faces along each direction.
    """

    mean: torch.Tensor
    std: torch.Tensor
    basis: torch.Tensor
    scales: torch.Tensor

    def images(self, coefficients: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` faces from ``[N, K]`` whitened coefficients."""
        flat = (coefficients * self.scales) @ self.basis
        return self.mean + flat.view(-1, *self.mean.shape)

    def coefficients(self, images: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` whitened coefficients of ``[N, 3, H, W]`` images (projection)."""
        centred = (images - self.mean).flatten(1)
        return (centred @ self.basis.T) / self.scales


def fit_face_prior(public_images: torch.Tensor, *, components: int = 64) -> FacePrior:
    """PCA of public faces (e.g. LFW): mean, per-pixel std, top principal directions.

    Args:
        public_images: ``[N, 3, H, W]`` faces the attacker may use, in ``[-1, 1]``.
        components: principal directions kept (at most ``N - 1``).

    Returns:
        The prior.
    """
    n = public_images.shape[0]
    if public_images.dim() != 4 or n < 2:
        raise ValueError("public_images must be [N, 3, H, W] with N >= 2")
    k = min(components, n - 1)
    flat = public_images.double().flatten(1)
    mean = flat.mean(dim=0)
    _, s, vh = torch.linalg.svd(flat - mean, full_matrices=False)
    shape = public_images.shape[1:]
    return FacePrior(
        mean=mean.view(shape).float(),
        std=flat.std(dim=0).clamp(min=1e-3).view(shape).float(),
        basis=vh[:k].float().contiguous(),
        scales=(s[:k] / math.sqrt(n - 1)).clamp(min=1e-6).float(),
    )


@dataclass(frozen=True)
class InversionResult:
    """Best reconstruction per target.

    Attributes:
        images: ``[T, 3, H, W]`` reconstructions in ``[-1, 1]``.
        loss: ``[T]`` objective of the kept image: its own terms plus the batch's BN term
            at the step it was kept (the term DeepInversion's best-batch selection uses).
        cosine: ``[T]`` cosine between the backbone embedding of the kept image (no jitter)
            and the target direction.
        restart_cosine: ``[T, R]`` the same for every restart's kept image.
    """

    images: torch.Tensor
    loss: torch.Tensor
    cosine: torch.Tensor
    restart_cosine: torch.Tensor


class _FeatureStatistics:
    """Forward hooks on BatchNorm layers collecting Eq. 4's statistics distance."""

    def __init__(self, backbone: nn.Module, first_multiplier: float) -> None:
        self.layers = [m for m in backbone.modules() if isinstance(m, _BatchNorm)]
        self.first_multiplier = first_multiplier
        self.terms: list[torch.Tensor] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def hook(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], _: torch.Tensor) -> None:
        x = inputs[0]
        dims = [0, *range(2, x.dim())]
        mean = x.mean(dim=dims)
        var = x.var(dim=dims, unbiased=False)
        assert isinstance(module, _BatchNorm)
        running_mean, running_var = module.running_mean, module.running_var
        if running_mean is None or running_var is None:
            return
        term = torch.linalg.vector_norm(mean - running_mean) + torch.linalg.vector_norm(
            var - running_var
        )
        weight = self.first_multiplier if not self.terms else 1.0
        self.terms.append(weight * term)

    def loss(self) -> torch.Tensor:
        """Sum of the collected terms since the last call (0 if none), then reset."""
        total = torch.stack(self.terms).sum() if self.terms else torch.zeros(())
        self.terms = []
        return total

    @contextmanager
    def attached(self) -> Iterator[_FeatureStatistics]:
        self.handles = [layer.register_forward_hook(self.hook) for layer in self.layers]
        try:
            yield self
        finally:
            for handle in self.handles:
                handle.remove()
            self.handles, self.terms = [], []


@torch.no_grad()
def feature_statistics_loss(
    backbone: nn.Module, images: torch.Tensor, *, first_multiplier: float = 10.0
) -> torch.Tensor:
    """DeepInversion's ``R_feature`` (Eq. 4) of a batch: BN batch statistics vs running ones.

    A measurement (no gradient). Returns 0 for a backbone without BatchNorm. The backbone
    should be in eval mode (as in the attack) so that the forward pass does not update the
    running statistics.
    """
    stats = _FeatureStatistics(backbone, first_multiplier)
    with stats.attached():
        backbone(images)
        return stats.loss()


def total_variation(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-image mean absolute and mean squared differences of neighbouring pixels.

    Returns:
        ``([N], [N])``: l1 and l2 total variation (horizontal and vertical neighbours).
    """
    dx = images[..., :, 1:] - images[..., :, :-1]
    dy = images[..., 1:, :] - images[..., :-1, :]
    l1 = dx.abs().flatten(1).mean(1) + dy.abs().flatten(1).mean(1)
    l2 = (dx**2).flatten(1).mean(1) + (dy**2).flatten(1).mean(1)
    return l1, l2


def _lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def invert(
    backbone: nn.Module,
    targets: torch.Tensor,
    *,
    image_size: int,
    config: InversionConfig | None = None,
    face_prior: FacePrior | None = None,
    class_embeddings: torch.Tensor | None = None,
    target_classes: torch.Tensor | None = None,
    on_step: Callable[[int], None] | None = None,
) -> InversionResult:
    """Reconstruct one image per target direction (DeepInversion adapted to cosine heads).

    Args:
        backbone: maps ``[N, 3, H, W]`` images in ``[-1, 1]`` to ``[N, D]`` embeddings; its
            parameters are not changed (it is put in eval mode and restored afterwards).
        targets: ``[T, D]`` target directions (head rows or surrogates; need not be unit).
        image_size: side of the square images to synthesise.
        config: attack settings.
        face_prior: public-face statistics, required by ``config.prior`` other than none.
        class_embeddings: ``[C, D]`` all class embeddings of the head, if the view has them:
            the target logit is then trained with cross-entropy against all classes.
        target_classes: ``[T]`` int64 row of ``class_embeddings`` of each target.
        on_step: called with the number of steps done after each step (a progress bar).

    Returns:
        The best reconstruction of each target over the restarts.

    Raises:
        ValueError: if a prior is requested without statistics, or shapes do not match.
    """
    cfg = config or InversionConfig()
    if targets.dim() != 2:
        raise ValueError(f"targets must be [T, D], got {tuple(targets.shape)}")
    if cfg.prior != "none" and face_prior is None:
        raise ValueError(f"prior={cfg.prior!r} needs a FacePrior (see fit_face_prior)")
    if (class_embeddings is None) != (target_classes is None):
        raise ValueError("class_embeddings and target_classes go together")
    num_targets, runs = targets.shape[0], cfg.restarts
    batch = num_targets * runs
    gen = torch.Generator().manual_seed(cfg.seed)
    direction = F.normalize(targets.detach().float(), dim=1).repeat_interleave(runs, dim=0)
    labels = None if target_classes is None else target_classes.repeat_interleave(runs)
    classes = None if class_embeddings is None else F.normalize(class_embeddings.detach(), dim=1)

    shape = (3, image_size, image_size)
    if cfg.prior == "subspace":
        assert face_prior is not None
        k = face_prior.basis.shape[0]
        param = (cfg.init_std * torch.randn(batch, k, generator=gen)).requires_grad_()
    else:
        start = cfg.init_std * torch.randn(batch, *shape, generator=gen)
        param = start.clamp(-1.0, 1.0).requires_grad_()

    def render() -> torch.Tensor:
        if cfg.prior == "subspace":
            assert face_prior is not None
            return face_prior.images(param).clamp(-1.0, 1.0)
        return param

    optimizer = torch.optim.Adam([param], lr=cfg.lr, betas=(0.5, 0.9))
    warmup = max(1, int(cfg.warmup_fraction * cfg.steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_factor(step, cfg.steps, warmup)
    )
    stats = _FeatureStatistics(backbone, cfg.first_bn_multiplier)
    use_bn = cfg.bn_weight > 0 and bool(stats.layers)
    best_loss = torch.full((batch,), math.inf)
    best_images = render().detach().clone()
    was_training = backbone.training
    grad_flags = [p.requires_grad for p in backbone.parameters()]
    backbone.eval()
    backbone.requires_grad_(False)
    try:
        with stats.attached():
            for step in range(cfg.steps):
                if on_step is not None and step:
                    on_step(step)
                images = render()
                view = images
                if cfg.jitter:
                    shift = torch.randint(-cfg.jitter, cfg.jitter + 1, (2,), generator=gen)
                    dy, dx = int(shift[0]), int(shift[1])
                    view = torch.roll(view, shifts=(dy, dx), dims=(2, 3))
                if cfg.flip and bool(torch.rand((), generator=gen) < 0.5):
                    view = view.flip(3)
                stats.terms = []
                embedding = F.normalize(backbone(view), dim=1)
                bn_term = stats.loss()
                if classes is not None and labels is not None:
                    logits = cfg.logit_scale * embedding @ classes.T
                    main = F.cross_entropy(logits, labels, reduction="none")
                else:
                    main = -cfg.logit_scale * (embedding * direction).sum(dim=1)
                tv1, tv2 = total_variation(images)
                per_image = main + cfg.tv_l1 * tv1 + cfg.tv_l2 * tv2
                per_image = per_image + cfg.l2 * (images**2).flatten(1).mean(1)
                if cfg.prior == "subspace":
                    per_image = per_image + cfg.prior_weight * (param**2).mean(1)
                elif cfg.prior == "penalty":
                    assert face_prior is not None
                    z = (images - face_prior.mean) / face_prior.std
                    per_image = per_image + cfg.prior_weight * (z**2).flatten(1).mean(1)
                if use_bn:  # batch-level term, shared by every image of the batch
                    per_image = per_image + cfg.bn_weight * bn_term
                loss = per_image.sum()
                with torch.no_grad():
                    improved = per_image.detach() < best_loss
                    best_loss = torch.where(improved, per_image.detach(), best_loss)
                    best_images[improved] = images.detach()[improved]
                optimizer.zero_grad(set_to_none=True)
                torch.autograd.backward(loss)
                optimizer.step()
                schedule.step()
                if cfg.prior != "subspace":
                    with torch.no_grad():
                        param.clamp_(-1.0, 1.0)
            if on_step is not None:
                on_step(cfg.steps)
        with torch.no_grad():
            final = F.normalize(backbone(best_images), dim=1)
            cosine = (final * direction).sum(dim=1)
    finally:
        for p, flag in zip(backbone.parameters(), grad_flags, strict=True):
            p.requires_grad_(flag)
        backbone.train(was_training)
    losses = best_loss.view(num_targets, runs)
    pick = losses.argmin(dim=1)
    rows = torch.arange(num_targets) * runs + pick
    return InversionResult(
        images=best_images[rows],
        loss=losses.gather(1, pick.unsqueeze(1)).squeeze(1),
        cosine=cosine[rows],
        restart_cosine=cosine.view(num_targets, runs),
    )


def mean_embedding_target(
    backbone: nn.Module, public_images: torch.Tensor, batch_size: int = 256
) -> torch.Tensor:
    """Surrogate target: the unit mean of the normalised embeddings of public faces, ``[D]``."""
    was_training = backbone.training
    backbone.eval()
    try:
        with torch.no_grad():
            parts = [
                F.normalize(backbone(public_images[i : i + batch_size]), dim=1)
                for i in range(0, len(public_images), batch_size)
            ]
    finally:
        backbone.train(was_training)
    return F.normalize(torch.cat(parts).mean(dim=0), dim=0)


def random_direction_target(
    dim: int, count: int = 1, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Surrogate targets: ``[count, dim]`` directions uniform on the unit sphere."""
    return F.normalize(torch.randn(count, dim, generator=generator), dim=1)
