"""Person-level DP across many single-identity devices: the training design and its rounds.

Cross-device face recognition (the FedFace / FedGC setting) has one person per device
(``partition.kind = "person"``), so client-level DP (DP-FedAvg, McMahan et al. 2018) protects
a person: everything of theirs is in one client's update. The design:

- **Start**: a backbone pretrained on *public* synthetic identities that no device holds; its
  trunk stays frozen and only the embedding layer (a few thousand parameters) is trained and
  shared. Each device passes its images through the frozen trunk once.
- **Loss on a device** (AdaFedFR's idea, ``002`` in the papers' folder): a CosFace softmax
  (s = 30, m = 0.4) of each own image against the device's *own* class vector (positive) and
  the server's **public class representations** ``R`` (negatives): the normalised mean
  embeddings of public identities (none of them a device's) under the current model,
  recomputed by the server every round from public images only. One identity alone has no
  negatives; ``R`` gives it some without anyone's private data.
- **What stays private**: the device's class vector is initialised from its own embeddings
  each round and never leaves the device; nothing of it is released.
- **What the server sees**: only the clipped, noised sum of the cohort's embedding-layer
  updates (Gaussian noise of std ``z C`` on the sum, from a CSPRNG). The placement here is
  central: the server is trusted to add the noise (the rounds run in one process; secure
  aggregation with noise in shares is the engine's ``distributed`` placement, not wired to
  this design yet). ``R`` is computed from public data only. So the whole release is inside
  the DP statement, unlike FedGC's server-side correction, which needs every device's class
  embedding in the clear, or a shared (global) head, whose row of a person is trained by
  that person's device alone.
- **Cohorts**: Poisson sampling, each device with probability ``q`` per round, decided by
  CSPRNG uniforms; the noisy sum is divided by the *expected* cohort ``q N`` (a fixed
  denominator, so the sensitivity of the release stays ``C``). Accounting
  (:func:`spent_epsilon`): the Gaussian over ``T`` rounds. The project states it at rate 1
  (:mod:`privacy.dp.amplification`: cohorts are published and redrawn), and the subsampled
  figure at rate ``q`` beside it, which trusts the server to draw in secret.
- **R's camera**: the public identities behind ``R`` must look like the devices' faces
  (measured in ``benchmarks/person_dp.py``: ``R`` from the pretraining camera gives the
  devices no useful negatives, and the non-private run no gain).

The devices' local steps run vectorised over the cohort (one batched tensor per parameter),
which makes 1,000+ virtual devices a matter of seconds per round on a CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fl_secure.errors import ConfigError
from fl_secure.evaluation.verification import verification_metrics
from privacy.dp.calibration import epsilon_for
from privacy.dp.noise import NoiseSource


@dataclass(frozen=True)
class PersonDPSettings:
    """One private (or non-private) federated fine-tuning of the embedding layer."""

    rounds: int = 30
    sample_rate: float = 0.2  # Poisson probability of each device per round
    clip_norm: float = 0.5  # C: the L2 bound of one device's update
    noise_multiplier: float = 0.0  # z: the noise std on the sum is z C; 0 = not private
    local_steps: int = 5  # full-batch steps on the device's own images
    local_lr: float = 0.5  # SGD on the embedding layer (and the private class vector)
    server_lr: float = 3.0  # the server's step along the averaged update
    scale: float = 30.0  # CosFace s (AdaFedFR: 30)
    margin: float = 0.4  # CosFace m (AdaFedFR: 0.4)

    def __post_init__(self) -> None:
        """Check ranges."""
        if self.rounds < 1 or self.local_steps < 1:
            raise ConfigError("rounds and local_steps must be >= 1")
        if not 0.0 < self.sample_rate <= 1.0:
            raise ConfigError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if not (self.clip_norm > 0 and self.noise_multiplier >= 0):
            raise ConfigError("clip_norm must be > 0 and noise_multiplier >= 0")
        if not (self.local_lr > 0 and self.server_lr > 0):
            raise ConfigError("local_lr and server_lr must be > 0")


@dataclass
class EmbeddingLayer:
    """The shared, trained part: ``embedding = features @ weight.T + bias``."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor  # [out]

    def flat(self) -> torch.Tensor:
        """Both tensors as one vector (the update that is clipped and noised)."""
        return torch.cat([self.weight.flatten(), self.bias])

    def stepped(self, delta: torch.Tensor) -> EmbeddingLayer:
        """This layer plus a flat ``delta``."""
        n = self.weight.numel()
        return EmbeddingLayer(
            self.weight + delta[:n].view_as(self.weight), self.bias + delta[n:].view_as(self.bias)
        )

    def embed(self, features: torch.Tensor) -> torch.Tensor:
        """Unnormalised embeddings of ``[..., in]`` trunk features."""
        return features @ self.weight.T + self.bias


