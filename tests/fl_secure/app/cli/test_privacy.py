"""fl-secure privacy {epsilon,calibrate,ledger} through the main entry point."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from fl_secure.app.cli import main
from privacy.ledger.recompute import client_event, composed_epsilon
from privacy.ledger.run_ledger import Ledger
from privacy.ledger.signed_head import HeadSigner

PAYLOAD = {
    "noise_multiplier": 1.1, "sample_rate": 0.5, "clip_norm": 1.0, "cohort_size": 4,
    "accountant": "pld", "epsilon": 0.5, "delta": 1e-5, "noise_placement": "local",
}  # fmt: skip


def test_epsilon_json_matches_published_pld_figure(capsys: pytest.CaptureFixture[str]) -> None:
    args = "privacy epsilon --noise-multiplier 4 --sample-rate 0.01 --steps 10000 --delta 1e-5"
    code = main([*args.split(), "--accountant", "pld", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["epsilon"] == pytest.approx(0.947, abs=2e-3)  # Abadi et al. 2016 setting
    assert out["adjacency"] == "add/remove" and out["accountant"] == "pld"


def test_printed_epsilon_and_calibrated_z_are_rounded_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # epsilon 7.953617 must not print as 7.9536 (a bound rounded down); a calibrated z of
    # 1.15625... must not print as 1.1562 (a smaller z spends more than the target)
    args = "privacy epsilon --noise-multiplier 6.03125 --sample-rate 1 --steps 100 --delta 1e-5"
    assert main([*args.split(), "--accountant", "pld"]) == 0
    text = capsys.readouterr().out
    assert "epsilon = 7.9537 at delta" in text and "noise multiplier 6.03125," in text
    calibrate = "privacy calibrate --target-epsilon 2 --sample-rate 0.01 --steps 2000 --delta 1e-5"
    assert main([*calibrate.split(), "--accountant", "prv"]) == 0
    assert "noise multiplier 1.1563," in capsys.readouterr().out
    assert main([*calibrate.split(), "--accountant", "prv", "--json"]) == 0
    z = json.loads(capsys.readouterr().out)["noise_multiplier"]
    assert 1.15620 < z <= 1.1563  # what was printed is not below what was calibrated


def _signed_ledger(run: Path) -> str:
    """Three rounds at PAYLOAD's parameters, their epsilons composed, the head signed."""
    history: list[dict[str, Any]] = []
    with Ledger.open(run / "ledger.sqlite", "run-1", signer=HeadSigner.generate()) as ledger:
        for r in (1, 2, 3):
            history.append(client_event(PAYLOAD))
            payload: dict[str, Any] = {**PAYLOAD, "epsilon": composed_epsilon("pld", history, 1e-5)}
            ledger.append("client_level", round=r, party="server", payload=payload)
        return ledger.head()


def test_ledger_view_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _signed_ledger(tmp_path)
    assert main(["privacy", "ledger", "--run", str(tmp_path), "--verify", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["entries"]) == 3 and out["verify"]["ok"] is True
    with sqlite3.connect(tmp_path / "ledger.sqlite") as conn:  # tamper: edit round 2's epsilon
        conn.execute("UPDATE entries SET payload = replace(payload, '0.5', '0.05') WHERE seq = 2")
    assert main(["privacy", "ledger", "--run", str(tmp_path), "--verify"]) == 1
    assert "seq 2" in capsys.readouterr().out
    assert main(["privacy", "ledger", "--run", str(tmp_path / "nope")]) == 2


def test_ledger_verify_checks_the_head_summary_json_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    head = _signed_ledger(tmp_path)
    verify = ["privacy", "ledger", "--run", str(tmp_path), "--verify"]
    assert main(verify) == 0
    out = capsys.readouterr().out
    assert "entries dropped from the end cannot be detected" not in out  # the head is signed
    assert "signed head: 3 entries, key " in out and "(pin with --ledger-key)" in out
    summary = {"epsilon": 0.5, "privacy": {"ledger_entries": 3, "ledger_head": head}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert main(verify) == 0
    assert f"checked against summary.json: 3 entries, head {head[:12]}" in capsys.readouterr().out
    with sqlite3.connect(tmp_path / "ledger.sqlite") as conn:  # drop the newest row
        conn.execute("DELETE FROM entries WHERE seq = 3")
    assert main([*verify, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["verify"]["checked_against_summary"] == {"entries": 3, "head": head}
    assert out["verify"]["problems"] == [
        f"seq 2: the ledger has 2 entries but the run recorded 3 ending at {head[:12]} "
        "(entries dropped from the end)",
        "ledger.head.json: the server signed a ledger of 3 entries, but it holds 2 (entry 3 "
        "dropped from the end)",
    ]
    (tmp_path / "summary.json").write_text("{not json")
    assert main(verify) == 1
    assert "summary.json: unreadable" in capsys.readouterr().out


def test_site_prints_the_site_ledger_and_a_client_budget_needs_a_state_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fl_secure.config import config_from_dict
    from privacy.ledger.site_ledger import SiteLedger

    # Prepare: three local-noise releases at z = 1.25 in the site's state folder
    config = config_from_dict({"privacy": {"unit": "client", "noise_multiplier": 1.25}})
    site = SiteLedger(tmp_path)
    for round_ in (1, 2, 3):
        site.record(config, "run-x", round_, bytes([round_]) * 16)
    # Execute / Assert: the JSON figures are the ledger's, the text names the run
    assert main(["privacy", "site", "--state-dir", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["releases"] == 3 and out["releases_by_run"] == {"run-x": 3}
    assert out["epsilon"] == pytest.approx(site.epsilon()) and out["delta"] == 1e-5
    assert main(["privacy", "site", "--state-dir", str(tmp_path), "--delta", "1e-6"]) == 0
    text = capsys.readouterr().out
    assert "3 updates released: run-x (3)" in text and "at delta = 1e-06" in text
    one_image = SiteLedger(tmp_path, delta=1e-6).example_epsilon()
    from privacy.dp.rounding import round_up

    assert f"example-level epsilon (one training image) = {round_up(one_image, 5)}" in text
    assert out["example_epsilon"] == pytest.approx(site.example_epsilon())
    assert main(["privacy", "site", "--state-dir", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # a budget without a state folder is refused before the client dials (port 1 would hang)
    base = ["client", "--server", "127.0.0.1:1", "--id", "site-a", "--insecure", "--quiet"]
    assert main([*base, "--max-epsilon", "4"]) == 2
    assert "needs a state folder (--state-dir)" in capsys.readouterr().err
    assert main([*base, "--max-example-epsilon", "4"]) == 2
    assert "needs a state folder (--state-dir)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--max-epsilon", "0"])
    assert "--max-epsilon must be > 0, got 0" in capsys.readouterr().err
