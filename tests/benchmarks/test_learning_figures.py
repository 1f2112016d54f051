"""The learning benchmark reads a run's figures whether or not it held identities out."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _learning():  # benchmarks/ is a folder of scripts, not a package
    spec = importlib.util.spec_from_file_location("learning", ROOT / "benchmarks" / "learning.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_held_out_figures_and_the_clients_mean_without_held_out_identities() -> None:
    learning = _learning()
    held = {"tar_at_far_1e-2": 0.5, "rank1": 0.75, "untrained": {"tar_at_far_1e-2": 0.1}}
    evaluation, trained, untrained = learning._figures(held)
    assert evaluation == "held-out identities"
    assert trained["tar_at_far_1e-2"] == 0.5 and untrained["tar_at_far_1e-2"] == 0.1
    # ORL: no held-out identities; the summary has the clients' mean (it used to KeyError)
    orl = {
        "clients_summary": {"tar_at_far_1e-2_mean": 0.6, "rank1_mean": 0.9},
        "untrained_clients_summary": {"tar_at_far_1e-2_mean": 0.2},
    }
    evaluation, trained, untrained = learning._figures(orl)
    assert evaluation.startswith("mean over clients of their own test images")
    assert trained["tar_at_far_1e-2"] == 0.6 and trained["rank1"] == 0.9
    assert untrained["tar_at_far_1e-2"] == 0.2 and untrained["rank1"] is None
