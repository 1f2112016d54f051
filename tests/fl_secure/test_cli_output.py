"""What `fl-secure train` prints at the end of a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_secure.cli import _report


@pytest.mark.parametrize(
    ("initial", "label"),
    [("pretrained (model.pretrained)", "initial, pretrained"), (None, "untrained")],
)
def test_round_zero_is_named_for_what_it_was(
    initial: str | None, label: str, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = {
        "status": "completed",
        "tar_at_far_1e-2": 0.25,
        "untrained": {"tar_at_far_1e-2": 0.5},
    }
    if initial is not None:
        summary["initial_model"] = initial
    assert _report(summary, Path("run"), as_json=False) == 0
    assert f"tar_at_far_1e-2: 0.2500   ({label}: 0.5000)" in capsys.readouterr().out
