"""train --centralized: what it refuses before it writes anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_secure.centralized import run_centralized
from fl_secure.config import config_from_dict
from fl_secure.errors import DataError


def test_a_bad_data_path_is_named_before_a_run_directory_exists(tmp_path: Path) -> None:
    # Prepare: identity folders that are not there
    config = config_from_dict({
        "data": {"source": "folders", "path": str(tmp_path / "no-such-faces"),
                 "image_size": 32, "held_out_identities": 2},
        "partition": {"num_clients": 2}, "server": {"min_clients": 2},
        "model": {"backbone": "cnn-small", "embedding_size": 32},
    })  # fmt: skip
    out = tmp_path / "runs"
    # Execute / Assert: the folder is named, and no run directory is left behind
    with pytest.raises(DataError, match="no-such-faces"):
        run_centralized(config, out=out, progress=False)
    assert not out.exists() or list(out.iterdir()) == []
