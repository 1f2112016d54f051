"""FedAffect's ``LocalReprLearn`` parts: SimCLR's NT-Xent loss, augmented views, projection head.

Chen et al., "A Simple Framework for Contrastive Learning of Visual Representations" (ICML
2020), as Algorithm 1 of the FedAffect slides (lines 17-30) uses it on a client's unlabelled
images: two augmented views per image, ``z = p(f(t(x)))``, and the NT-Xent loss (lines
26-27)::

    l(i, j) = -log( exp(sim(z_i, z_j) / tau) / sum_{k != i} exp(sim(z_i, z_k) / tau) )
    L = 1 / (2B) * sum_k [ l(2k-1, 2k) + l(2k, 2k-1) ]

Choices made here, where the slides are silent:

- The projection head ``p`` is SimCLR's 2-layer MLP (:func:`projection_head`).
- Augmentations (SimCLR's random resized crop, horizontal flip, colour jitter; no hue jitter
  and no blur) are batched torch operations drawn from a ``torch.Generator``.

The training loop over these is :func:`fl_secure.algorithms.fedaffect_rounds.local_repr_learn`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, tau: float) -> torch.Tensor:
    """NT-Xent loss of Algorithm 1 lines 26-27 on two views ``[B, d]`` (row k of each pairs up).

    ``sim`` is the cosine similarity; each of the 2B views is an anchor whose positive is its
    other view and whose negatives are the other 2B - 2 views. Returns the mean over the 2B
    anchors, i.e. ``1/(2B) * sum_k [l(2k-1, 2k) + l(2k, 2k-1)]``.
    """
    if z1.shape != z2.shape or z1.dim() != 2 or z1.shape[0] < 2:
        raise ValueError(f"need two [B >= 2, d] views of equal shape, got {z1.shape}, {z2.shape}")
    b = z1.shape[0]
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    logits = z @ z.T / tau
    self_mask = torch.eye(2 * b, dtype=torch.bool, device=z.device)
    logits = logits.masked_fill(self_mask, float("-inf"))  # the 1[k != i] of the denominator
    positives = torch.cat([torch.arange(b, 2 * b), torch.arange(b)]).to(z.device)
    return F.cross_entropy(logits, positives)


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One SimCLR view per image: random resized crop, horizontal flip, colour jitter.

    Args:
        images: ``[B, 3, H, W]`` in ``[-1, 1]``.
        generator: source of every random draw (CPU generator).

    Returns:
        ``[B, 3, H, W]`` in ``[-1, 1]``: a crop of 30-100% of the area with aspect ratio in
        [3/4, 4/3] resized back to ``H x W`` (bilinear), flipped with probability 1/2, then
        with probability 0.8 brightness, contrast and saturation factors in [0.6, 1.4].
    """
    b = images.shape[0]

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        return low + (high - low) * torch.rand(*shape, generator=generator)

    area = uniform(0.3, 1.0, b)
    log_ratio = uniform(math.log(3 / 4), math.log(4 / 3), b)
    ratio = torch.exp(log_ratio)
    w = torch.sqrt(area * ratio).clamp(max=1.0)  # crop width / image width
    h = torch.sqrt(area / ratio).clamp(max=1.0)
    cx = (1 - w) * uniform(-1.0, 1.0, b)  # crop centre in [-1, 1] coordinates
    cy = (1 - h) * uniform(-1.0, 1.0, b)
    flip = torch.where(torch.rand(b, generator=generator) < 0.5, -1.0, 1.0)
    theta = torch.zeros(b, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2] = w * flip, cx
    theta[:, 1, 1], theta[:, 1, 2] = h, cy
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    out = F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)

    x = (out + 1) / 2  # jitter in [0, 1]
    jitter = (torch.rand(b, generator=generator) < 0.8).float().view(b, 1, 1, 1)

    def factor() -> torch.Tensor:
        f = uniform(0.6, 1.4, b).view(b, 1, 1, 1)
        return jitter * f + (1 - jitter)

    x = (x * factor()).clamp(0, 1)  # brightness
    grey = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)
    mean = grey.mean(dim=(2, 3), keepdim=True)
    x = ((x - mean) * factor() + mean).clamp(0, 1)  # contrast
    grey = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)
    x = ((x - grey) * factor() + grey).clamp(0, 1)  # saturation
    result: torch.Tensor = x * 2 - 1
    return result


def projection_head(embedding_size: int, projection_dim: int) -> nn.Module:
    """SimCLR's projection ``p``: Linear, ReLU, Linear (client-private)."""
    return nn.Sequential(
        nn.Linear(embedding_size, embedding_size),
        nn.ReLU(),
        nn.Linear(embedding_size, projection_dim),
    )
