"""Compliance reports of a real run (DP + secure aggregation + audit), in a real browser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from audits.run_audit import findings
from fl_secure.app.cli import main
from fl_secure.app.report import load_schema, write, write_report
from fl_secure.app.report.audit_rows import audit_rows, audit_summary_row, grid_captions
from fl_secure.app.report.build import _privacy, build_report
from fl_secure.app.report.formatting import fmt_bound, fmt_lower, fmt_measure
from fl_secure.app.report.ledger import _epsilon_by_round, ledger_section
from fl_secure.app.report.pdf import CHROMIUM_FLAGS, find_chromium, print_pdf
from fl_secure.app.report.plain_summary import plain_summary
from fl_secure.app.report.render_markdown import md_text
from fl_secure.app.report.report_warnings import report_warnings
from fl_secure.app.report.rows import site_rows
from fl_secure.checkpoints import CheckpointStore
from fl_secure.config import config_from_dict
from fl_secure.data.manifest import SYNTHETIC_KIND, data_manifest
from fl_secure.errors import CheckpointError, FlSecureError
from fl_secure.runs import RunDir
from privacy.ledger.entries import Entry
from privacy.ledger.run_ledger import Ledger
from privacy.ledger.signed_head import HeadSigner
from server.run_files import _first_data_manifest

pytestmark = pytest.mark.slow

TINY = """
[run]
name = "report"
seed = 5
[data]
source = "synthetic"
image_size = 32
num_identities = 24
images_per_identity = 6
held_out_identities = 6
[partition]
num_clients = 3
[model]
backbone = "cnn-small"
embedding_size = 64
[algorithm]
name = "fedpe"
[train]
rounds = 3
local_steps = 2
batch_size = 16
lr = 0.05
[server]
min_clients = 3
round_timeout = 120
[privacy]
unit = "client"
noise_placement = "distributed"
noise_multiplier = 1.5
[secure_aggregation]
scheme = "secagg"
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    config = tmp / "tiny.toml"
    config.write_text(TINY)
    env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
    cmd = [sys.executable, "-m", "fl_secure.app.cli", "train", "--config", str(config)]
    done = subprocess.run(
        [*cmd, "--out", str(tmp / "runs")], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = sorted((tmp / "runs").glob("report-*"))
    audit = [sys.executable, "-m", "fl_secure.app.cli", "audit", "--run", str(run), "--quiet"]
    done = subprocess.run(
        [*audit, "--targets", "3", "--steps", "20"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run


def _numbers(node: object, skip: tuple[str, ...] = ()) -> list[float]:
    """Every numeric leaf (not bool) of a JSON tree, leaving out keys in ``skip``."""
    if isinstance(node, bool) or node is None or isinstance(node, str):
        return []
    if isinstance(node, int | float):
        return [float(node)]
    if isinstance(node, dict):
        return [x for k, v in node.items() if k not in skip for x in _numbers(v, skip)]
    if isinstance(node, list):
        return [x for v in node for x in _numbers(v, skip)]
    raise TypeError(type(node))


def test_report_json_validates_and_regenerates_identically(run_dir: Path, tmp_path: Path) -> None:
    import jsonschema

    written = write_report(run_dir, ["json", "md", "html"], out=tmp_path / "a")
    again = write_report(run_dir, ["json"], out=tmp_path / "b")
    report = json.loads(written["json"].read_text())
    jsonschema.validate(report, load_schema())
    assert written["json"].read_bytes() == again["json"].read_bytes()
    # Markdown carries what the HTML does: per-client scores, every audit number, captions
    import html as html_module

    md, page = written["md"].read_text(), written["html"].read_text()
    for section in ("### Per-client scores", "### Every audit number"):
        assert section in md
    # the run's facts, in both: clients, rounds, transport
    summary = json.loads((run_dir / "summary.json").read_text())
    for row in (
        f"| Clients (enrolled) | {summary['num_clients']} |",
        f"| Rounds completed | {summary['rounds_completed']} |",
        f"| Transport | {summary['transport']} |",
    ):
        assert row in md
    assert f"<td>Rounds planned</td><td>{summary['rounds_planned']}</td>" in page
    audit = json.loads((run_dir / "audit" / "results.json").read_text())
    captions = grid_captions(audit)
    assert captions and set(captions) == {p.name for p in (run_dir / "audit").glob("*.png")}
    for name, caption in captions.items():
        assert caption.startswith("Model inversion from the view of ") and "top-1" in caption
        assert f"*{caption}*" in md and f"({name})" in md
        assert f"<figcaption>{html_module.escape(caption)}" in page
    # a report that breaks the schema is caught by it
    broken = {**report, "privacy": {**report["privacy"], "epsilon": "eight"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, load_schema())


def test_every_number_traces_to_the_run_records(run_dir: Path) -> None:
    report = build_report(run_dir)
    sources: set[float] = set()
    sources.update(_numbers(json.loads((run_dir / "summary.json").read_text())))
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        sources.update(_numbers(json.loads(line)))
    sources.update(_numbers(json.loads((run_dir / "audit" / "results.json").read_text())))
    with Ledger.read(run_dir / "ledger.sqlite") as ledger:
        for entry in ledger.entries():
            sources.update(_numbers(entry.payload))
            sources.add(float(entry.round))
    # provenance holds hashes and versions (strings); everything else must come from a record
    # (the sites' figures are computed from their ledgers: see the test after this one)
    numbers = _numbers(report, skip=("provenance", "sites"))
    assert numbers, "the report has no numbers"
    stray = sorted({x for x in numbers if x not in sources})
    assert stray == [], f"numbers in the report found in no run record: {stray[:10]}"
    # and the headline figures are the summary's, exactly
    summary = json.loads((run_dir / "summary.json").read_text())
    assert report["privacy"]["epsilon"] == summary["epsilon"]
    assert report["privacy"]["delta"] == summary["delta"]
    # the mechanism's parameters are the run's, each from its own field (TINY: z 1.5, C 1)
    p, sp = report["privacy"], summary["privacy"]
    assert p["noise_multiplier"] == sp["noise_multiplier"] == 1.5
    assert p["clip_norm"] == sp["clip_norm"] == 1.0
    assert p["sample_rate"] == sp["client_sample_rate"] == 1.0  # every client every round
    assert p["rounds_accounted"] == sp["rounds_accounted"] == 3
    assert p["noise_placement"] == "distributed"
    assert report["utility"]["final"]["tar_at_far_1e-2"] == summary["tar_at_far_1e-2"]
    assert report["ledger"]["verified"] is True
    assert [r["round"] for r in report["ledger"]["epsilon_by_round"]] == [1, 2, 3]
    assert report["secure_aggregation"]["scheme"] == "secagg"
    assert [len(r["survivors"]) for r in report["secure_aggregation"]["rounds"]] == [3, 3, 3]
    # the guarantee against a server that deviates from the protocol is stated, with c
    against = report["secure_aggregation"]["malicious_server"]
    assert "no one client's masked input can be unmasked" in against
    assert "consistency check" in against
    partition = json.loads((run_dir / "partition.json").read_text())  # sampled once, kept
    assert [len(c["identities"]) for c in partition["clients"].values()] == [6, 6, 6]
    assert report["threat_model"]["audited"] is True
    assert report["threat_model"]["audit"] == json.loads(
        (run_dir / "audit" / "results.json").read_text()
    )


def test_each_sites_own_epsilon_is_the_reference_accountants(run_dir: Path) -> None:
    import math

    from scipy.optimize import minimize_scalar

    # Prepare: TINY: 3 rounds, every client each round, distributed noise z = 1.5 over the
    # t = 3 shares; each client kept its site ledger in clients/<id>/. Integer noise is
    # accounted by its zCDP bound: rho = releases / (2 z^2), converted by Canonne, Kamath &
    # Steinke 2020, Proposition 12 (minimised here over a continuous order)
    def zcdp(z: float, releases: int) -> float:
        rho = releases / (2 * z * z)

        def eps(log_a1: float) -> float:
            a = 1.0 + math.exp(log_a1)
            tail = math.log(1e5) + (a - 1) * math.log(1 - 1 / a) - math.log(a)
            return a * rho + tail / (a - 1)

        return float(minimize_scalar(eps, bounds=(-8.0, 16.0), method="bounded").fun)

    # Execute
    sites = build_report(run_dir)["sites"]
    # Assert: three sites, three releases each; against the server: z = 1.5 per release;
    # with colluding peers only the site's own share, z / sqrt(3)
    assert [s["client"] for s in sites["sites"]] == ["client-0", "client-1", "client-2"]
    for site in sites["sites"]:
        assert site["releases"] == 3 and site["problem"] is None
        assert site["epsilon"] == pytest.approx(zcdp(1.5, 3), abs=2e-4)
        assert site["epsilon_colluding_peers"] == pytest.approx(zcdp(1.5 / 3**0.5, 3), abs=2e-4)
        # one image moves a clipped update by up to 2 C: three discrete Gaussians of z / 2
        assert site["example_epsilon"] == pytest.approx(zcdp(1.5 / 2, 3), abs=2e-4)
        assert site["example_epsilon_colluding_peers"] == pytest.approx(
            zcdp(1.5 / 3**0.5 / 2, 3), abs=2e-4
        )
    # the run's own epsilon (the same three releases of z = 1.5, zCDP) agrees
    summary = json.loads((run_dir / "summary.json").read_text())
    assert sites["sites"][0]["epsilon"] == pytest.approx(summary["epsilon"], abs=2e-4)
    assert sites["delta"] == summary["delta"] == 1e-5


def test_audit_findings_are_report_warnings(run_dir: Path, tmp_path: Path) -> None:
    import shutil

    report = build_report(run_dir)
    codes = [w["code"] for w in report["warnings"]]
    audit = report["threat_model"]["audit"]
    # results.json states the findings the audit printed: the ones its numbers give
    assert audit["findings"] == findings(audit)
    assert [c for c in codes if c.startswith("audit-")] == [f["code"] for f in findings(audit)]
    # an empirical epsilon above the accountant's puts the guarantee in doubt, up front; the
    # edit leaves the stated findings behind the numbers, which the report names too
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("report"))
    audit = json.loads((copy / "audit" / "results.json").read_text())
    audit["attacks"]["canary"]["exceeds_accountant"] = True
    audit["attacks"]["canary"]["can_test_accountant"] = True  # (it could not: 1000 trials)
    (copy / "audit" / "results.json").write_text(json.dumps(audit))
    warned = {w["code"]: w["message"] for w in build_report(copy)["warnings"]}
    assert "cannot be relied on" in warned["audit-exceeds-accountant"]
    stated = [f["code"] for f in audit["findings"]]
    assert "audit-exceeds-accountant" not in stated
    given = [c for c in stated if c != "audit-cannot-test-accountant"]
    given.append("audit-exceeds-accountant")
    assert warned["audit-findings-differ"].startswith(
        f"audit/results.json states findings that its own numbers do not give (the file was "
        f"edited, or written by another version of fl-secure): it states {stated}, its numbers "
        f"give {given}"
    )
    # results written before findings were stored: nothing to compare
    del audit["findings"]
    (copy / "audit" / "results.json").write_text(json.dumps(audit))
    assert "audit-findings-differ" not in {w["code"] for w in build_report(copy)["warnings"]}
    # a damaged findings list is named
    audit["findings"] = [{"code": 3}]
    (copy / "audit" / "results.json").write_text(json.dumps(audit))
    with pytest.raises(FlSecureError, match="findings is not a list of"):
        build_report(copy)


def test_tampered_ledger_is_reported_up_front(run_dir: Path, tmp_path: Path) -> None:
    import shutil
    import sqlite3

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("report"))
    with sqlite3.connect(copy / "ledger.sqlite") as db:
        db.execute("UPDATE entries SET payload = replace(payload, '\"updates\"', '\"upd\"') "
                   "WHERE seq = 2")  # fmt: skip
    report = build_report(copy)
    assert report["ledger"]["verified"] is False
    assert "ledger-tampered" in [w["code"] for w in report["warnings"]]


def test_the_ledger_names_the_released_model_file_and_a_swapped_file_is_caught(
    run_dir: Path, tmp_path: Path, capsys
) -> None:
    import hashlib
    import shutil

    # Prepare: a copy of a finished DP run (3 rounds); its last parameters file
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("report"))
    final = copy / "checkpoints" / "round-000003.safetensors"
    digest = hashlib.sha256(final.read_bytes()).hexdigest()  # what `sha256sum` prints
    with Ledger.read(copy / "ledger.sqlite") as ledger:
        named = {
            e.round: e.payload.get("model_sha256")
            for e in ledger.entries()
            if e.kind == "client_level"
        }
    # Assert: every round's row names its own file's SHA-256; the report and --verify agree
    assert named[3] == digest and len(set(named.values())) == 3, named
    model = build_report(copy)["model"]
    assert model["checkpoint"] == "checkpoints/round-000003.safetensors" and model["round"] == 3
    assert model["sha256"] == model["ledger_sha256"] == digest and model["matches_ledger"]
    verify = ["privacy", "ledger", "--run", str(copy), "--verify"]
    assert main(verify) == 0
    assert f"released model: checkpoints/round-000003.safetensors, SHA-256 {digest}" in (
        capsys.readouterr().out
    )
    # Execute: the final file is replaced by round 2's parameters (a valid model, not the
    # one the run released)
    store = CheckpointStore(copy / "checkpoints")
    final.write_bytes(store.encode(3, store.load(2).parameters))
    # Assert: the report warns and names both digests; --verify fails
    report = build_report(copy)
    swapped = hashlib.sha256(final.read_bytes()).hexdigest()
    assert report["model"]["matches_ledger"] is False and report["model"]["sha256"] == swapped
    (warning,) = [w for w in report["warnings"] if w["code"] == "model-not-the-released-one"]
    assert f"SHA-256 {swapped[:16]}" in warning["message"] and digest[:16] in warning["message"]
    assert main([*verify, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["verify"]["released_model"]["problem"] == warning["message"].rstrip(".")


def test_report_checks_the_ledger_against_what_the_run_recorded(
    run_dir: Path, tmp_path: Path
) -> None:
    import shutil
    import sqlite3

    def copy(name: str) -> Path:
        out = tmp_path / name
        shutil.copytree(run_dir, out, ignore=shutil.ignore_patterns("report"))
        return out

    def codes(report: dict[str, Any]) -> list[str]:
        return [w["code"] for w in report["warnings"]]

    report = build_report(run_dir)
    assert report["ledger"]["checked_against_summary"] is True
    assert report["privacy"]["epsilon_source"] == "ledger.sqlite"
    assert report["ledger"]["epsilon"] == report["ledger"]["epsilon_by_round"][-1]["epsilon"]
    # distributed noise: the clients' integer sampler, not the server's generator, is named
    p = report["privacy"]
    assert p["noise_distribution"] == "discrete_gaussian"
    assert p["noise_generator"].startswith("each client: discrete Gaussian")
    assert p["effective_noise_multiplier"] >= p["noise_multiplier"]  # sqrt(m / t) z, m >= t
    # t of the noise shares (server.min_clients), named apart from the SecAgg threshold
    assert p["noise_shares_required"] == 3
    md = write_report(run_dir, ["md"], out=tmp_path / "md-report")["md"].read_text()
    assert "t = server.min_clients, not the secure-aggregation threshold" in md
    assert "SecAgg threshold (shares to unmask)" in md
    # the Markdown carries the secure-aggregation figures the HTML does
    assert "| SecAgg threshold (shares to unmask) | dropped | aborted |" in md
    assert "; parameters: " in md
    # the newest rows dropped: a valid chain on its own, but shorter than the run recorded
    short = copy("short")
    with sqlite3.connect(short / "ledger.sqlite") as db:
        db.execute("DELETE FROM entries WHERE seq > 1")
    report = build_report(short)
    assert report["ledger"]["verified"] is False and "ledger-tampered" in codes(report)
    assert "entries dropped from the end" in report["ledger"]["problems"][0]
    # summary.json edited to a smaller epsilon: the report states the ledger's, and says so
    edited = copy("edited")
    summary = json.loads((edited / "summary.json").read_text())
    kept = summary["epsilon"]
    summary["epsilon"] = 0.5
    (edited / "summary.json").write_text(json.dumps(summary))
    report = build_report(edited)
    assert report["privacy"]["epsilon"] == kept and report["privacy"]["epsilon_in_summary"] == 0.5
    assert "ledger-summary-mismatch" in codes(report)
    assert "ledger-summary-mismatch" not in codes(build_report(run_dir))
    # the ledger deleted: not presented as a run that spent no budget
    gone = copy("gone")
    (gone / "ledger.sqlite").unlink()
    report = build_report(gone)
    assert report["ledger"]["recorded_entries"] == summary["privacy"]["ledger_entries"] > 0
    assert "ledger-missing" in codes(report)
    written = write_report(gone, ["md"], out=tmp_path / "gone-report")
    assert "ledger.sqlite is MISSING" in written["md"].read_text()
    # ... nor when summary.json predates the recorded ledger head but states epsilon spent
    _edit_json(gone / "summary.json", lambda s: s["privacy"].pop("ledger_entries", None))
    _edit_json(gone / "summary.json", lambda s: s["privacy"].pop("ledger_head", None))
    report = build_report(gone)
    assert report["ledger"]["summary_states_spending"] is True and "ledger-missing" in codes(report)
    written = write_report(gone, ["md"], out=tmp_path / "gone-report-2")
    assert "no privacy budget" not in written["md"].read_text()
    # delta edited in summary.json: the statement is the ledger's pair, and the edit is named
    other = copy("delta")
    _edit_json(other / "summary.json", lambda s: s.update(delta=1e-9))
    report = build_report(other)
    assert report["privacy"]["delta"] == report["ledger"]["delta"] == 1e-5
    assert report["privacy"]["delta_in_summary"] == 1e-9
    assert any("states delta = 1e-09" in w["message"] for w in report["warnings"])


def test_site_figures_say_unbounded_damaged_and_released_more(
    run_dir: Path, tmp_path: Path
) -> None:
    # Prepare: client-0's ledger gains a release without noise against the server (central
    # placement); client-1's ledger is truncated; client-2's gains one release more
    copy = _copy_run(run_dir, tmp_path / "run")
    sites = copy / "clients"

    def add_release(site: str, noise: float, placement: str) -> None:
        def change(ledger: dict[str, Any]) -> None:
            extra = dict(ledger["releases"][-1])
            extra.update(round=extra["round"] + 10, placement=placement)
            extra.update(noise_multiplier=noise, own_noise_multiplier=noise / 3**0.5)
            ledger["releases"].append(extra)

        _edit_json(sites / site / "site_ledger.json", change)

    add_release("client-0", 0.0, "central")
    text = (sites / "client-1" / "site_ledger.json").read_text()
    (sites / "client-1" / "site_ledger.json").write_text(text[: len(text) // 2])
    add_release("client-2", 1.5, "distributed")
    # Execute
    report = build_report(copy)
    # Assert: client-0's figures are unbounded, named so, not "missing"
    rows = {r["client"]: r for r in report["sites"]["sites"]}
    assert rows["client-0"]["epsilon"] is None
    assert "epsilon" in rows["client-0"]["unbounded"]
    assert rows["client-2"]["unbounded"] == [] and rows["client-2"]["releases"] == 4
    _, table = site_rows(report["sites"])
    assert table[0][2] == "∞ (unbounded)" and table[2][2] != "∞ (unbounded)"
    warned = {w["code"]: w["message"] for w in report["warnings"]}
    assert "client-1" in warned["site-ledger-unreadable"]
    assert "non-finite-figures" not in warned  # the unbounded figures are stated as such
    # client-2 released in a round the run's ledger does not account (13) with no failed
    # attempt on record; client-0's extra release was under central noise (the server is
    # trusted with it), so only client-2 is named
    assert "{'client-2': [13]} (site: rounds)" in warned["sites-released-more"]
    assert "sites-released-more" not in {w["code"] for w in build_report(run_dir)["warnings"]}
    # a retried round (a failed attempt on record) explains a second release of that round
    _edit_json(sites / "client-2" / "site_ledger.json", lambda d: d["releases"][-1].update(round=2))
    assert "sites-released-more" in {w["code"] for w in build_report(copy)["warnings"]}
    with (copy / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"kind": "aborted", "round": 2, "attempt": 0, "task": "train",
                                  "reason": "2 of 3 needed updates arrived"}) + "\n")  # fmt: skip
    assert "sites-released-more" not in {w["code"] for w in build_report(copy)["warnings"]}


def test_audit_bounds_round_toward_the_safe_side() -> None:
    row = audit_summary_row({"epsilon_lower_bound": 1.44475, "accountant_epsilon": 4.089234})
    assert row[-2] == "1.444" and row[-1] == "4.09"  # (nearest: 1.445 and 4.089)
    assert fmt_lower(2.0) == "2" and fmt_lower(0.0012345) == "0.001234"
    assert fmt_measure("epsilon_lower_bound", 3.33339) == "3.333"
    assert fmt_measure("accountant_epsilon", 3.33331) == "3.334"
    assert fmt_measure("top1", 0.33336) == "0.3334"


def test_damaged_run_records_are_named(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("report"))
    # rounds missing from metrics.jsonl: a warning, not a silently shorter report
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:-1]))
    codes = [w["code"] for w in build_report(run)["warnings"]]
    assert "metrics-incomplete" in codes
    assert "metrics-incomplete" not in [w["code"] for w in build_report(run_dir)["warnings"]]
    (run / "metrics.jsonl").write_text("".join(lines))
    summary = (run / "summary.json").read_text()
    (run / "summary.json").write_text("[]")
    with pytest.raises(CheckpointError, match="summary.json is damaged"):
        build_report(run)
    # fields of the wrong type are named; a missing one is n/a (delta: the ledger's)
    for key, value, expected in (
        ("clients", [1, 2], "clients is list"),
        ("delta", "1e-5", "delta is str"),
        ("rounds_completed", 2.5, "rounds_completed is float"),
        ("privacy", True, "privacy is bool"),
    ):
        (run / "summary.json").write_text(json.dumps({**json.loads(summary), key: value}))
        with pytest.raises(CheckpointError, match=f"summary.json: {expected} .*, expected"):
            build_report(run)
    no_delta = json.loads(summary)
    del no_delta["delta"]
    (run / "summary.json").write_text(json.dumps(no_delta))
    (run / "ledger.sqlite").rename(run / "ledger.kept")
    assert "delta = not recorded" in build_report(run)["plain_summary"][0]
    (run / "ledger.kept").rename(run / "ledger.sqlite")
    (run / "summary.json").write_text(summary)
    (run / "audit" / "results.json").write_text("[1]")
    with pytest.raises(CheckpointError, match="results.json is damaged"):
        build_report(run)
    (run / "config.toml").write_text("[run\nname=")
    with pytest.raises(CheckpointError, match="config.toml is not valid TOML"):
        build_report(run)
    (tmp_path / "a-file").write_text("")  # --out that is a file: named, no traceback
    assert main(["report", "--run", str(run_dir), "--out", str(tmp_path / "a-file")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fl-secure: error: File exists") and "a-file" in err


def test_edited_audit_results_are_named_field_by_field(run_dir: Path, tmp_path: Path) -> None:
    import copy
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("report"))
    path = run / "audit" / "results.json"
    kept = json.loads(path.read_text())
    view = kept["attacks"]["inversion"]["server"]
    best = view["best"]

    def edited(change) -> str:  # the report's error for results.json edited by ``change``
        results = copy.deepcopy(kept)
        change(results)
        path.write_text(json.dumps(results))
        with pytest.raises(CheckpointError) as caught:
            build_report(run)
        return str(caught.value)

    inversion = "attacks.inversion.server"
    message = edited(lambda r: r["attacks"]["inversion"]["server"][best].pop("chance_top1"))
    assert message.endswith(f"{inversion}.{best}.chance_top1 is missing (expected a number)")
    message = edited(lambda r: r["attacks"]["inversion"]["server"][best].update(top1_ci95="x"))
    assert message.endswith(f"{best}.top1_ci95 is 'x', not a [low, high] interval")
    message = edited(lambda r: r["attacks"]["inversion"]["server"].pop("best"))
    no_best = "best is missing (expected the name of the best direction)"
    assert message.endswith(f"{inversion}.{no_best}")
    message = edited(lambda r: r["attacks"]["canary"].update(exceeds_accountant=True,
                                                             accountant_epsilon=None))  # fmt: skip
    assert message.endswith("attacks.canary.accountant_epsilon is None, not a number")
    message = edited(lambda r: r.update(attacks=[]))
    assert message == f"{path} is damaged: attacks is missing or not an object"
    # a grid name is a file the report embeds: nothing outside the audit folder
    message = edited(lambda r: r["attacks"]["inversion"]["server"][best].update(
        grid="../../certs/ca.key"))  # fmt: skip
    assert message.endswith(f"{inversion}.{best}.grid is '../../certs/ca.key', not a PNG file name")
    path.write_text(json.dumps(kept))
    assert build_report(run)["threat_model"]["audit"] == kept  # untouched: read as before


def test_report_embeds_only_the_grids_the_audit_results_name(run_dir: Path, tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("report"))
    named = sorted(grid_captions(json.loads((run / "audit" / "results.json").read_text())))
    assert named and all((run / "audit" / name).is_file() for name in named)
    stray = (run / "audit" / named[0]).read_bytes()
    (run / "audit" / "inversion-of-another-audit.png").write_bytes(stray)
    write_report(run, ["md"], out=tmp_path / "out")
    written = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert written == named  # the stray PNG stays out of the report


def test_audit_table_puts_chance_beside_the_measures_it_belongs_to() -> None:
    audit = {
        "attacks": {
            "inversion": {"server": {"head_row": {
                "top1": 0.5, "top5": 0.9, "seconds": 3.0, "psnr_db": 11.0,
                "chance": 0.1, "chance_top1": 0.1, "chance_top5": 0.5,
            }, "surrogate_random": {
                "top1": 0.1, "chance_top1": 0.1, "knn_distance": 1.2, "chance_knn_distance": 1.3,
                "ssim": 0.05, "chance_ssim": 0.07, "psnr_db": 9.0, "chance_psnr_db": 9.5,
            }}},
            "leakage": {"server": {"secure_sum": {
                "participant_precision": 0.7, "by_attack": {"span": 0.7, "row_ratios": 0.6},
                "exact_inputs": 0.75, "rank": 10, "chance": 0.25,
            }}},
        }
    }  # fmt: skip
    rows = {(r[0].split("/")[-1], r[1]): (r[2], r[3]) for r in audit_rows(audit)}
    assert rows[("head_row", "top1")][1] == "0.1" and rows[("head_row", "top5")][1] == "0.5"
    assert rows[("head_row", "seconds")][1] == rows[("head_row", "psnr_db")][1] == ""
    assert ("head_row", "chance_top5") not in rows  # the levels are a column, not rows
    assert rows[("surrogate_random", "knn_distance")] == ("1.2", "1.3")
    assert rows[("surrogate_random", "ssim")] == ("0.05", "0.07")
    assert rows[("surrogate_random", "psnr_db")] == ("9", "9.5")
    assert rows[("by_attack", "span")][1] == rows[("by_attack", "row_ratios")][1] == "0.25"
    assert rows[("secure_sum", "participant_precision")][1] == "0.25"
    assert rows[("secure_sum", "rank")][1] == ""


def test_secure_aggregation_without_dp_is_not_presented_as_hiding_the_cohort(
    run_dir: Path,
) -> None:
    report = build_report(run_dir)  # SecAgg with client-level DP: no such warning
    codes = [w["code"] for w in report["warnings"]]
    assert "secure-sum-without-dp" not in codes and "dp-off" not in codes
    report["privacy"]["differential_privacy"] = False
    codes = [w["code"] for w in report_warnings(report, {})]
    assert "dp-off" in codes and "secure-sum-without-dp" in codes
    report["secure_aggregation"]["scheme"] = "none"  # then the sum is not the server's view
    codes = [w["code"] for w in report_warnings(report, {})]
    assert "no-secure-aggregation" in codes and "secure-sum-without-dp" not in codes


def test_a_round_released_by_a_later_attempt_is_warned_of_under_sampling(
    run_dir: Path,
) -> None:
    report = build_report(run_dir)  # every client in every round: no amplification claimed
    metrics = [{"round": 1, "attempt": 0}, {"round": 2, "attempt": 1}, {"round": 3}]
    assert report["privacy"]["sample_rate"] == 1.0
    assert "cohort-redrawn" not in [w["code"] for w in report_warnings(report, {}, metrics)]
    report["privacy"].update(sample_rate=0.5, sampling="fixed_size")
    warned = {w["code"]: w["message"] for w in report_warnings(report, {}, metrics)}
    assert warned["cohort-redrawn"].startswith("Rounds [2] were released by a later attempt")
    assert "(fixed_size at rate 0.5)" in warned["cohort-redrawn"]
    retried_none = [{"round": r, "attempt": 0} for r in (1, 2, 3)]
    assert "cohort-redrawn" not in [w["code"] for w in report_warnings(report, {}, retried_none)]


def test_html_report_renders_in_headless_chromium(run_dir: Path, tmp_path: Path) -> None:
    chromium = _chromium_or_skip()
    from playwright.sync_api import sync_playwright

    html = write_report(run_dir, ["html"], out=tmp_path)["html"]
    summary = json.loads((run_dir / "summary.json").read_text())
    requests: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=list(CHROMIUM_FLAGS[1:]))
        page = browser.new_page(viewport={"width": 1100, "height": 1400})
        page.on("request", lambda r: requests.append(r.url))
        page.goto(html.as_uri(), wait_until="load")
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        images = page.eval_on_selector_all(
            "img", "els => els.map(i => [i.alt, i.complete, i.naturalWidth])"
        )
        values = {
            k: json.loads(page.get_attribute(f"#{k}", "data-value") or "null")
            for k in ("epsilon", "delta", "tar")
        }
        shown = {k: page.inner_text(f"#{k}") for k in ("epsilon", "delta", "tar")}
        browser.close()
    # every image (the epsilon and utility plots at least) loaded and has pixels
    assert len(images) >= 2 and all(done and width > 0 for _, done, width in images), images
    # nothing but the file itself was requested (plots are data: URLs)
    assert [u for u in requests if not u.startswith(("file:", "data:"))] == []
    # the page states the summary's epsilon, delta and TAR@FAR, exactly and as displayed
    assert values == {
        "epsilon": summary["epsilon"],
        "delta": summary["delta"],
        "tar": summary["tar_at_far_1e-2"],
    }
    assert shown["epsilon"] == f"{summary['epsilon']:.4g}"
    assert (tmp_path / "report.png").stat().st_size > 10_000


