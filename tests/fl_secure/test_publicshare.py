"""FedFR-style data sharing: public images broadcast, private head over own + public rows."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_secure.algorithms import get_strategy
from fl_secure.algorithms.adafedfr import public_dataset
from fl_secure.algorithms.publicshare import (
    IMAGES,
    LABELS,
    PublicDataShare,
    from_pixels,
    to_pixels,
)
from fl_secure.app.simulation import simulate
from fl_secure.config import load_config


def test_pixels_round_trip_within_half_a_grey_level() -> None:
    images = torch.rand(4, 3, 8, 8) * 2 - 1
    back = from_pixels(to_pixels(images))
    assert float((back - images).abs().max()) <= 0.5 / 127.5 + 1e-6
    assert to_pixels(torch.tensor([-1.0, 0.0, 1.0])).tolist() == [0, 128, 255]


def test_simulation_trains_on_own_and_public_images_and_counts_their_bytes(
    tiny_adafedfr: Path,
) -> None:
    # Prepare: the tiny AdaFedFR run as fedfr-public (5 public identities x 2 images)
    config = load_config(tiny_adafedfr, ["algorithm.name=fedfr-public"])
    strategy = get_strategy("fedfr-public", config.algorithm)
    assert isinstance(strategy, PublicDataShare) and strategy.public_identities == 5
    sent = strategy.broadcaster(config)(OrderedDict(), 1)
    public = public_dataset(config)
    # Execute
    result = simulate(config)
    # Assert: the broadcast is the public set as 8-bit pixels with indices 0..4; every
    # round's record counts its bytes with the backbone down and up; only the backbone is
    # aggregated; the clients' heads have their own identities plus 5 public rows
    assert sent[IMAGES].dtype == np.uint8 and sent[IMAGES].shape == (10, 3, 32, 32)
    assert sorted(set(sent[LABELS].tolist())) == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(sent[IMAGES], to_pixels(public.images))
    size = sum(v.nbytes for v in result.params.values())
    extra = 10 * 3 * 32 * 32 + 10 * 8
    for record in result.records[1:]:
        assert record["bytes_per_client"] == {
            "broadcast": extra,
            "parameters_down": size,
            "parameters_up": size,
            "total": extra + 2 * size,
        }
    assert all(name.startswith("backbone.") for name in result.params)


def test_a_bad_broadcast_is_refused() -> None:
    strategy = PublicDataShare(public_identities=3)
    images = np.zeros((4, 3, 8, 8), np.uint8)
    labels = np.array([0, 1, 2, 2], np.int64)
    model = torch.nn.Module()
    with pytest.raises(ValueError, match="uint8"):
        strategy.take_broadcast(  # type: ignore[arg-type]
            model, OrderedDict([(IMAGES, images.astype(np.float32)), (LABELS, labels)])
        )
    with pytest.raises(ValueError, match="0..2"):
        strategy.take_broadcast(  # type: ignore[arg-type]
            model, OrderedDict([(IMAGES, images), (LABELS, labels + 1)])
        )
    strategy.take_broadcast(model, OrderedDict([(IMAGES, images), (LABELS, labels)]))  # type: ignore[arg-type]
    assert strategy.public is not None and strategy.public[0].shape == (4, 3, 8, 8)
