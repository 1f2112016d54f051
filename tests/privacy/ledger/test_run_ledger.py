"""Privacy ledger: hash chain, tamper evidence, crash durability, no double counting."""

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from fl_secure.errors import CheckpointError
from privacy.ledger.entries import Entry, LedgerError, canonical_json, chain_hash, genesis_hash
from privacy.ledger.formatting import format_ledger, ledger_json
from privacy.ledger.guarantee import released_model
from privacy.ledger.run_ledger import Ledger
from privacy.ledger.verification import recorded_head

ROOT = Path(__file__).resolve().parents[3]
RUN = "run-0001"


def client_payload(round_: int) -> dict[str, Any]:
    return {
        "noise_multiplier": 1.1,
        "sample_rate": 0.25,
        "clip_norm": 1.0,
        "cohort_size": 8,
        "accountant": "rdp",
        "epsilon": 0.5 * round_,
        "delta": 1e-5,
        "noise_placement": "server",
    }


def example_payload() -> dict[str, Any]:
    return {
        "epsilon": 2.0,
        "delta": 1e-5,
        "accountant": "prv",
        "steps": 40,
        "noise_multiplier": 0.9,
        "sample_rate": 0.01,
    }


def fill(ledger: Ledger, rounds: int = 3) -> list[Entry]:
    out = []
    for r in range(1, rounds + 1):
        out.append(
            ledger.append("client_level", round=r, party="server", payload=client_payload(r))
        )
        out.append(ledger.append("example_level", round=r, party="c0", payload=example_payload()))
    return out


def raw(path: Path, sql: str, *args: Any) -> None:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(sql, args)
    conn.close()


@pytest.fixture
def ledger_path(tmp_path: Path) -> Path:
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path, RUN) as ledger:
        fill(ledger)
    return path


def problems_of(path: Path, run_id: str = RUN) -> list[str]:
    with Ledger.open(path, run_id) as ledger:
        result = ledger.verify()
    assert result.ok is (not result.problems)
    return result.problems