def _chromium_or_skip() -> str:
    chromium = find_chromium()
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("Chromium is missing: .ci/run installs Debian's chromium")
        pytest.skip("Chromium not installed (apt-get install chromium)")
    return chromium


def test_pdf_report_is_private_and_replaces_the_old_one_only_when_printed(
    run_dir: Path, tmp_path: Path
) -> None:
    _chromium_or_skip()
    out = tmp_path / "report"
    pdf = write_report(run_dir, ["pdf"], out=out)["pdf"]
    data = pdf.read_bytes()
    assert data.startswith(b"%PDF-") and data.rstrip().endswith(b"%%EOF")
    assert pdf.stat().st_mode & 0o777 == 0o600  # as the report's other files
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []

    # a Chromium that fails, and one that exits 0 but prints nothing
    failing = tmp_path / "failing-chromium"
    failing.write_text("#!/bin/sh\necho 'ERROR: cannot open display' >&2\nexit 3\n")
    silent = tmp_path / "silent-chromium"
    silent.write_text("#!/bin/sh\nexit 0\n")
    for fake in (failing, silent):
        fake.chmod(0o755)
    with pytest.raises(FlSecureError, match=r"exit 3\): ERROR: cannot open display"):
        print_pdf(out / "report.html", pdf, str(failing))
    with pytest.raises(FlSecureError, match="exited without writing a PDF"):
        print_pdf(out / "report.html", pdf, str(silent))
    assert pdf.read_bytes() == data  # the earlier PDF is untouched
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def _copy_run(run_dir: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("report"))
    return dest


