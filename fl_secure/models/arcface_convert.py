"""Convert an insightface arcface_torch ``backbone.pth`` into this project's safetensors format.

``model.pretrained`` reads a ``.pth`` directly (:func:`fl_secure.models.factory.load_pretrained`);
converting once gives a file that needs no unpickler at all, with the source's SHA-256 and the
backbone name in its header. The depth (iresnet18/34/50) and the embedding size are read from
the checkpoint's names and shapes. Usage::

    python -m fl_secure.models.arcface_convert backbone.pth backbone.safetensors
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import torch

from fl_secure.errors import CheckpointError, FlSecureError
from fl_secure.models.dlib_weights import sha256_file
from fl_secure.models.factory import get_backbone, load_pretrained, save_weights
from fl_secure.models.iresnet import DEPTHS, IMAGE_SIZE
from fl_secure.models.torch_weights import read_torch_state_dict

_UNIT_KEY: Final = re.compile(r"layer([1-4])\.(\d+)\.conv1\.weight")


def infer_iresnet(tensors: Mapping[str, torch.Tensor], source: Path) -> tuple[str, int]:
    """The iresnet name and embedding size of an arcface_torch state dict.

    Raises:
        CheckpointError: if the units per stage are not those of a known iresnet, or there is
            no 2-d ``fc.weight``.
    """
    units: Counter[int] = Counter()
    for key in tensors:
        match = _UNIT_KEY.fullmatch(key)
        if match:
            units[int(match.group(1))] += 1
    depths = tuple(units[stage] for stage in (1, 2, 3, 4))
    names = [name for name, known in DEPTHS.items() if known == depths]
    if not names:
        raise CheckpointError(
            f"{source}: residual units per stage {depths} are not those of a known iresnet "
            f"({', '.join(f'{name} {known}' for name, known in DEPTHS.items())})"
        )
    fc = tensors.get("fc.weight")
    if fc is None or fc.dim() != 2:
        raise CheckpointError(f"{source}: no 2-d 'fc.weight' to read the embedding size from")
    return names[0], int(fc.shape[0])


def convert_arcface_checkpoint(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, backbone: str = ""
) -> tuple[str, int]:
    """Check an arcface_torch ``.pth`` against our iresnet and write it as safetensors.

    Args:
        src: the ``backbone.pth`` (read with PyTorch's restricted unpickler only).
        dst: the safetensors file to write (atomically).
        backbone: ``iresnet18``/``34``/``50``; empty: inferred from the checkpoint.

    Returns:
        The values for ``model.backbone`` and ``model.embedding_size``.

    Raises:
        CheckpointError: if ``src`` is not a plain state dict of that iresnet.
        ConfigError: if ``backbone`` is not an iresnet name.
    """
    source = Path(src)
    name, embedding_size = infer_iresnet(read_torch_state_dict(source), source)
    name = backbone or name
    model = get_backbone(name, embedding_size=embedding_size, image_size=IMAGE_SIZE)
    load_pretrained(model, source)
    metadata = {
        "format": "fl-secure backbone",
        "backbone": name,
        "embedding_size": str(embedding_size),
        "source": source.name,
        "source_sha256": sha256_file(source),
    }
    save_weights(model, dst, metadata=metadata)
    return name, embedding_size


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m fl_secure.models.arcface_convert SRC DST [--backbone NAME]``."""
    parser = argparse.ArgumentParser(
        prog="python -m fl_secure.models.arcface_convert",
        description="Convert an insightface arcface_torch backbone.pth to safetensors.",
    )
    parser.add_argument("src", help="arcface_torch backbone.pth (a torch.save'd state dict)")
    parser.add_argument("dst", help="safetensors file to write")
    parser.add_argument("--backbone", choices=sorted(DEPTHS), default="", help="default: inferred")
    args = parser.parse_args(argv)
    try:
        name, size = convert_arcface_checkpoint(args.src, args.dst, backbone=args.backbone)
    except FlSecureError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.dst}: model.backbone = {name!r}, model.embedding_size = {size}, "
        f"model.pretrained = {args.dst!r}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
