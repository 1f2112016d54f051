"""Forged ledgers refused: the server's signed head, its copies, and every epsilon recomputed.

Each test starts a server as ``fl-secure server`` does (:func:`server.bootstrap.build_server`)
on a tiny client-level DP run, lets it account rounds (and, for the resume case, a discarded
sum and its note), and then forges the run folder the way someone who can write it but does
not hold the server's key would: rows dropped or edited, the hash chain recomputed, the
head summary.json records rewritten. ``privacy ledger --verify`` and the server's resume
must refuse each forgery and name what is wrong.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from fl_secure.app.cli import main
from fl_secure.config import config_from_dict
from fl_secure.errors import PrivacyError
from fl_secure.runs import RunDir, atomic_write_json
from privacy.ledger.entries import canonical_json, chain_hash, genesis_hash
from privacy.server_round import ServerPrivacy
from server.bootstrap import build_server

ENROLLED = {"client-0", "client-1"}


def _config(placement: str = "local") -> Any:
    """Two clients, full participation, client-level DP at z = 1 accounted by RDP."""
    return config_from_dict(
        {
            "data": {"image_size": 32, "num_identities": 12, "images_per_identity": 4,
                     "held_out_identities": 2},
            "partition": {"num_clients": 2},
            "server": {"min_clients": 2},
            "model": {"backbone": "cnn-small", "embedding_size": 16},
            "privacy": {"unit": "client", "noise_multiplier": 1.0, "accountant": "rdp",
                        "noise_placement": placement},
        }
    )  # fmt: skip


def _server_privacy(run: Path) -> ServerPrivacy:
    side = build_server(_config(), RunDir(run), enrolled=ENROLLED, evaluate=False)
    privacy = side.coordinator.privacy
    assert privacy is not None
    return privacy


def _run(run: Path, rounds: int) -> ServerPrivacy:
    """A server that accounted ``rounds`` rounds of two clients and wrote its summary."""
    privacy = _server_privacy(run)
    metrics: dict[str, dict[str, float]] = {c: {} for c in sorted(ENROLLED)}
    for r in range(1, rounds + 1):
        privacy.commit(r, privacy.round_entries(r, 2, metrics))
    atomic_write_json(
        run / "summary.json", {"epsilon": privacy.epsilon, "privacy": privacy.summary()}
    )
    return privacy


def _sql(run: Path, sql: str, *args: Any) -> None:
    with sqlite3.connect(run / "ledger.sqlite") as conn:
        conn.execute(sql, args)


def _rechain(run: Path) -> str:
    """Recompute every row's prev_hash and hash (a forger's repair); return the new head."""
    with sqlite3.connect(run / "ledger.sqlite") as conn:
        run_id = conn.execute("SELECT value FROM meta WHERE key = 'run_id'").fetchone()[0]
        rows = conn.execute(
            "SELECT seq, kind, round, party, payload, created_at FROM entries ORDER BY seq"
        ).fetchall()
        prev = genesis_hash(run_id)
        for seq, kind, round_, party, payload, created_at in rows:
            digest = chain_hash(prev, seq, kind, round_, party, json.loads(payload), created_at)
            conn.execute(
                "UPDATE entries SET prev_hash = ?, hash = ? WHERE seq = ?", (prev, digest, seq)
            )
            prev = digest
    return prev


def _rewrite_summary_head(run: Path, entries: int, head: str, epsilon: float) -> None:
    """The forger's summary.json: the head, count and epsilon of the forged ledger."""
    summary = json.loads((run / "summary.json").read_text())
    summary["epsilon"] = summary["privacy"]["epsilon"] = epsilon
    summary["privacy"]["ledger_entries"], summary["privacy"]["ledger_head"] = entries, head
    (run / "summary.json").write_text(json.dumps(summary))


def _verify(run: Path, *extra: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["privacy", "ledger", "--run", str(run), "--verify", *extra])
    return code, capsys.readouterr().out