def _edit_json(path: Path, change: Any) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_the_report_states_the_data_manifest_the_run_recorded_at_its_start(
    run_dir: Path, tmp_path: Path
) -> None:
    partition = json.loads((run_dir / "partition.json").read_text())
    recorded = partition["data_manifest"]
    assert recorded["kind"] == SYNTHETIC_KIND and len(recorded["sha256"]) == 64
    assert build_report(run_dir)["provenance"]["data_manifest"] == recorded
    # the report copies the record; it does not hash whatever is there when it is written
    copy = _copy_run(run_dir, tmp_path / "run")
    _edit_json(copy / "partition.json", lambda p: p["data_manifest"].update(sha256="0" * 64))
    assert build_report(copy)["provenance"]["data_manifest"]["sha256"] == "0" * 64
    # a run from before the record: computed now, and said so
    _edit_json(copy / "partition.json", lambda p: p.pop("data_manifest"))
    now = build_report(copy)["provenance"]["data_manifest"]
    assert now["note"].startswith("computed when this report was written")


def test_a_folder_manifest_hashes_the_images_only_and_a_resume_keeps_the_first(
    tmp_path: Path,
) -> None:
    import dataclasses

    faces = tmp_path / "faces"
    for who in ("a", "b"):
        (faces / who).mkdir(parents=True)
        for k in range(2):
            (faces / who / f"{k}.pgm").write_bytes(f"P5 1 1 255 {who}{k}".encode())
    data = {"source": "folders", "path": str(faces)}
    first = data_manifest(data, seed=0)
    assert first["files"] == 4
    (faces / "README").write_text("not an image")
    assert data_manifest(data, seed=0) == first  # other files are not data
    config = config_from_dict({"data": {**data, "min_images_per_identity": 1}})
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    manifest = _first_data_manifest(run, config)
    assert manifest == data_manifest(dataclasses.asdict(config.data), seed=0)
    (run.path / "partition.json").write_text(json.dumps({"data_manifest": manifest}))
    (faces / "b" / "2.pgm").write_bytes(b"P5 1 1 255 new")
    resumed = _first_data_manifest(run, config)
    assert resumed["sha256"] == manifest["sha256"]  # the run started on these
    assert resumed["changed_on_resume"][0]["files"] == 5


