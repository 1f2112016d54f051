"""The in-flight marker beside a ledger: written, read back, and refused when damaged."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_secure.errors import PrivacyError
from privacy.ledger.inflight import inflight_path, read_inflight, write_inflight


def test_a_marker_is_read_back_as_written_beside_its_ledger(tmp_path: Path) -> None:
    # Prepare
    path = inflight_path(tmp_path / "ledger.sqlite")
    # Execute
    missing = read_inflight(path)
    write_inflight(path, 3, 1, 8)
    # Assert
    assert path == tmp_path / "ledger.inflight.json"
    assert missing is None and read_inflight(path) == (3, 1, 8)


@pytest.mark.parametrize("text", ["{", '{"round": 3, "attempt": 1}', '{"round": "x"}'])
def test_a_damaged_marker_refuses_to_resume(tmp_path: Path, text: str) -> None:
    path = inflight_path(tmp_path / "ledger.sqlite")
    path.write_text(text)
    with pytest.raises(PrivacyError, match="in-flight marker .* is damaged"):
        read_inflight(path)
