"""Failed attempts of a round are recorded in metrics.jsonl and listed by the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fl_secure.app.report import load_schema, write_report
from fl_secure.app.report.attempts import failed_attempts, secure_aggregation_section
from fl_secure.runs import RunDir
from tests.fl_secure.app.test_report import TINY

pytestmark = pytest.mark.slow


def test_a_run_whose_round_aborts_lists_each_failed_attempt(tmp_path: Path) -> None:
    import jsonschema

    # Prepare: TINY with a secure-aggregation stage no client can meet, one retry
    config = TINY.replace(
        'scheme = "secagg"\n', 'scheme = "secagg"\nstage_timeout = 0.01\n'
    ).replace("round_timeout = 120\n", "round_timeout = 120\nmax_retries = 1\n")
    assert "stage_timeout = 0.01" in config and "max_retries = 1" in config
    (tmp_path / "tiny.toml").write_text(config)
    env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
    cmd = [
        sys.executable,
        "-m",
        "fl_secure.app.cli",
        "train",
        "--config",
        str(tmp_path / "tiny.toml"),
    ]
    done = subprocess.run(
        [*cmd, "--out", str(tmp_path / "runs")], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    (run,) = sorted((tmp_path / "runs").glob("report-*"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "aborted", done.stdout[-2000:] + done.stderr[-2000:]
    # Assert: metrics.jsonl holds round 0 and both failed attempts of round 1, each with why
    records = RunDir(run).read_metrics()
    failed = [r for r in records if r.get("kind") == "aborted"]
    assert [r["round"] for r in records if "kind" not in r] == [0]
    assert [(r["round"], r["attempt"], r["task"]) for r in failed] == [
        (1, 0, "train"),
        (1, 1, "train"),
    ]
    assert all(r["reason"].startswith("secure aggregation aborted") for r in failed)
    assert all(r["secure_aggregation"]["aborted"] == r["reason"] for r in failed)
    assert summary["reason"].startswith("round 1 aborted after 2 attempts: secure aggregation")
    # Execute: the report
    written = write_report(run, ["json", "md", "html"], out=tmp_path / "report")
    report = json.loads(written["json"].read_text())
    jsonschema.validate(report, load_schema())
    # Assert: the report lists both attempts, retried and then the round aborted
    attempts = report["run"]["failed_attempts"]
    assert [(a["round"], a["attempt"], a["outcome"]) for a in attempts] == [
        (1, 0, "retried"),
        (1, 1, "round aborted"),
    ]
    assert [a["reason"] for a in attempts] == [r["reason"] for r in failed]
    assert report["secure_aggregation"]["aborted_rounds"] == [1]
    assert [(r["round"], r["attempt"]) for r in report["secure_aggregation"]["rounds"]] == [
        (1, 0),
        (1, 1),
    ]
    md = written["md"].read_text()
    assert "aborted rounds: none" not in md and "aborted rounds: \\[1\\]." in md
    assert "### Failed attempts" in md
    # (which stage missed the 0.01 s deadline, and so the reason's wording, depends on load)
    assert f"| 1 | 1 | train | round aborted | {failed[1]['reason']} |" in md
    assert "<h3>Failed attempts</h3>" in written["html"].read_text()
    # the round-0 figures are still the summary's: the failed attempts are not rounds
    assert summary["untrained"] == records[0]["held_out"]


def test_a_retried_round_that_then_completes_keeps_its_failed_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.server.test_secagg_grpc import _run, first_setup_fails

    # Prepare: the first attempt's secure-aggregation setup fails; the retry succeeds
    calls = first_setup_fails(monkeypatch)
    # Execute
    coord = _run(tmp_path, [0.5, -0.25, 1.0], failing=set(), max_retries=1)
    # Assert: the failed attempt is a record of its own, before the round it was retried in
    assert coord.status == "completed", coord.stop_reason
    assert calls[:2] == [0, 1]  # the server's attempt 0 setup failed, attempt 1's was made
    records = RunDir(tmp_path / "run").read_metrics()
    assert [(r.get("kind"), r["round"], r.get("attempt")) for r in records] == [
        (None, 0, None),
        ("aborted", 1, 0),
        (None, 1, 1),
    ]
    reason = records[1]["reason"]
    assert reason.startswith("round 1: secure aggregation cannot start: threshold = 3 exceeds")
    assert records[-1]["secure_aggregation"]["survivors"] == ["client-0", "client-1", "client-2"]
    completed = [r for r in records if "kind" not in r]
    failed = [r for r in records if r.get("kind") == "aborted"]
    assert failed_attempts(completed, failed) == [
        {"round": 1, "attempt": 0, "task": "train", "reason": reason, "outcome": "retried",
         "failed": {}}
    ]  # fmt: skip
    sa = secure_aggregation_section({"secure_aggregation": {"scheme": "secagg"}}, completed, failed)
    assert sa["aborted_rounds"] == [1]
    assert [(r["round"], r["attempt"], r["aborted"]) for r in sa["rounds"]] == [(1, 1, "")]


def test_a_resume_keeps_the_failed_attempts_of_the_rounds_it_drops(tmp_path: Path) -> None:
    # Prepare: rounds 0-1 completed, a failed attempt of round 2, then round 2's metrics
    # written just before a crash (not checkpointed)
    run = RunDir(tmp_path)
    failed = {"kind": "aborted", "round": 2, "attempt": 0, "task": "train", "reason": "why"}
    for record in ({"round": 0}, {"round": 1}, failed, {"round": 2}):
        run.append_metrics(record)
    # Execute: resume after round 1
    dropped = run.truncate_metrics_after(1)
    # Assert: round 2's unfinished metrics go, its failed attempt (it happened) stays
    assert dropped == 1
    assert run.read_metrics() == [{"round": 0}, {"round": 1}, failed]