def test_the_synthetic_manifest_covers_the_seed_and_celeba_its_annotations(
    tmp_path: Path,
) -> None:
    # the generator draws other faces under another run.seed: another manifest
    table = {"source": "synthetic", "num_identities": 10}
    assert data_manifest(table, seed=0)["sha256"] != data_manifest(table, seed=1)["sha256"]
    # CelebA's labels and attributes come from its annotation files: relabelling changes it
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "000001.jpg").write_bytes(b"\xff\xd8 not decoded here")
    (tmp_path / "id.txt").write_text("000001.jpg 7\n")
    (tmp_path / "attr.txt").write_text("1\nMale\n000001.jpg 1\n")
    celeba = {"source": "celeba", "path": str(tmp_path / "img"),
              "identities_file": str(tmp_path / "id.txt"),
              "attributes_file": str(tmp_path / "attr.txt")}  # fmt: skip
    first = data_manifest(celeba, seed=0)
    (tmp_path / "id.txt").write_text("000001.jpg 8\n")
    relabelled = data_manifest(celeba, seed=0)
    (tmp_path / "attr.txt").write_text("1\nMale\n000001.jpg -1\n")
    flipped = data_manifest(celeba, seed=0)
    assert len({first["sha256"], relabelled["sha256"], flipped["sha256"]}) == 3
    (tmp_path / "attr.txt").unlink()  # unreadable: no hash rather than one of the images alone
    assert data_manifest(celeba, seed=0)["sha256"] is None


