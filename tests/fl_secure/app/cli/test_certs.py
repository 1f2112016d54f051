"""`fl-secure certs issue` and `fl-secure report --format`: the CLI over tested library calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fl_secure.app.cli import main
from fl_secure.errors import ConfigError, TlsError
from fl_secure.tls import init_certificates, issue_client_certificate
from fl_secure.tls.enrollment import EnrollmentList
from fl_secure.tls.identity import load_signing_registry


def test_certs_issue_enrolls_new_sites_and_reissue_revokes_the_old_certificate(
    tmp_path: Path, capsys
) -> None:
    # Prepare: a CA with two sites; its key moved "offline"
    certs = tmp_path / "certs"
    init_certificates(certs, clients=2)
    offline = tmp_path / "offline-ca.key"
    (certs / "ca" / "ca.key").rename(offline)
    before = EnrollmentList.load(certs / "server" / "enrolled.json").fingerprints

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
    after = EnrollmentList.load(certs / "server" / "enrolled.json").fingerprints
    assert sorted(after) == ["client-0", "client-1", "site-a", "site-b"]
    assert sorted(load_signing_registry(certs / "server")) == sorted(after)
    assert again == 2 and "already issued" in again_err  # no silent re-issue
    assert reissued == 0
    assert after["client-1"] == before["client-1"]
    final = EnrollmentList.load(certs / "server" / "enrolled.json").fingerprints
    assert final["client-0"] != before["client-0"] and final["client-1"] == before["client-1"]
    assert main(["certs", "issue", "--out", str(certs), "--id", "bad/id",
                 "--ca-key", str(offline)]) == 2  # fmt: skip


@pytest.mark.parametrize("days", ["99999999", "0", "36501", "ten"])
def test_certs_days_out_of_range_is_a_usage_error(tmp_path: Path, capsys, days: str) -> None:
    init_certificates(tmp_path / "certs", clients=1)
    for command in (["init", "--clients", "1"], ["issue", "--id", "late"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["certs", *command, "--out", str(tmp_path / "certs"), "--days", days])
        assert exit_info.value.code == 2
        assert "--days must be an integer from 1 to 36500" in capsys.readouterr().err
    # the library refuses it too, with the range instead of an OverflowError
    with pytest.raises(TlsError, match="days must be from 1 to 36500"):
        issue_client_certificate(tmp_path / "certs", "late", days=99_999_999)
    with pytest.raises(TlsError, match="days must be from 1 to 36500"):
        init_certificates(tmp_path / "new", clients=1, days=99_999_999)


def test_report_needs_a_known_format(tmp_path: Path) -> None:
    from fl_secure.app.report import write_report

    with pytest.raises(ConfigError, match="no report format given"):
        write_report(tmp_path, [])
    with pytest.raises(ConfigError, match="unknown report format docx"):
        write_report(tmp_path, ["docx"])
    assert main(["report", "--run", str(tmp_path), "--format", ","]) == 2
