"""Fixtures shared by the test folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers on two cores
    import torch

    torch.set_num_threads(1)

TINY_ADAFEDFR = """
[run]
name = "tiny-adafedfr"
seed = 3
[data]
source = "synthetic"
image_size = 32
num_identities = 12
images_per_identity = 4
held_out_identities = 4
[partition]
num_clients = 2
[model]
backbone = "cnn-small"
embedding_size = 16
[algorithm]
name = "adafedfr"
num_negatives = 3
public_identities = 5
public_images_per_identity = 2
[train]
rounds = 2
local_steps = 2
batch_size = 4
[eval]
tune_steps = 0
[privacy]
unit = "none"
[secure_aggregation]
scheme = "none"
"""


@pytest.fixture
def tiny_adafedfr(tmp_path: Path) -> Path:
    """A tiny synthetic AdaFedFR run (2 clients, 5 public identities, 2 rounds), as TOML."""
    path = tmp_path / "tiny-adafedfr.toml"
    path.write_text(TINY_ADAFEDFR)
    return path
