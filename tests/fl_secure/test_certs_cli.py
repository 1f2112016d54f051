"""`fl-secure certs issue` and `fl-secure report --format`: the CLI over tested library calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fl_secure.cli import main
from fl_secure.errors import ConfigError
from fl_secure.tls import init_certificates
from fl_secure.tls.enrollment import EnrollmentList
from fl_secure.tls.identity import load_signing_registry


def test_certs_issue_enrolls_new_sites_and_reissue_revokes_the_old_certificate(
    tmp_path: Path, capsys
) -> None:
    # Prepare: a CA with two sites; its key moved "offline"
    certs = tmp_path / "certs"
    init_certificates(certs, clients=2)
    offline = tmp_path / "offline-ca.key"
    (certs / "ca.key").rename(offline)
    before = EnrollmentList.load(certs / "enrolled.json").fingerprints

    # Execute: two new sites, then a re-issue of client-0
    added = main(["certs", "issue", "--out", str(certs), "--id", "site-a", "site-b",
                  "--ca-key", str(offline), "--json"])  # fmt: skip
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    again = main(["certs", "issue", "--out", str(certs), "--id", "site-a",
                  "--ca-key", str(offline)])  # fmt: skip
    again_err = capsys.readouterr().err
    reissued = main(["certs", "issue", "--out", str(certs), "--id", "client-0",
                     "--ca-key", str(offline), "--overwrite"])  # fmt: skip

    # Assert: enrolled and in the re-signed signing registry; the old client-0 pin is gone
    assert added == 0 and printed["issued"] == ["site-a", "site-b"]
    after = EnrollmentList.load(certs / "enrolled.json").fingerprints
    assert sorted(after) == ["client-0", "client-1", "site-a", "site-b"]
    assert sorted(load_signing_registry(certs)) == sorted(after)
    assert again == 2 and "already issued" in again_err  # no silent re-issue
    assert reissued == 0
    assert after["client-1"] == before["client-1"]
    final = EnrollmentList.load(certs / "enrolled.json").fingerprints
    assert final["client-0"] != before["client-0"] and final["client-1"] == before["client-1"]
    assert main(["certs", "issue", "--out", str(certs), "--id", "bad/id",
                 "--ca-key", str(offline)]) == 2  # fmt: skip


def test_report_needs_a_known_format(tmp_path: Path) -> None:
    from fl_secure.report import write_report

    with pytest.raises(ConfigError, match="no report format given"):
        write_report(tmp_path, [])
    with pytest.raises(ConfigError, match="unknown report format docx"):
        write_report(tmp_path, ["docx"])
    assert main(["report", "--run", str(tmp_path), "--format", ","]) == 2
