"""PNG grids: layout and pixel values survive the round trip."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from audits.grids import grid_rows, save_grid


def test_grid_pixels_are_the_denormalised_images(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    real = [
        torch.rand(2, 3, 8, 8, generator=g) * 2 - 1,
        torch.rand(1, 3, 8, 8, generator=g) * 2 - 1,
    ]
    recon = [
        torch.rand(1, 3, 8, 8, generator=g) * 2 - 1,
        torch.rand(1, 3, 8, 8, generator=g) * 2 - 1,
    ]
    path = save_grid(tmp_path / "sub" / "grid.png", real, recon, padding=2)
    assert path.stat().st_mode & 0o777 == 0o600  # a grid may show a site's real faces
    assert [p.name for p in path.parent.iterdir()] == ["grid.png"]  # no temporary left
    with Image.open(path) as image:
        assert image.format == "PNG" and image.mode == "RGB"
        pixels = np.asarray(image)
    assert pixels.shape == (2 + 2 * 10, 2 + 3 * 10, 3)  # 2 rows x 3 columns of 8 px + padding
    expected = ((real[0][1] + 1) / 2 * 255 + 0.5).clamp(0, 255).to(torch.uint8)
    cell = pixels[2:10, 12:20]  # row 0, column 1: the target's second real image
    assert np.array_equal(cell, expected.permute(1, 2, 0).numpy())
    # row 1: one real, one reconstruction, then a mid-grey filler
    filler = pixels[12:20, 22:30]
    assert np.all(filler == 128)


def test_grid_rows_truncates_to_the_column_count() -> None:
    cells = grid_rows([torch.ones(4, 3, 8, 8)], [-torch.ones(2, 3, 8, 8)], columns=5)
    assert cells.shape == (5, 3, 8, 8)
    assert float(cells[:4].min()) == 1.0 and float(cells[4].max()) == 0.0