def test_an_example_level_statement_counts_images_and_states_z_and_q(run_dir: Path) -> None:
    summary = {
        "privacy_unit": "example", "noise_placement": "local", "num_clients": 3,
        "delta": 0.05, "epsilon": 7.9, "client_train_sizes": [72, 90, 80],
        "privacy": {"adjacency": "add/remove", "clip_norm": 1.0, "target_epsilon": 8.0},
    }  # fmt: skip
    rows = [
        {"client": c, "round": 2, "epsilon": 7.9, "delta": 0.05, "noise_multiplier": 0.35,
         "sample_rate": 0.22, "accountant": "prv"} for c in ("client-0", "client-1", "client-2")
    ]  # fmt: skip
    p = _privacy(summary, {}, {"example_level": rows, "epsilon": 7.9})
    assert p["population"] == 72 and p["population_of"].startswith("training images")
    assert p["delta_below_one_over_population"] is False  # 0.05 > 1/72, though > 1/3 too
    assert (p["noise_multiplier"], p["sample_rate"], p["rounds_accounted"]) == (0.35, 0.22, 2)
    rows[1]["noise_multiplier"] = 0.4  # clients differ: no single z stated
    assert _privacy(summary, {}, {"example_level": rows})["noise_multiplier"] is None
    report = build_report(run_dir)
    report["privacy"] = p
    (warning,) = [w for w in report_warnings(report, {}) if w["code"] == "delta-not-below-1-over-n"]
    assert "N = 72 training images of the smallest client" in warning["message"]
    assert "one image's data" in warning["message"]
    # q = batch_size / N (no privacy.sample_rate) makes N public; a configured q does not
    assert "example-count-public" in [w["code"] for w in report_warnings(report, {})]
    configured = {"privacy": {"sample_rate": 0.05}}
    assert "example-count-public" not in [w["code"] for w in report_warnings(report, configured)]
    # a served run's sites keep their counts (they state 1): no N, and the report says why
    served = {**summary, "client_train_sizes": None,
              "client_reported_examples": {"client-0": 1, "client-1": 1}}  # fmt: skip
    q = _privacy(served, {}, {"example_level": rows})
    assert q["population"] is None and q["delta_below_one_over_population"] is None
    assert q["population_of"].startswith("not released")


