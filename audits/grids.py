"""PNG image grids: each target's real images beside its reconstructions.

Images arrive in the repo's ``[-1, 1]`` normalisation and are written as 8-bit RGB PNG with
``torchvision.utils.save_image`` (pixel ``round(255 * (x + 1) / 2)``). Grids of real faces
(ORL, LFW) belong in temporary or run folders only, never in the repository.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torchvision.utils import save_image

from audits.image_metrics import to_unit_range
from fl_secure.runs import atomic_write_bytes


def grid_rows(
    real: Sequence[torch.Tensor], reconstructed: Sequence[torch.Tensor], *, columns: int
) -> torch.Tensor:
    """Stack one row per target: its real images, then its reconstructions, padded to width.

    Args:
        real: per target, ``[n_i, 3, H, W]`` real images (may be empty).
        reconstructed: per target, ``[k_i, 3, H, W]`` reconstructions.
        columns: images per row; missing cells are filled with mid-grey (0 in ``[-1, 1]``).

    Returns:
        ``[targets * columns, 3, H, W]`` in ``[0, 1]``, row-major.
    """
    if len(real) != len(reconstructed) or not real:
        raise ValueError("need one (real, reconstructed) pair per target, at least one target")
    cells: list[torch.Tensor] = []
    for ours, theirs in zip(real, reconstructed, strict=True):
        row = torch.cat([ours, theirs])[:columns]
        if row.shape[0] < columns:
            pad = row.new_zeros((columns - row.shape[0], *row.shape[1:]))
            row = torch.cat([row, pad])
        cells.append(row)
    return to_unit_range(torch.cat(cells).detach().float().cpu())


def save_grid(
    path: str | os.PathLike[str],
    real: Sequence[torch.Tensor],
    reconstructed: Sequence[torch.Tensor],
    *,
    columns: int | None = None,
    padding: int = 2,
) -> Path:
    """Write a grid, one row per target (real images left, reconstructions right), as PNG.

    Args:
        path: destination ``.png`` (parent folders are created; the file is 0600).
        real: per target, ``[n_i, 3, H, W]`` real images in ``[-1, 1]``.
        reconstructed: per target, ``[k_i, 3, H, W]`` reconstructions in ``[-1, 1]``.
        columns: images per row (default: the widest row).
        padding: pixels between cells.

    Returns:
        The path written.
    """
    pairs = zip(real, reconstructed, strict=True)
    width = columns or max(a.shape[0] + b.shape[0] for a, b in pairs)
    cells = grid_rows(real, reconstructed, columns=width)
    target = Path(path)
    buffer = io.BytesIO()
    save_image(cells, buffer, nrow=width, padding=padding, format="png")
    # private (0600) and atomic, as the report's copies: a grid may show a site's real faces
    atomic_write_bytes(target, buffer.getvalue())
    return target