def public_representations(
    layer: EmbeddingLayer, features: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """``R``: each public identity's normalised mean of normalised embeddings, ``[P, out]``."""
    with torch.no_grad():
        unit = F.normalize(layer.embed(features), dim=1)
        ids, inverse = torch.unique(labels, return_inverse=True)
        sums = torch.zeros(len(ids), unit.shape[1]).index_add_(0, inverse, unit)
        return F.normalize(sums, dim=1)


def local_updates(
    layer: EmbeddingLayer, features: torch.Tensor, negatives: torch.Tensor, s: PersonDPSettings
) -> torch.Tensor:
    """Each device's update of the layer, ``[m, d]``, from its own ``[m, n, in]`` features.

    Device ``k`` starts from ``layer`` with its private class vector at the normalised mean
    of its own embeddings, and takes ``s.local_steps`` full-batch SGD steps on the CosFace
    loss of its images against (own vector, ``negatives``). The devices are independent: the
    loss is a sum over devices of terms each in one device's parameters only.
    """
    m = features.shape[0]
    weight = layer.weight.expand(m, -1, -1).clone().requires_grad_(True)
    bias = layer.bias.expand(m, -1).clone().requires_grad_(True)

    def embed() -> torch.Tensor:  # [m, n, out], unit rows
        raw = torch.baddbmm(bias.unsqueeze(1), features, weight.transpose(1, 2))
        return F.normalize(raw, dim=2)

    with torch.no_grad():
        own = F.normalize(embed().mean(dim=1), dim=1)
    own.requires_grad_(True)
    target = torch.zeros(features.shape[0] * features.shape[1], dtype=torch.long)
    for _ in range(s.local_steps):
        emb = embed()
        positive = (emb * F.normalize(own, dim=1).unsqueeze(1)).sum(dim=2, keepdim=True)
        logits = s.scale * torch.cat([positive - s.margin, emb @ negatives.T], dim=2)
        loss = F.cross_entropy(logits.flatten(0, 1), target, reduction="sum") / features.shape[1]
        gw, gb, go = torch.autograd.grad(loss, (weight, bias, own))
        with torch.no_grad():
            weight -= s.local_lr * gw
            bias -= s.local_lr * gb
            own -= s.local_lr * go
    with torch.no_grad():
        return torch.cat([weight.flatten(1), bias], dim=1) - layer.flat()


def clip_rows(updates: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """Each row scaled to L2 norm at most ``clip_norm`` (DP-FedAvg's per-client clipping)."""
    norms = updates.norm(dim=1, keepdim=True)
    return updates * torch.clamp(clip_norm / torch.clamp(norms, min=1e-12), max=1.0)


@dataclass(frozen=True)
class RoundRecord:
    """What one round did (the cohort size is the only thing released besides the sum)."""

    cohort: int
    mean_update_norm: float  # of the clipped updates, before noise
    signal_norm: float  # of the clipped sum / (q N)
    noise_norm: float  # of the noise / (q N)


def private_round(
    layer: EmbeddingLayer,
    device_features: torch.Tensor,
    negatives: torch.Tensor,
    s: PersonDPSettings,
    source: NoiseSource,
) -> tuple[EmbeddingLayer, RoundRecord]:
    """One round: Poisson cohort, local updates, clipped sum + Gaussian noise, server step.

    Args:
        layer: the global embedding layer.
        device_features: ``[N, n, in]`` trunk features of every device's training images.
        negatives: the public class representations ``R``.
        s: the settings.
        source: the CSPRNG that draws the cohort and the noise.
    """
    population = device_features.shape[0]
    chosen = np.flatnonzero(source.uniform(population) < s.sample_rate)
    expected = s.sample_rate * population
    total = torch.zeros_like(layer.flat())
    norms: list[float] = []
    for start in range(0, len(chosen), 256):  # bounded memory for large cohorts
        batch = torch.from_numpy(chosen[start : start + 256])
        clipped = clip_rows(local_updates(layer, device_features[batch], negatives, s), s.clip_norm)
        norms.extend(clipped.norm(dim=1).tolist())
        total += clipped.sum(dim=0)
    noise = torch.zeros_like(total)
    if s.noise_multiplier > 0:
        std = s.noise_multiplier * s.clip_norm
        noise = torch.from_numpy(source.standard_normal(total.numel()) * std).to(total.dtype)
    step = (total + noise) / expected
    record = RoundRecord(
        cohort=len(chosen),
        mean_update_norm=float(np.mean(norms)) if norms else 0.0,
        signal_norm=float(total.norm() / expected),
        noise_norm=float(noise.norm() / expected),
    )
    return layer.stepped(s.server_lr * step), record


def run_person_dp(
    layer: EmbeddingLayer,
    device_features: torch.Tensor,
    public_features: torch.Tensor,
    public_labels: torch.Tensor,
    s: PersonDPSettings,
    source: NoiseSource,
    on_round: Callable[[int, EmbeddingLayer, RoundRecord], None] | None = None,
) -> tuple[EmbeddingLayer, list[RoundRecord]]:
    """``s.rounds`` rounds from ``layer``; ``R`` is recomputed from public data every round."""
    records = []
    for number in range(1, s.rounds + 1):
        negatives = public_representations(layer, public_features, public_labels)
        layer, record = private_round(layer, device_features, negatives, s, source)
        records.append(record)
        if on_round is not None:
            on_round(number, layer, record)
    return layer, records


def spent_epsilon(s: PersonDPSettings, delta: float, accountant: str = "pld") -> float:
    """Epsilon of the run at ``delta``: ``s.rounds`` Poisson-subsampled Gaussian releases."""
    if s.noise_multiplier == 0:
        return math.inf
    return epsilon_for(
        accountant=accountant,
        noise_multiplier=s.noise_multiplier,
        sample_rate=s.sample_rate,
        steps=s.rounds,
        delta=delta,
    )


def held_out_tar(
    layer: EmbeddingLayer, features: torch.Tensor, labels: torch.Tensor
) -> dict[str, float]:
    """TAR at FAR 1e-2 and 1e-3 over all pairs of the held-out identities' images."""
    with torch.no_grad():
        metrics = verification_metrics(layer.embed(features).numpy(), labels.numpy())
    return {k: metrics[k] for k in ("tar_at_far_1e-2", "tar_at_far_1e-3")}