def test_the_plain_summary_states_the_adjacency_and_rounds_bounds_up(run_dir: Path) -> None:
    report = build_report(run_dir)
    report["privacy"].update(epsilon=7.9641, adjacency="add/remove")
    (line,) = [x for x in plain_summary(report) if x.startswith("Training was")]
    assert "epsilon = 7.97 " in line and "whether or not any one institution took part" in line
    report["privacy"]["adjacency"] = "replace-one"
    (line,) = [x for x in plain_summary(report) if x.startswith("Training was")]
    assert "whether any one institution is replaced by another" in line
    assert "took part" not in line
    # TINY's distributed noise over every client (Poisson, q = 1): each sends its own share
    assert build_report(run_dir)["privacy"]["adjacency"] == "zero-out"
    report["privacy"]["adjacency"] = "zero-out"
    (line,) = [x for x in plain_summary(report) if x.startswith("Training was")]
    assert "sent its real update or a zero one (its noise share is sent either way)" in line
    assert fmt_bound(7.96875) == "7.969" and fmt_bound(7.9641) == "7.965"
    assert fmt_bound(1e-5) == "1e-05"


def test_a_run_without_held_out_identities_is_judged_on_the_clients_test_images(
    run_dir: Path,
) -> None:
    report = build_report(run_dir)
    u = report["utility"]
    u["final"], u["untrained"] = {}, {}
    u["clients_spread"] = {"tar_at_far_1e-2_mean": 0.175}
    u["untrained_clients_spread"] = {"tar_at_far_1e-2_mean": 0.175}
    warned = {w["code"]: w["message"] for w in report_warnings(report, {})}
    assert "the clients' own test images" in warned["no-utility"]
    u["clients_spread"]["tar_at_far_1e-2_mean"] = 0.5
    assert "no-utility" not in {w["code"] for w in report_warnings(report, {})}