def test_chain_hash_is_sha256_of_prev_and_canonical_fields() -> None:
    fields = [1, "note", 0, "server", {"message": "start", "a": [1.5, None]}, "2026-01-01T00:00"]
    expected = hashlib.sha256(
        (
            "ab" * 32
            + '[1,"note",0,"server",{"a":[1.5,null],"message":"start"},"2026-01-01T00:00"]'
        ).encode()
    ).hexdigest()
    assert chain_hash("ab" * 32, *fields) == expected  # type: ignore[arg-type]
    assert genesis_hash(RUN) == hashlib.sha256(RUN.encode()).hexdigest()
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_append_chains_and_reopens(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "ledger.sqlite"
    t0 = datetime(2026, 5, 1, 12, tzinfo=UTC)
    ticks = iter(t0 + timedelta(seconds=k) for k in range(100))
    # Execute
    with Ledger.open(path, RUN, clock=lambda: next(ticks)) as ledger:
        written = fill(ledger, 2)
        note = ledger.append("note", round=2, party="server", payload={"message": "budget stop"})
        assert ledger.last() == note
        assert ledger.last("client_level") == written[2]
        assert ledger.head() == note.hash
    # Assert
    with Ledger.open(path, RUN) as ledger:
        entries = ledger.entries()
        assert entries == [*written, note]
        assert [e.seq for e in entries] == [1, 2, 3, 4, 5]
        assert entries[0].prev_hash == genesis_hash(RUN)
        for prev, cur in zip(entries, entries[1:], strict=False):
            assert cur.prev_hash == prev.hash
        for e in entries:
            args = (e.prev_hash, e.seq, e.kind, e.round, e.party, e.payload, e.created_at)
            assert chain_hash(*args) == e.hash
        assert entries[0].created_at == "2026-05-01T12:00:00.000000+00:00"
        assert entries[0].payload == client_payload(1)
        assert ledger.rounds_recorded() == {1, 2}
        assert ledger.rounds_recorded("note") == {2}
        result = ledger.verify(expected_head=note.hash)
        assert result.ok and result.problems == [] and result.entries == 5
    conn = sqlite3.connect(path)
    stored = conn.execute("SELECT payload FROM entries WHERE seq = 1").fetchone()[0]
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    conn.close()
    assert stored == canonical_json(client_payload(1)) and " " not in stored


def test_empty_ledger_verifies_and_refuses_other_run(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path, RUN) as ledger:
        assert ledger.entries() == [] and ledger.last() is None
        assert ledger.head() == genesis_hash(RUN) and ledger.verify().ok
    with pytest.raises(LedgerError, match="ledger of run 'run-0001', not of run 'other'"):
        Ledger.open(path, "other")
    assert issubclass(LedgerError, CheckpointError)


def test_double_counting_refused(ledger_path: Path) -> None:
    with Ledger.open(ledger_path, RUN) as ledger:
        assert ledger.rounds_recorded() == {1, 2, 3}
        with pytest.raises(
            LedgerError, match=r"round 2 already has a client_level entry \(seq 3\)"
        ):
            ledger.append("client_level", round=2, party="server", payload=client_payload(2))
        with pytest.raises(LedgerError, match="example_level entry for party 'c0'"):
            ledger.append("example_level", round=3, party="c0", payload=example_payload())
        ledger.append("example_level", round=3, party="c1", payload=example_payload())
        ledger.append("client_level", round=4, party="server", payload=client_payload(4))
    with Ledger.open(ledger_path, RUN) as ledger:
        assert ledger.rounds_recorded() == {1, 2, 3, 4}
        assert len(ledger.entries()) == 8 and ledger.verify().ok


def test_payload_validation_names_the_key(tmp_path: Path) -> None:
    with Ledger.open(tmp_path / "ledger.sqlite", RUN) as ledger:
        payload = client_payload(1)
        del payload["clip_norm"]
        with pytest.raises(
            LedgerError, match="client_level payload is missing required key 'clip_norm'"
        ):
            ledger.append("client_level", round=1, party="server", payload=payload)
        with pytest.raises(LedgerError, match="'cohort_size' = 8.5: expected an integer"):
            ledger.append(
                "client_level",
                round=1,
                party="s",
                payload={**client_payload(1), "cohort_size": 8.5},
            )
        with pytest.raises(
            LedgerError, match=r"'sample_rate' = 1.5: expected a finite value in \[0, 1\]"
        ):
            ledger.append(
                "client_level",
                round=1,
                party="s",
                payload={**client_payload(1), "sample_rate": 1.5},
            )
        with pytest.raises(LedgerError, match="'epsilon' = inf"):
            ledger.append(
                "example_level", round=1, party="c", payload={**example_payload(), "epsilon": 1e999}
            )
        with pytest.raises(LedgerError, match="missing required key 'message'"):
            ledger.append("note", round=1, party="server", payload={})
        with pytest.raises(LedgerError, match="unknown ledger kind 'budget'"):
            ledger.append("budget", round=1, party="s", payload={})  # type: ignore[arg-type]
        with pytest.raises(LedgerError, match="not finite JSON"):
            ledger.append("note", round=1, party="s", payload={"message": "x", "v": float("nan")})
        with pytest.raises(LedgerError, match="round = -1"):
            ledger.append("note", round=-1, party="s", payload={"message": "x"})
        assert ledger.entries() == []  # nothing half-written


def test_edited_payload_is_named(ledger_path: Path) -> None:
    edited = canonical_json({**client_payload(2), "epsilon": 0.01})
    raw(ledger_path, "UPDATE entries SET payload = ? WHERE seq = 3", edited)
    assert problems_of(ledger_path) == [
        "seq 3: hash mismatch (row edited or added without a valid hash)"
    ]


def test_deleted_middle_row_is_named(ledger_path: Path) -> None:
    raw(ledger_path, "DELETE FROM entries WHERE seq = 3")
    problems = problems_of(ledger_path)
    assert problems[0] == "seq 4: seq 3 missing (deleted rows)"
    assert problems[1].startswith("seq 4: prev_hash does not match the previous entry")


def test_reordered_rows_are_named(ledger_path: Path) -> None:
    # Swap every column but seq between seq 2 and seq 4 (both example_level rows).
    cols = "kind, round, party, payload, created_at, prev_hash, hash"
    conn = sqlite3.connect(ledger_path)
    row2 = conn.execute(f"SELECT {cols} FROM entries WHERE seq = 2").fetchone()
    row4 = conn.execute(f"SELECT {cols} FROM entries WHERE seq = 4").fetchone()
    sets = ", ".join(f"{c} = ?" for c in cols.split(", "))
    with conn:
        conn.execute("UPDATE entries SET round = -1 WHERE seq = 2")
        conn.execute(f"UPDATE entries SET {sets} WHERE seq = 4", row2)
        conn.execute(f"UPDATE entries SET {sets} WHERE seq = 2", row4)
    conn.close()
    problems = problems_of(ledger_path)
    assert [p.split(":")[0] for p in problems] == ["seq 2", "seq 3", "seq 4", "seq 5"]
    assert "prev_hash does not match" in problems[0]


def test_edited_run_id_is_named(ledger_path: Path) -> None:
    raw(ledger_path, "UPDATE meta SET value = 'run-0002' WHERE key = 'run_id'")
    with pytest.raises(LedgerError, match="ledger of run 'run-0002', not of run 'run-0001'"):
        Ledger.open(ledger_path, RUN)
    with Ledger.read(ledger_path) as ledger:
        result = ledger.verify()
    assert not result.ok
    assert result.problems == ["seq 1: prev_hash is not the genesis of this run (run id edited?)"]


def test_meta_edited_after_open_is_named(ledger_path: Path) -> None:
    with Ledger.open(ledger_path, RUN) as ledger:
        raw(ledger_path, "UPDATE meta SET value = 'other' WHERE key = 'run_id'")
        assert ledger.verify().problems == ["meta: run_id is 'other', expected 'run-0001'"]


def test_hand_appended_rows_are_named(ledger_path: Path) -> None:
    with Ledger.open(ledger_path, RUN) as ledger:
        head = ledger.head()
    sql = "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    payload = canonical_json(client_payload(4))
    raw(ledger_path, sql, 7, "client_level", 4, "server", payload, "2026-01-01", head, "0" * 64)
    assert problems_of(ledger_path) == [
        "seq 7: hash mismatch (row edited or added without a valid hash)"
    ]


def test_dropped_tail_needs_the_expected_head(ledger_path: Path) -> None:
    with Ledger.open(ledger_path, RUN) as ledger:
        head = ledger.head()
    raw(ledger_path, "DELETE FROM entries WHERE seq = 6")
    with Ledger.open(ledger_path, RUN) as ledger:
        assert ledger.verify().ok  # a truncated chain is still a valid chain ...
        result = ledger.verify(expected_head=head)  # ... unless the head was stored elsewhere
    assert not result.ok and result.problems[0].startswith("seq 5: ledger head")


def test_recorded_head_catches_a_dropped_tail_and_a_rewrite_but_allows_appends(
    ledger_path: Path,
) -> None:
    with Ledger.open(ledger_path, RUN) as ledger:
        record = (len(ledger.entries()), ledger.head())  # what summary.json keeps: 6 entries
        assert ledger.verify(recorded=record).ok
        ledger.append("client_level", round=4, party="server", payload=client_payload(4))
        grown = ledger.verify(recorded=record)  # a resumed run appends after its old summary
    assert grown.ok and grown.after_record == 1 and grown.entries == 7
    raw(ledger_path, "DELETE FROM entries WHERE seq >= 5")  # drop the last three rows
    with Ledger.read(ledger_path) as ledger:
        assert ledger.verify().ok  # a valid, shorter chain on its own
        short = ledger.verify(recorded=record)
    assert short.problems == [
        f"seq 4: the ledger has 4 entries but the run recorded 6 ending at {record[1][:12]} "
        "(entries dropped from the end)"
    ]
    with Ledger.read(ledger_path) as ledger:  # the same count, another chain
        assert not ledger.verify(recorded=(4, record[1])).ok
        assert ledger.verify(recorded=(0, genesis_hash(RUN))).after_record == 4
    assert recorded_head({"privacy": {"ledger_entries": 6, "ledger_head": "ab"}}) == (6, "ab")
    assert recorded_head({"privacy": {"ledger_entries": True, "ledger_head": "ab"}}) is None
    assert recorded_head({"privacy": None}) is None and recorded_head({}) is None


def test_read_only_view_refuses_append(ledger_path: Path, tmp_path: Path) -> None:
    with Ledger.read(ledger_path) as ledger:
        assert ledger.run_id == RUN and len(ledger.entries()) == 6 and ledger.verify().ok
        with pytest.raises(LedgerError, match="read-only"):
            ledger.append("note", round=1, party="s", payload={"message": "x"})
    with pytest.raises(LedgerError, match="closed"):
        ledger.entries()
    with pytest.raises(LedgerError, match="no ledger"):
        Ledger.read(tmp_path / "missing.sqlite")
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all" * 100)
    with pytest.raises(LedgerError, match="not a privacy ledger"):
        Ledger.read(tmp_path / "junk.sqlite")


CHILD = """
import sys
from pathlib import Path
from privacy.ledger.run_ledger import Ledger

with Ledger.open(Path(sys.argv[1]), "run-crash") as ledger:
    for r in range(1, 5001):
        payload = {"noise_multiplier": 1.0, "sample_rate": 0.1, "clip_norm": 1.0,
                   "cohort_size": 4, "accountant": "rdp", "epsilon": 0.01 * r, "delta": 1e-5,
                   "noise_placement": "server"}
        ledger.append("client_level", round=r, party="server", payload=payload)
        print(r, flush=True)
"""


def test_committed_entries_survive_sigkill(tmp_path: Path) -> None:
    # Prepare: a child appends and prints after each commit.
    path = tmp_path / "ledger.sqlite"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None
    printed: list[int] = []
    try:
        # Execute: kill -9 once 25 commits have been reported.
        for line in child.stdout:
            printed.append(int(line))
            if len(printed) == 25:
                child.send_signal(signal.SIGKILL)
                break
    finally:
        child.kill()
        child.wait()
    printed += [int(line) for line in child.stdout]  # lines already in the pipe
    child.stdout.close()
    # Assert: every reported entry is there, at most one more, and the chain verifies.
    assert child.returncode == -signal.SIGKILL and printed == list(range(1, len(printed) + 1))
    with Ledger.open(path, "run-crash") as ledger:
        recorded = ledger.rounds_recorded()
        assert set(printed) <= recorded
        assert recorded == set(range(1, len(recorded) + 1))
        assert len(recorded) - len(printed) <= 1
        assert ledger.verify().ok
        ledger.append("note", round=len(recorded), party="server", payload={"message": "resumed"})
        assert ledger.verify().ok


def test_format_and_json(ledger_path: Path) -> None:
    with Ledger.open(ledger_path, RUN) as ledger:
        entries = ledger.entries()
        result = ledger.verify()
    table = format_ledger(entries).splitlines()
    assert table[0].split() == ["seq", "round", "kind", "party", "created_at", "hash", "payload"]
    assert len(table) == 7
    assert table[5].split()[:4] == ["5", "3", "client_level", "server"]
    assert "epsilon=1.5" in table[5] and "accountant=rdp" in table[5]
    assert entries[4].hash[:12] in table[5]
    doc = ledger_json(entries, result, run_id=RUN)
    assert json.loads(json.dumps(doc, allow_nan=False)) == doc
    assert doc["verify"] == {"ok": True, "problems": []}
    assert doc["rounds_recorded"] == [1, 2, 3] and doc["epsilon"] == 1.5 and doc["delta"] == 1e-5
    assert doc["entries"][0] == entries[0].to_dict()  # type: ignore[index]
    assert "verify" not in ledger_json(entries, None)


def test_released_model_is_checked_against_the_rows_of_its_round(tmp_path: Path) -> None:
    # Prepare: two rounds' files and a ledger whose rows name them
    files = {r: tmp_path / f"round-{r:06d}.safetensors" for r in (1, 2)}
    for r, f in files.items():
        f.write_bytes(f"parameters of round {r}".encode())
    sha = {r: hashlib.sha256(f.read_bytes()).hexdigest() for r, f in files.items()}
    with Ledger.open(tmp_path / "ledger.sqlite", "run-m") as ledger:
        for r in (1, 2):
            payload = {**client_payload(r), "model_sha256": sha[r]}
            ledger.append("client_level", round=r, party="server", payload=payload)
        ledger.append("note", round=2, party="server", payload={"message": "budget"})
        entries = ledger.entries()
    # Execute / Assert: the latest file is the one round 2 released
    ok = released_model(entries, (2, files[2]))
    assert (ok["checkpoint"], ok["sha256"], ok["matches_ledger"], ok["problem"]) == (
        "checkpoints/round-000002.safetensors",
        sha[2],
        True,
        None,
    )
    # latest.json rolled back to round 1: its file matches round 1, but it is not the last
    rolled = released_model(entries, (1, files[1]))
    assert rolled["matches_ledger"] is True
    assert rolled["problem"] == (
        "the ledger records round 2 but checkpoints/latest.json points at round 1: the run's "
        "latest model is not the last one the ledger released"
    )
    # the file of round 2 altered
    files[2].write_bytes(b"other parameters")
    bad = released_model(entries, (2, files[2]))
    assert bad["matches_ledger"] is False and bad["ledger_sha256"] == sha[2]
    assert bad["problem"].endswith("the file is not the model the run released")
    # a ledger written before rows named models: nothing to compare, no problem
    old = [e for e in entries if e.kind == "note"]
    assert released_model(old, (2, files[2]))["problem"] is None
    assert released_model(entries, None)["checkpoint"] is None
    files[2].unlink()
    assert "cannot be read" in released_model(entries, (2, files[2]))["problem"]