def test_a_truncated_rechained_ledger_with_its_summary_rewritten_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: 8 rounds accounted; the forger keeps 3 (dropping the tail needs no rechain of
    # what stays, but the forger rechains anyway) and rewrites summary.json's head to match
    run = tmp_path / "run"
    privacy = _run(run, rounds=8)
    true_epsilon = privacy.epsilon
    assert _verify(run, capsys=capsys)[0] == 0  # the honest run verifies
    with sqlite3.connect(run / "ledger.sqlite") as conn:
        kept_epsilon = json.loads(
            conn.execute("SELECT payload FROM entries WHERE seq = 3").fetchone()[0]
        )["epsilon"]
    _sql(run, "DELETE FROM entries WHERE seq > 3")
    head = _rechain(run)
    _rewrite_summary_head(run, 3, head, kept_epsilon)
    assert kept_epsilon < true_epsilon / 1.5  # what the forgery would have the run claim
    # Execute
    code, out = _verify(run, capsys=capsys)
    # Assert: refused, naming the signed head the ledger no longer reaches
    assert code == 1
    assert (
        "ledger.head.json: the server signed a ledger of 8 entries, but it holds 3 "
        "(entries 4..8 dropped from the end)" in out
    )
    assert "summary.json: the server signed a ledger of 8 entries, but it holds 3" in out


def test_a_truncated_ledger_re_signed_with_another_key_is_refused_against_the_servers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: the forger also replaces the signed head and summary's copy with ones signed
    # by a key of their own (they cannot read the server's)
    from privacy.ledger.signed_head import HeadSigner, write_head

    run = tmp_path / "run"
    _run(run, rounds=6)
    _sql(run, "DELETE FROM entries WHERE seq > 2")
    forged = HeadSigner.generate().sign(run.name, 2, _rechain(run))
    write_head(run / "ledger.head.json", forged)
    summary = json.loads((run / "summary.json").read_text())
    summary["privacy"]["ledger_signed_head"] = forged.to_dict()
    (run / "summary.json").write_text(json.dumps(summary))
    # Execute: verified against the server's public key, and resumed by the server
    code, out = _verify(run, "--ledger-key", str(run / "certs"), capsys=capsys)
    # Assert
    assert code == 1
    assert f"ledger.head.json: the ledger head is signed by key {forged.public_key[:16]}, " in out
    assert "not the pinned server key" in out
    with pytest.raises(PrivacyError, match="signed by key .* not the pinned server key"):
        _server_privacy(run).resume(6, [])


def test_every_epsilon_edited_and_rechained_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: every row's epsilon scaled down, the chain recomputed, summary's head rewritten
    run = tmp_path / "run"
    privacy = _run(run, rounds=5)
    scale = 0.3 / privacy.epsilon
    with sqlite3.connect(run / "ledger.sqlite") as conn:
        for seq, text in conn.execute("SELECT seq, payload FROM entries").fetchall():
            payload = json.loads(text)
            payload["epsilon"] *= scale
            conn.execute(
                "UPDATE entries SET payload = ? WHERE seq = ?", (canonical_json(payload), seq)
            )
    _rewrite_summary_head(run, 5, _rechain(run), 0.3)
    # Execute
    code, out = _verify(run, capsys=capsys)
    # Assert: each edited epsilon is named with the figure its parameters give
    assert code == 1
    for seq in range(1, 6):
        assert f"seq {seq}: client_level epsilon " in out
    assert "that the 5 client-level releases up to it give (rdp accountant" in out
    assert f"is not the {privacy.epsilon:.6g}" in out
    with pytest.raises(PrivacyError, match=r"seq 1: client_level epsilon .* epsilon edited"):
        _server_privacy(run).resume(5, [])


def test_a_discarded_sum_and_its_note_dropped_before_a_resume_are_refused(
    tmp_path: Path,
) -> None:
    # Prepare: 3 rounds, then round 4's sum was discarded after the server saw it (counted
    # like a round, with its note), and the server stopped; the forger drops both rows
    run = tmp_path / "run"
    privacy = _run(run, rounds=3)
    privacy.discard_sum(4, 2, 2, 0, "round 4 attempt 0: the sum did not decode")
    privacy.note(4, "round 4: sum discarded; counted in epsilon like a round")
    spent = privacy.epsilon
    privacy.ledger.close()
    (run / "summary.json").unlink()  # the run had not ended: no summary
    _sql(run, "DELETE FROM entries WHERE seq > 3")
    # Execute / Assert: the resumed server refuses the ledger, naming the dropped rows
    with pytest.raises(PrivacyError, match=r"holds 3 \(entries 4..5 dropped from the end\)"):
        _server_privacy(run).resume(3, [])
    # the signed head deleted too: refused as missing
    (run / "ledger.head.json").unlink()
    with pytest.raises(PrivacyError, match="ledger.head.json is missing"):
        _server_privacy(run).resume(3, [])
    # the honest ledger, rows and head restored, resumes at the epsilon it had spent
    honest = tmp_path / "honest"
    kept = _run(honest, rounds=3)
    kept.discard_sum(4, 2, 2, 0, "round 4 attempt 0: the sum did not decode")
    kept.note(4, "round 4: sum discarded")
    kept.ledger.close()
    resumed = _server_privacy(honest)
    resumed.resume(3, [])
    assert resumed.epsilon == pytest.approx(spent) and resumed.discarded_sums == 1


def test_a_site_refuses_a_head_that_lost_entries_or_changed_key(tmp_path: Path) -> None:
    # Prepare: the heads a server signed after 3 and 5 entries, as its tasks carry them
    from privacy.ledger.entries import canonical_json
    from privacy.ledger.signed_head import HeadSigner
    from privacy.ledger.site_heads import SiteHeads

    server = HeadSigner.generate()
    at = {
        n: canonical_json(server.sign("run-1", n, f"{n:064x}").to_dict()).encode() for n in (3, 5)
    }
    site = SiteHeads(tmp_path / "state", "run-1")
    assert site.accept(at[3], 3) is not None and site.accept(at[5], 5) is not None
    # Execute / Assert: kept across a restart; an older head, another key, a bad signature,
    # another hash at the same count and a missing head are each refused by name
    again = SiteHeads(tmp_path / "state", "run-1")
    assert [h.entries for h in again.heads] == [3, 5]
    with pytest.raises(PrivacyError, match="covers 3 entries, but this site saw 5 before"):
        again.accept(at[3], 6)
    other = canonical_json(HeadSigner.generate().sign("run-1", 6, "ab" * 32).to_dict())
    with pytest.raises(PrivacyError, match="signed by key .* not the server's"):
        again.accept(other.encode(), 6)
    forged = json.loads(at[5])
    forged["entries"] = 9
    with pytest.raises(PrivacyError, match="its signature does not verify"):
        again.accept(json.dumps(forged).encode(), 6)
    rewritten = canonical_json(server.sign("run-1", 5, "cd" * 32).to_dict()).encode()
    with pytest.raises(PrivacyError, match="another hash at entry 5 .* rewritten"):
        again.accept(rewritten, 6)
    with pytest.raises(PrivacyError, match="ledger head is missing"):
        again.accept(b"", 6)


def test_an_old_signed_head_restored_with_a_truncated_ledger_is_caught_by_a_sites_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: the forger kept the genuinely signed head of round 3, and restores it with
    # the ledger cut back to 3 rows and summary.json's copies rewritten to match; a site had
    # been sent the head of round 5 with its task
    from privacy.ledger.site_heads import SiteHeads

    run = tmp_path / "run"
    privacy = _run(run, rounds=3)
    old_head = (run / "ledger.head.json").read_bytes()
    metrics: dict[str, dict[str, float]] = {c: {} for c in sorted(ENROLLED)}
    for r in (4, 5):
        privacy.commit(r, privacy.round_entries(r, 2, metrics))
    seen = json.loads((run / "ledger.head.json").read_text())
    SiteHeads(tmp_path / "site-0", "run").accept(json.dumps(seen).encode(), 6)
    _sql(run, "DELETE FROM entries WHERE seq > 3")
    (run / "ledger.head.json").write_bytes(old_head)
    # Execute: verified from the run folder alone, then with the site's state folder
    assert _verify(run, capsys=capsys)[0] == 0  # the run folder alone cannot tell
    code, out = _verify(run, "--site", str(tmp_path / "site-0"), capsys=capsys)
    # Assert
    assert code == 1
    assert (
        f"site {tmp_path / 'site-0'}: the server signed a ledger of 5 entries, but it holds 3 "
        "(entries 4..5 dropped from the end)" in out
    )


def test_a_training_task_carries_the_signed_head_over_the_wire() -> None:
    from fl_secure import serde
    from fl_secure.messages import Task, TaskKind

    task = Task(kind=TaskKind.TRAIN, round=2, nonce=b"n", ledger_head=b'{"entries":1}')
    assert serde.task_from_proto(serde.task_to_proto(task)).ledger_head == b'{"entries":1}'


def test_the_checkpoints_copy_of_the_head_catches_a_restored_older_head(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: the head as round 5's checkpoint state keeps it (the coordinator stores the
    # signed head there before it commits the round's rows), then an older head file and a
    # ledger cut back to it restored
    run = tmp_path / "run"
    privacy = _run(run, rounds=2)
    old_head = (run / "ledger.head.json").read_bytes()
    metrics: dict[str, dict[str, float]] = {c: {} for c in sorted(ENROLLED)}
    for r in (3, 4):
        privacy.commit(r, privacy.round_entries(r, 2, metrics))
    state = {"round": 5, "file": "round-000005.safetensors", "privacy_rows": []}
    state["ledger_signed_head"] = privacy.signed_head()
    atomic_write_json(run / "checkpoints" / "latest.json", state)
    _sql(run, "DELETE FROM entries WHERE seq > 2")
    (run / "ledger.head.json").write_bytes(old_head)
    # Execute
    code, out = _verify(run, capsys=capsys)
    # Assert: the checkpoint's copy names the dropped entries and the older head file
    assert code == 1
    assert "checkpoints/latest.json: the server signed a ledger of 4 entries, but it holds 2" in out
    assert "more than the 2 of ledger.head.json (an older head file restored)" in out