def test_a_centralized_baseline_gets_no_compliance_report(run_dir: Path, tmp_path: Path) -> None:
    copy = _copy_run(run_dir, tmp_path / "run")
    _edit_json(copy / "summary.json", lambda s: s.update(algorithm="centralized"))
    with pytest.raises(FlSecureError, match="centralized baseline run"):
        build_report(copy)


def test_a_new_report_removes_the_files_the_previous_one_wrote_only(
    run_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "report"
    write_report(run_dir, ["html", "md", "json"], out=out)
    (out / "notes.txt").write_text("the regulator's notes")
    assert {"report.html", "report.md", "report.json"} <= {p.name for p in out.iterdir()}
    # Execute: a JSON-only report
    write_report(run_dir, ["json"], out=out)
    # Assert: no page of the earlier report is left beside it; other files are kept
    names = {p.name for p in out.iterdir()}
    assert "report.html" not in names and "report.md" not in names
    assert {"report.json", "notes.txt", "report-files.json"} <= names
    listed = json.loads((out / "report-files.json").read_text())
    assert "report.json" in listed and "notes.txt" not in listed


def test_the_ledgers_notes_are_in_the_report(tmp_path: Path) -> None:
    # a discarded sum the server had seen (or a budget stop) is a ledger note: the report
    # lists each, with its round, beside the verified chain
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path, "run-1", signer=HeadSigner.generate()) as ledger:
        ledger.append("note", round=3, party="server", payload={"message": "sum discarded"})
    section, entries = ledger_section(path, {})
    assert section["verified"] and section["signed_head"] and len(entries) == 1
    assert section["notes"] == [{"round": 3, "message": "sum discarded"}]


