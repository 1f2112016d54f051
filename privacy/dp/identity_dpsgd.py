"""Identity-level DP-SGD for a client's local training: one person is the protected record.

With ``privacy.unit = "identity"`` the neighbouring data sets of a site differ by one
*identity*: every image of one person at that site (added or removed together). Each client
runs DP-SGD (Abadi et al., CCS 2016, Algorithm 1) with identities in place of examples, the
user-level DP-SGD of McMahan et al. ("Learning Differentially Private Recurrent Language
Models", ICLR 2018) inside one site:

1. **Poisson sampling of identities.** Each logical step includes every identity of the site
   independently with probability ``q`` (``noise.uniform(m) < q`` for the site's ``m``
   identities, from the same generator as the noise, as example-level sampling does). A
   sampled identity brings *all* its training images to the step.
2. **Per-identity gradient**: the gradient of the *sum* of the per-example losses over that
   identity's images, over every trainable parameter (``requires_grad=True``; those
   ``train.trainable`` froze take no part: no gradient, noise or update), computed by one
   forward/backward per identity (in chunks of at most ``max_physical_batch_size`` images
   whose gradients add up exactly, so no image is ever dropped and memory stays bounded).
3. **Clipping** each identity's gradient to L2 norm ``C`` (Opacus' factor
   ``min(1, C / (norm + 1e-6))``) and summing: adding or removing one identity changes the
   sum by at most ``C``, however many images the person has.
4. **Noise** ``N(0, z^2 C^2)`` per coordinate from a :class:`privacy.dp.noise.NoiseSource`
   (the ChaCha20 CSPRNG unless ``privacy.secure_rng = false``), the sum divided by the
   expected number of sampled identities ``q * m`` (not rounded), then one step of the
   configured optimiser over the trainable parameters only. An empty sample still takes a
   step of pure noise, as the analysis assumes.

Each step is thus the Poisson-subsampled Gaussian mechanism with rate ``q`` and noise
multiplier ``z`` over the ``m`` identities; the accountants compose it exactly as they do
example-level steps (:mod:`privacy.dp.example_level`). The guarantee covers the model
parameters only; the returned loss and accuracy are not private. As at the example level,
the site's label space (its head's classes, and a shared head's class mask) is fixed before
training and taken as public: the guarantee hides everything about a person's images (which,
how many, what they show) but not whether the site enrolled that identity as a class.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fl_secure.errors import PrivacyError
from fl_secure.messages import LocalTraining
from fl_secure.training import AbsentRows, FaceModel, LocalData, make_optimizer, parameter_groups
from privacy.dp.dpsgd import DPSGDSettings, dpsgd_steps, validate_model
from privacy.dp.noise import NoiseSource, gaussian_tensor_like

#: Opacus' stabiliser of the clipping factor ``C / (norm + eps)``.
CLIP_EPS = 1e-6


def identity_groups(labels: torch.Tensor) -> list[torch.Tensor]:
    """The image indices of each identity in ``labels``, identities in ascending order."""
    if labels.dim() != 1:
        raise PrivacyError(f"identity labels must be one-dimensional, got {tuple(labels.shape)}")
    _, inverse = torch.unique(labels, return_inverse=True)
    order = torch.argsort(inverse, stable=True)
    counts = torch.bincount(inverse).tolist()
    return list(torch.split(order, counts))


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters DP-SGD clips, noises and updates: ``requires_grad=True`` only."""
    return [p for p in model.parameters() if p.requires_grad]


