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


def test_fedaffect_prints_expression_accuracy_beside_the_majority_class(
    capsys: pytest.CaptureFixture[str],
) -> None:
    held = {"expression_accuracy": 0.35357, "expression_majority": 0.35357}
    summary: dict[str, object] = {"status": "completed", "held_out": held}
    summary["untrained"] = {"expression_accuracy": 0.2}
    assert _report(summary, Path("run"), as_json=False) == 0
    out = capsys.readouterr().out
    assert "expression accuracy: 0.3536   (always the most frequent expression: 0.3536)" in out
    assert "(untrained: 0.2000)" in out and "no better than always answering" in out