def test_an_out_folder_without_a_record_keeps_the_users_own_report_files(
    run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a folder of the user's, with files named as a report's, and no report-files.json
    out = tmp_path / "my-documents"
    out.mkdir()
    (out / "report.pdf").write_bytes(b"%PDF-1.4 the quarterly report I wrote myself")
    (out / "report.md").write_text("# my own notes")
    # Execute: a JSON-only report into it
    with caplog.at_level("WARNING", logger="fl_secure.app.report"):
        write_report(run_dir, ["json"], out=out)
    # Assert: nothing it did not write is removed; the kept files are named in the log
    assert (out / "report.pdf").read_bytes() == b"%PDF-1.4 the quarterly report I wrote myself"
    assert (out / "report.md").read_text() == "# my own notes"
    assert "report.md, report.pdf left as they are" in caplog.text
    listed = json.loads((out / "report-files.json").read_text())
    assert "report.json" in listed and "report.md" not in listed and "report.pdf" not in listed
    # the next report has the record: the user's files are still not its to remove
    write_report(run_dir, ["json"], out=out)
    assert (out / "report.md").read_text() == "# my own notes"
    assert (out / "report.pdf").is_file()


def test_example_level_epsilon_by_round_carries_each_clients_total_forward() -> None:
    def row(seq: int, round_: int, party: str, eps: float) -> Entry:
        return Entry(seq, "example_level", round_, party, {"epsilon": eps}, f"t{seq}", "", "")

    # client-0 spent 5.0 in round 1 and has no row in rounds 2 and 3: its total stays 5.0
    rows = [row(1, 1, "client-0", 5.0), row(2, 1, "client-1", 1.0), row(3, 2, "client-1", 2.0),
            row(4, 3, "client-1", 6.0)]  # fmt: skip
    series = _epsilon_by_round(rows)
    assert [(r["round"], r["epsilon"], r["at"]) for r in series] == [
        (1, 5.0, "t1"),
        (2, 5.0, "t1"),
        (3, 6.0, "t4"),
    ]


def test_a_missing_released_model_is_a_problem_and_a_warning(run_dir: Path, tmp_path: Path) -> None:
    import shutil

    copy = _copy_run(run_dir, tmp_path / "run")
    with Ledger.read(copy / "ledger.sqlite") as ledger:
        named = {e.round: e.payload["model_sha256"] for e in ledger.entries()
                 if e.kind == "client_level"}  # fmt: skip
    shutil.rmtree(copy / "checkpoints")
    report = build_report(copy)
    problem = report["model"]["problem"]
    assert report["model"]["checkpoint"] is None
    assert problem.startswith("the released model is missing: the ledger's rows of round 3 ")
    assert f"SHA-256 {named[3][:16]}" in problem
    warned = {w["code"]: w["message"] for w in report["warnings"]}
    assert warned["model-missing"] == f"{problem}."
    md = write_report(copy, ["md"], out=tmp_path / "out")["md"].read_text()
    assert "no checkpoint; PROBLEM: the released model is missing" in md
    # a run whose ledger names no model (no DP rows): no checkpoint is no problem
    (copy / "ledger.sqlite").unlink()
    assert build_report(copy)["model"]["problem"] is None


def test_client_chosen_text_in_the_stop_reason_is_text_in_the_markdown(
    run_dir: Path, tmp_path: Path
) -> None:
    import html as html_module

    copy = _copy_run(run_dir, tmp_path / "run")
    reason = (
        "round 1 aborted: fewer than 2 updates after 1 attempt; in the last attempt client-1: "
        "tensor #0 is '![](https://attacker.example/pixel.png)<img src=x onerror=alert(1)>', "
        "expected 'w'"
    )
    _edit_json(copy / "summary.json", lambda s: s.update(status="aborted", reason=reason))
    written = write_report(copy, ["md", "html"], out=tmp_path / "out")
    md, page = written["md"].read_text(), written["html"].read_text()
    # the reason is shown (in the run table and the run-not-completed warning), as text
    assert f"| Reason | {md_text(reason)} |" in md
    assert f"- **run-not-completed**: The run ended with status 'aborted': {md_text(reason)}" in md
    assert "![](" not in md and "<img" not in md and "attacker.example/pixel.png)" in md
    assert html_module.escape(reason) in page and "<img src=x" not in page


def test_the_ledgers_notes_are_listed_in_the_html_and_markdown(
    run_dir: Path, tmp_path: Path
) -> None:
    import html as html_module

    copy = _copy_run(run_dir, tmp_path / "run")
    message = "round 3 attempt 0: sum discarded after the server saw it <b>*"
    with Ledger.read(copy / "ledger.sqlite") as ledger:
        run_id = ledger.run_id
    with Ledger.open(copy / "ledger.sqlite", run_id) as ledger:
        ledger.append("note", round=3, party="server", payload={"message": message})
    written = write_report(copy, ["md", "html", "json"], out=tmp_path / "out")
    report = json.loads(written["json"].read_text())
    assert report["ledger"]["notes"] == [{"round": 3, "message": message}]
    md = written["md"].read_text()
    assert "### Ledger notes\n\n- Round 3: round 3 attempt 0: sum discarded after the server " \
        "saw it &lt;b&gt;\\*" in md  # fmt: skip
    page = written["html"].read_text()
    assert f"<h3>Ledger notes</h3><ul class='notes'>\n<li>Round 3: {html_module.escape(message)}" \
        "</li>" in page  # fmt: skip


def test_null_and_nan_figures_are_left_out_of_plots_and_shown_as_n_a(
    run_dir: Path, tmp_path: Path
) -> None:
    import jsonschema

    copy = _copy_run(run_dir, tmp_path / "run")
    # the last round's held-out figures null (the coordinator writes null for a NaN score)
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    last["held_out"] = dict.fromkeys(last["held_out"])
    lines[-1] = json.dumps(last, sort_keys=True)
    (copy / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    # and summary.json with a null ROC point and a NaN score (Python's json writes NaN)
    summary = json.loads((copy / "summary.json").read_text())
    roc = sorted(k for k in summary["held_out"] if k.startswith("roc_tar_at_far_"))
    summary["held_out"][roc[0]] = None
    summary["roc_auc"] = float("nan")
    (copy / "summary.json").write_text(json.dumps(summary))
    written = write_report(copy, ["json", "md", "html"], out=tmp_path / "out")
    report = json.loads(written["json"].read_text())
    jsonschema.validate(report, load_schema())
    assert report["utility"]["final"]["roc_auc"] is None
    warned = {w["code"]: w["message"] for w in report["warnings"]}
    assert warned["non-finite-figures"] == (
        "1 figure(s) in the run's records are NaN or infinite; the report states them as null "
        "(n/a): utility.final.roc_auc."
    )
    assert "| roc_auc | n/a |" in written["md"].read_text()
    assert "<tr><td>roc_auc</td><td>n/a</td>" in written["html"].read_text()
    # the round with null figures is no point of the plot: rounds 0-2 are, for each FAR
    utility = (tmp_path / "out" / "utility.svg").read_text()
    assert utility.count("<circle") == 3 * 3
    roc_svg = (tmp_path / "out" / "roc.svg").read_text()
    assert roc_svg.count("<circle") == len(roc) - 1


def test_a_report_that_fails_to_render_leaves_the_previous_one_whole(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    write_report(run_dir, ["json", "md", "html"], out=out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    copy = _copy_run(run_dir, tmp_path / "run")
    _edit_json(copy / "summary.json", lambda s: s.update(reason="NEW-REASON"))

    def broken(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("the page cannot be rendered")

    monkeypatch.setattr(write, "render_html", broken)
    with pytest.raises(RuntimeError, match="cannot be rendered"):
        write_report(copy, ["json", "md", "html"], out=out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_failed_attempt_records_are_not_rounds_to_the_report(run_dir: Path, tmp_path: Path) -> None:

    # Prepare: round 2 of a completed run had a failed attempt before the one that completed
    copy = _copy_run(run_dir, tmp_path / "run")
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    (index,) = [i for i, line in enumerate(lines) if json.loads(line)["round"] == 2]
    failed = {"kind": "aborted", "round": 2, "attempt": 0, "task": "train",
              "reason": "1 of 3 needed updates arrived", "cohort": ["client-0"],
              "received": ["client-0"], "failed": {"client-1": "<b>refused</b>"},
              "dropped": []}  # fmt: skip
    lines.insert(index, json.dumps(failed))
    (copy / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    before, report = build_report(run_dir), build_report(copy)
    # Assert: listed as retried; the rounds, their figures and the checks are as before
    assert report["run"]["failed_attempts"] == [
        {"round": 2, "attempt": 0, "task": "train", "reason": "1 of 3 needed updates arrived",
         "outcome": "retried", "failed": {"client-1": "<b>refused</b>"}}
    ]  # fmt: skip
    assert report["secure_aggregation"]["aborted_rounds"] == [2]
    assert report["secure_aggregation"]["rounds"] == before["secure_aggregation"]["rounds"]
    assert report["utility"]["per_round"] == before["utility"]["per_round"]
    assert [w["code"] for w in report["warnings"]] == [w["code"] for w in before["warnings"]]
    md = write_report(copy, ["md"], out=tmp_path / "out")["md"].read_text()
    assert "| 2 | 0 | train | retried | 1 of 3 needed updates arrived | client-1: &lt;b&gt;" in md


def test_a_run_that_accounted_nothing_is_not_stated_as_epsilon_zero(run_dir: Path) -> None:
    # a run aborted before its first round: summary.json's epsilon is 0.0 (nothing spent)
    report = build_report(run_dir)
    report["privacy"]["epsilon"] = 0.0
    first = plain_summary(report)[0]
    assert first == "Differential privacy was configured, but no round was accounted."
    report["privacy"]["epsilon"] = 1.25
    assert "epsilon = 1.25" in plain_summary(report)[0]
