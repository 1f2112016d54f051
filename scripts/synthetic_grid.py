"""Write docs/synthetic_faces.png: 8 synthetic identities (rows) x 6 images (columns).

Only synthetic faces: real faces (ORL, LFW) never go into the repository.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image

from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    """Render the grid (2x upscaled) and save it."""
    data = generate_synthetic_faces(SyntheticFaceConfig(8, 6, image_size=64, seed=0))
    imgs = ((data.images.numpy() + 1) * 127.5).clip(0, 255).astype(np.uint8)
    rows = [
        np.concatenate(list(imgs[r * 6 : (r + 1) * 6].transpose(0, 2, 3, 1)), 1) for r in range(8)
    ]
    grid = Image.fromarray(np.concatenate(rows, 0)).resize((6 * 128, 8 * 128), Image.NEAREST)
    out = ROOT / "docs" / "synthetic_faces.png"
    out.parent.mkdir(exist_ok=True)
    grid.save(out, optimize=True)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
