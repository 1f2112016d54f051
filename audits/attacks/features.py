"""Forward passes of an attacked backbone in batches: its embeddings and penultimate features."""

from __future__ import annotations

import torch

#: Images per forward pass.
BATCH = 256


def embed(backbone: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The backbone's embeddings of ``images`` (eval mode, no gradients)."""
    with torch.no_grad():
        backbone.eval()
        return torch.cat([backbone(images[i : i + BATCH]) for i in range(0, len(images), BATCH)])


def penultimate(backbone: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The inputs of the backbone's fully connected embedding layer for ``images``."""
    layer = backbone.embedding
    assert isinstance(layer, torch.nn.Linear)
    seen: list[torch.Tensor] = []
    hook = layer.register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
    try:
        embed(backbone, images)
    finally:
        hook.remove()
    return torch.cat(seen)