def clipped_identity_sum(
    model: FaceModel,
    data: LocalData,
    groups: list[torch.Tensor],
    params: list[nn.Parameter],
    clip_norm: float,
    chunk: int,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Sum over ``groups`` of each identity's summed-loss gradient clipped to ``clip_norm``.

    Returns the sum (one tensor per parameter of ``params``) and the plain loss sum, correct
    predictions and image count of the forward passes (for local logs only).
    """
    total = [torch.zeros_like(p) for p in params]
    stats = {"loss": 0.0, "correct": 0.0, "seen": 0.0}
    for idx in groups:
        grads = [torch.zeros_like(p) for p in params]
        for part in torch.split(idx, chunk):
            images, targets = data.train.images[part], data.train_targets[part]
            embeddings = model.backbone(images)
            logits = model.head(embeddings, targets, data.class_mask)
            losses = nn.functional.cross_entropy(logits, targets, reduction="none")
            found = torch.autograd.grad(losses.sum(), params, allow_unused=True)
            for g, f in zip(grads, found, strict=True):
                if f is not None:
                    g += f
            with torch.no_grad():
                plain = model.head(embeddings.detach(), None, data.class_mask)
                stats["correct"] += float((plain.argmax(1) == targets).sum())
            stats["loss"] += float(losses.detach().sum())
            stats["seen"] += len(part)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))  # type: ignore[arg-type]
        factor = min(1.0, clip_norm / (float(norm) + CLIP_EPS))
        for t, g in zip(total, grads, strict=True):
            t += g * factor
    return total, stats


def train_local_identity_dpsgd(
    model: FaceModel,
    data: LocalData,
    training: LocalTraining,
    settings: DPSGDSettings,
    *,
    noise: NoiseSource,
) -> dict[str, float]:
    """Train like :func:`privacy.dp.dpsgd.train_local_dpsgd`, with identity-level DP-SGD.

    The identities are ``data.train.labels`` (the identity of each training image, not the
    head's targets). ``settings.sample_rate`` is the per-identity Poisson rate ``q``,
    ``settings.max_grad_norm`` the per-identity bound ``C``, ``settings.max_physical_batch_size``
    the most images of one identity in one forward pass (``settings.clipping`` is not used:
    the per-identity gradients are computed directly). Takes
    ``dpsgd_steps(m, training, q)`` steps. Absent classes' head rows are restored after every
    step, as in ``train_local``. Only parameters with ``requires_grad=True`` change.

    Returns:
        ``train_loss`` and ``train_accuracy`` over the sampled images (not private),
        ``local_steps`` and ``dp_noise_secure`` (1.0 if ``noise`` is a CSPRNG).

    Raises:
        PrivacyError: if the model cannot be trained privately (BatchNorm) or has no
            trainable parameter, or the site holds no image.
    """
    validate_model(model)
    groups = identity_groups(data.train.labels)
    m = len(groups)
    steps = dpsgd_steps(m, training, settings.sample_rate)
    expected = settings.sample_rate * m
    params = trainable_parameters(model)
    if not params:
        raise PrivacyError("identity-level DP-SGD: the model has no trainable parameter")
    std = settings.noise_multiplier * settings.max_grad_norm
    model.train()
    optimizer = make_optimizer(parameter_groups(model, training), training)
    absent = AbsentRows(model, data.class_mask)
    totals = {"loss": 0.0, "correct": 0.0, "seen": 0.0}
    try:
        for _ in range(steps):
            sampled = np.flatnonzero(noise.uniform(m) < settings.sample_rate)
            summed, stats = clipped_identity_sum(
                model,
                data,
                [groups[int(i)] for i in sampled],
                params,
                settings.max_grad_norm,
                settings.max_physical_batch_size,
            )
            for key, value in stats.items():
                totals[key] += value
            for p, s in zip(params, summed, strict=True):
                noisy = s + gaussian_tensor_like(noise, s, std) if std > 0 else s
                p.grad = noisy / expected
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            absent.restore()
    finally:
        for p in model.parameters():
            p.grad = None
    seen = max(totals["seen"], 1.0)
    return {
        "train_loss": totals["loss"] / seen,
        "train_accuracy": totals["correct"] / seen,
        "local_steps": float(steps),
        "dp_noise_secure": 1.0 if noise.secure else 0.0,
    }


def number_of_identities(labels: torch.Tensor) -> int:
    """How many distinct identities ``labels`` hold (the ``m`` of identity-level DP-SGD)."""
    return int(torch.unique(labels).numel()) if labels.numel() else 0
