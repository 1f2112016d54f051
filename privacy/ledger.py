"""Privacy ledger of a run: an append-only, hash-chained record of every privacy release.

``RUN_DIR/ledger.sqlite`` holds one row per privacy-relevant event: the client-level
guarantee after each round (``client_level``), each client's example-level guarantee
(``example_level``), a client-level release the server saw in an attempt it then
discarded (``discarded_sum``: a sum it unmasked and could not decode, or the plain updates
of a failed attempt; composed like a round) and free-text events such as a budget stop
(``note``). An entry is
committed and synced to disk *before* the round's model is released, so the ledger never
under-reports what has left the server; on resume it is the source of truth for which
rounds have already been counted.

Each row is chained to its predecessor (a hash chain, as in Haber & Stornetta, "How to
time-stamp a digital document", J. Cryptology 3(2), 1991)::

    hash = SHA-256(prev_hash || canonical_json([seq, kind, round, party, payload, created_at]))

and the first row's ``prev_hash`` is ``SHA-256(run_id)``, so entries cannot be moved between
runs. The chain makes edits, deletions and reorderings done without recomputing every later
hash evident to :meth:`Ledger.verify`. It is not a signature: whoever can write the file can
rewrite the whole chain, or drop its tail. Store :meth:`Ledger.head` with each checkpoint
and pass it to :meth:`Ledger.verify` to detect both.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypeAlias, get_args

from fl_secure.errors import CheckpointError

FORMAT_VERSION = 1

Kind = Literal["client_level", "example_level", "discarded_sum", "note"]
KINDS: tuple[str, ...] = get_args(Kind)
JsonValue: TypeAlias = "None | bool | int | float | str | list[JsonValue] | dict[str, JsonValue]"

# Required payload keys per kind -> (value type, lowest, highest). Other keys are free.
_Spec = tuple[Literal["number", "int", "str"], float, float]
_ANY: _Spec = ("number", 0.0, math.inf)
_PROB: _Spec = ("number", 0.0, 1.0)
REQUIRED: dict[str, dict[str, _Spec]] = {
    "client_level": {
        "noise_multiplier": _ANY,
        "sample_rate": _PROB,
        "clip_norm": _ANY,
        "cohort_size": ("int", 0, math.inf),
        "accountant": ("str", 0, 0),
        "epsilon": _ANY,  # cumulative epsilon of the run after this round
        "delta": _PROB,
        "noise_placement": ("str", 0, 0),
    },
    "example_level": {
        "epsilon": _ANY,  # this client's cumulative epsilon after this round
        "delta": _PROB,
        "accountant": ("str", 0, 0),
        "steps": ("int", 0, math.inf),
        "noise_multiplier": _ANY,
        "sample_rate": _PROB,
    },
    "note": {"message": ("str", 0, 0)},
}
# A client-level release the server saw in an attempt it then discarded (a sum it could not
# decode; the plain updates of a failed attempt): composed like a round.
REQUIRED["discarded_sum"] = {**REQUIRED["client_level"], "message": ("str", 0, 0)}
#: Kinds whose payload carries the run's cumulative client-level epsilon.
CLIENT_KINDS = ("client_level", "discarded_sum")

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE entries (
    seq INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    round INTEGER NOT NULL,
    party TEXT NOT NULL,
    payload TEXT NOT NULL,
    created_at TEXT NOT NULL,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL
);
CREATE UNIQUE INDEX one_client_level_per_round ON entries(round) WHERE kind = 'client_level';
CREATE UNIQUE INDEX one_example_level_per_party_round ON entries(round, party)
    WHERE kind = 'example_level';
"""
_COLUMNS = "seq, kind, round, party, payload, created_at, prev_hash, hash"


class LedgerError(CheckpointError):
    """The privacy ledger cannot be opened or written, or an entry is invalid."""


def canonical_json(value: Any) -> str:
    """Canonical JSON text: sorted keys, no spaces, no NaN or infinity."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def genesis_hash(run_id: str) -> str:
    """The ``prev_hash`` of a run's first entry: SHA-256 of the run id."""
    return hashlib.sha256(run_id.encode("utf-8")).hexdigest()


def chain_hash(
    prev_hash: str,
    seq: int,
    kind: str,
    round: int,
    party: str,
    payload: Mapping[str, JsonValue],
    created_at: str,
) -> str:
    """Hash of one entry: SHA-256 of ``prev_hash`` then the canonical JSON of its fields."""
    body = canonical_json([seq, kind, round, party, dict(payload), created_at])
    return hashlib.sha256((prev_hash + body).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One committed ledger row."""

    seq: int
    kind: str
    round: int
    party: str
    payload: dict[str, JsonValue]
    created_at: str
    prev_hash: str
    hash: str

    def to_dict(self) -> dict[str, JsonValue]:
        """Plain JSON-ready form."""
        return {
            "seq": self.seq,
            "kind": self.kind,
            "round": self.round,
            "party": self.party,
            "payload": self.payload,
            "created_at": self.created_at,
            "prev_hash": self.prev_hash,
            "hash": self.hash,
        }


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of :meth:`Ledger.verify`; each problem names the seq (or ``meta``) it concerns."""

    ok: bool
    problems: list[str] = field(default_factory=list)
    entries: int = 0
    head: str = ""
    #: entries appended after the recorded ``(entries, head)`` (a resumed run still going)
    after_record: int = 0


def check_payload(kind: str, payload: Mapping[str, Any]) -> None:
    """Raise :class:`LedgerError` unless ``payload`` has the keys and values ``kind`` needs."""
    if kind not in REQUIRED:
        raise LedgerError(f"unknown ledger kind {kind!r}; allowed: {', '.join(map(repr, KINDS))}")
    spec = REQUIRED[kind]
    for key, (expected, low, high) in spec.items():
        if key not in payload:
            raise LedgerError(
                f"{kind} payload is missing required key {key!r} (required: {', '.join(spec)})"
            )
        value = payload[key]
        where = f"{kind} payload key {key!r} = {value!r}"
        if expected == "str":
            if not isinstance(value, str) or not value:
                raise LedgerError(f"{where}: expected a non-empty string")
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise LedgerError(
                f"{where}: expected {'an integer' if expected == 'int' else 'a number'}"
            )
        if expected == "int" and not isinstance(value, int):
            raise LedgerError(f"{where}: expected an integer")
        if not (math.isfinite(value) and low <= value <= high):
            raise LedgerError(f"{where}: expected a finite value in [{low:g}, {high:g}]")


def _utc_now() -> datetime:
    return datetime.now(UTC)


class Ledger:
    """An open privacy ledger. Use :meth:`open` (read-write) or :meth:`read` (inspection)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path,
        run_id: str,
        *,
        writable: bool,
        clock: Callable[[], datetime],
    ) -> None:
        self._conn: sqlite3.Connection | None = conn
        self._lock = threading.Lock()
        self.path = path
        self.run_id = run_id
        self._writable = writable
        self._clock: Callable[[], datetime] = clock
        self.created = False  #: Ledger.open made the file (it did not exist before)

    @classmethod
    def open(
        cls, path: Path, run_id: str, *, clock: Callable[[], datetime] | None = None
    ) -> Ledger:
        """Create the ledger of run ``run_id`` at ``path``, or open it; refuse another run's."""
        if not run_id:
            raise LedgerError("a ledger needs a non-empty run id")
        path = Path(path)
        existed = path.exists()
        conn = _connect(path, "rwc")
        try:
            # Durability: rollback journal (DELETE) plus synchronous=EXTRA. FULL fsyncs the
            # journal and the database at each commit; EXTRA also fsyncs the directory after
            # the journal is unlinked, which is the commit point in DELETE mode, so a commit
            # that returned survives both kill -9 and power loss. DELETE rather than WAL keeps
            # the ledger a single self-contained file at rest (no -wal/-shm sidecars holding
            # committed entries that a copy of ledger.sqlite alone would miss) and works on
            # file systems without shared memory. A ledger is written a few times per round,
            # so the extra fsyncs cost nothing that matters.
            conn.execute("PRAGMA journal_mode=DELETE")
            conn.execute("PRAGMA synchronous=EXTRA")
            with _transaction(conn):
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
                if "meta" not in tables:
                    if "entries" in tables:
                        raise LedgerError(f"{path} has entries but no meta table; not a ledger")
                    for statement in _SCHEMA.split(";"):
                        if statement.strip():
                            conn.execute(statement)
                    conn.executemany(
                        "INSERT INTO meta(key, value) VALUES (?, ?)",
                        [("format_version", str(FORMAT_VERSION)), ("run_id", run_id)],
                    )
            meta = _read_meta(conn, path)
        except sqlite3.DatabaseError as exc:  # not a database, or a damaged one
            conn.close()
            raise LedgerError(f"{path} is not a readable ledger: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        if not existed:
            _fsync_dir(path.parent)  # make the new file's directory entry durable too
        if meta.get("run_id") != run_id:
            conn.close()
            raise LedgerError(
                f"{path} is the ledger of run {meta.get('run_id')!r}, not of run {run_id!r}; "
                "use a fresh run directory or resume the run it belongs to"
            )
        ledger = cls(conn, path, run_id, writable=True, clock=clock or _utc_now)
        ledger.created = not existed
        return ledger

    @classmethod
    def read(cls, path: Path) -> Ledger:
        """Open an existing ledger for inspection; its run id is taken from its meta table."""
        path = Path(path)
        if not path.is_file():
            raise LedgerError(f"no ledger at {path}")
        # Read-write without create, so that a transaction interrupted by a crash is rolled back.
        conn = _connect(path, "rw")
        try:
            meta = _read_meta(conn, path)
        except BaseException:
            conn.close()
            raise
        return cls(conn, path, meta.get("run_id", ""), writable=False, clock=_utc_now)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the database; further calls raise."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise LedgerError(f"ledger {self.path} is closed")
        return self._conn

    def append(
        self, kind: Kind, *, round: int, party: str, payload: Mapping[str, JsonValue]
    ) -> Entry:
        """Validate, chain and durably commit one entry; return it with its hash."""
        if not self._writable:
            raise LedgerError(f"ledger {self.path} was opened read-only; use Ledger.open")
        check_payload(kind, payload)
        if isinstance(round, bool) or not isinstance(round, int) or round < 0:
            raise LedgerError(f"round = {round!r}: expected a non-negative integer")
        if not isinstance(party, str) or not party:
            raise LedgerError(f"party = {party!r}: expected a non-empty string")
        try:
            text = canonical_json(dict(payload))
        except (TypeError, ValueError) as exc:
            raise LedgerError(f"{kind} payload is not finite JSON: {exc}") from exc
        stored: dict[str, JsonValue] = json.loads(text)
        created_at = self._clock().astimezone(UTC).isoformat(timespec="microseconds")
        with self._lock:
            conn = self._db()
            with _transaction(conn):
                self._refuse_double_count(conn, kind, round, party)
                last = conn.execute("SELECT seq, hash FROM entries ORDER BY seq DESC LIMIT 1")
                row = last.fetchone()
                seq = 1 if row is None else int(row[0]) + 1
                prev = genesis_hash(self.run_id) if row is None else str(row[1])
                digest = chain_hash(prev, seq, kind, round, party, stored, created_at)
                conn.execute(
                    f"INSERT INTO entries({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",  # noqa: S608
                    (seq, kind, round, party, text, created_at, prev, digest),
                )
        return Entry(seq, kind, round, party, stored, created_at, prev, digest)

    @staticmethod
    def _refuse_double_count(conn: sqlite3.Connection, kind: str, round: int, party: str) -> None:
        if kind == "client_level":
            query = "SELECT seq FROM entries WHERE kind = ? AND round = ?"
            found = conn.execute(query, (kind, round)).fetchone()
            what = f"round {round} already has a client_level entry"
        elif kind == "example_level":
            query = "SELECT seq FROM entries WHERE kind = ? AND round = ? AND party = ?"
            found = conn.execute(query, (kind, round, party)).fetchone()
            what = f"round {round} already has an example_level entry for party {party!r}"
        else:
            return
        if found is not None:
            raise LedgerError(
                f"{what} (seq {found[0]}); recording it again would count its privacy loss "
                "twice; a resumed run must continue after the rounds in rounds_recorded()"
            )

    def entries(self) -> list[Entry]:
        """All entries in seq order."""
        with self._lock:
            rows = self._db().execute(f"SELECT {_COLUMNS} FROM entries ORDER BY seq").fetchall()  # noqa: S608
        return [_entry(row) for row in rows]

    def last(self, kind: Kind | None = None) -> Entry | None:
        """The newest entry, or the newest of ``kind``; ``None`` if there is none."""
        query = f"SELECT {_COLUMNS} FROM entries"  # noqa: S608
        args: tuple[str, ...] = ()
        if kind is not None:
            query, args = query + " WHERE kind = ?", (kind,)
        with self._lock:
            row = self._db().execute(query + " ORDER BY seq DESC LIMIT 1", args).fetchone()
        return None if row is None else _entry(row)

    def rounds_recorded(self, kind: Kind = "client_level") -> set[int]:
        """Rounds that have at least one entry of ``kind``."""
        with self._lock:
            rows = self._db().execute("SELECT DISTINCT round FROM entries WHERE kind = ?", (kind,))
            return {int(r[0]) for r in rows}

    def head(self) -> str:
        """Hash of the newest entry (the genesis value for an empty ledger)."""
        newest = self.last()
        return genesis_hash(self.run_id) if newest is None else newest.hash

    def verify(
        self, expected_head: str | None = None, *, recorded: tuple[int, str] | None = None
    ) -> VerifyResult:
        """Recheck meta and the whole chain; a head kept elsewhere also catches a dropped tail.

        Args:
            expected_head: The hash the newest entry must have.
            recorded: ``(entries, head)`` written elsewhere when the run ended (``summary.json``):
                the ledger must hold at least that many entries and its ``entries``-th must
                have that hash. Entries after it are counted in ``after_record``, not flagged
                (a resumed run appends to a ledger whose summary is older).
        """
        with self._lock:
            conn = self._db()
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            rows = conn.execute(f"SELECT {_COLUMNS} FROM entries ORDER BY seq").fetchall()  # noqa: S608
        problems = _check_meta(meta, self.run_id)
        prev, expected_seq, head = genesis_hash(self.run_id), 1, genesis_hash(self.run_id)
        client_rounds: dict[int, int] = {}
        for row in rows:
            seq = row[0]
            if seq != expected_seq:
                missing = f"seq {expected_seq}" + (f"..{seq - 1}" if seq - 1 > expected_seq else "")
                problems.append(f"seq {seq}: {missing} missing (deleted rows)")
            expected_seq = seq + 1
            problems += _check_row(row, prev, seq == rows[0][0], client_rounds)
            prev = head = str(row[7])
        if expected_head is not None and head != expected_head:
            problems.append(
                f"seq {expected_seq - 1}: ledger head {head[:12]} is not the expected "
                f"{expected_head[:12]} (entries dropped from the end, or the chain rewritten)"
            )
        after = 0
        if recorded is not None:
            count, recorded_head = recorded
            if len(rows) < count:
                problems.append(
                    f"seq {expected_seq - 1}: the ledger has {len(rows)} entries but the run "
                    f"recorded {count} ending at {recorded_head[:12]} (entries dropped from "
                    "the end)"
                )
            else:
                at = genesis_hash(self.run_id) if count == 0 else str(rows[count - 1][7])
                if at != recorded_head:
                    problems.append(
                        f"seq {count}: hash {at[:12]} is not the head {recorded_head[:12]} the "
                        "run recorded (the chain was rewritten)"
                    )
                after = len(rows) - count
        return VerifyResult(
            ok=not problems, problems=problems, entries=len(rows), head=head, after_record=after
        )


def recorded_head(summary: Mapping[str, Any]) -> tuple[int, str] | None:
    """``(entries, head)`` of the ledger as a run's ``summary.json`` recorded them, if it did."""
    privacy = summary.get("privacy")
    if not isinstance(privacy, Mapping):
        return None
    count, head = privacy.get("ledger_entries"), privacy.get("ledger_head")
    if isinstance(count, int) and not isinstance(count, bool) and isinstance(head, str):
        return count, head
    return None


def _connect(path: Path, mode: str) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(
            f"{path.resolve().as_uri()}?mode={mode}",
            uri=True,
            timeout=30.0,
            isolation_level=None,  # explicit BEGIN/COMMIT below
            check_same_thread=False,  # calls are serialised by Ledger._lock
        )
    except sqlite3.Error as exc:
        raise LedgerError(f"cannot open ledger {path}: {exc}") from exc
    return conn


class _transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (or ``ROLLBACK``), sqlite errors as LedgerError."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot write the ledger: {exc}") from exc

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:  # pragma: no cover - sqlite already rolled back
                pass
            if isinstance(exc, sqlite3.Error):
                raise LedgerError(f"ledger write failed and was rolled back: {exc}") from exc
            return
        try:
            self.conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise LedgerError(f"ledger commit failed: {exc}") from exc


def _read_meta(conn: sqlite3.Connection, path: Path) -> dict[str, str]:
    try:
        rows = conn.execute("SELECT key, value FROM meta").fetchall()
    except sqlite3.Error as exc:
        raise LedgerError(f"{path} is not a privacy ledger: {exc}") from exc
    meta = {str(k): str(v) for k, v in rows}
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise LedgerError(
            f"{path} has ledger format {meta.get('format_version')!r}; "
            f"this fl-secure reads format {FORMAT_VERSION}"
        )
    return meta


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _entry(row: Sequence[Any]) -> Entry:
    seq, kind, round_, party, payload, created_at, prev_hash, digest = row
    try:
        return Entry(
            int(seq),
            str(kind),
            int(round_),
            str(party),
            json.loads(payload),
            str(created_at),
            str(prev_hash),
            str(digest),
        )
    except (TypeError, ValueError) as exc:
        raise LedgerError(f"ledger entry seq {seq} is malformed ({exc}); run verify()") from exc


def _check_meta(meta: Mapping[str, str], run_id: str) -> list[str]:
    problems = []
    if meta.get("format_version") != str(FORMAT_VERSION):
        problems.append(f"meta: format_version is {meta.get('format_version')!r}")
    if meta.get("run_id") != run_id:
        problems.append(f"meta: run_id is {meta.get('run_id')!r}, expected {run_id!r}")
    return problems


def _check_row(
    row: Sequence[Any], prev: str, first: bool, client_rounds: dict[int, int]
) -> list[str]:
    seq, kind, round_, party, text, created_at, prev_hash, digest = row
    where = f"seq {seq}"
    if prev_hash != prev:
        if first:
            return [f"{where}: prev_hash is not the genesis of this run (run id edited?)"]
        return [f"{where}: prev_hash does not match the previous entry (rows deleted or reordered)"]
    try:
        payload = json.loads(text)
        if not isinstance(payload, dict) or canonical_json(payload) != text:
            return [f"{where}: payload is not canonical JSON of an object (row edited)"]
        if not (isinstance(round_, int) and isinstance(party, str) and isinstance(created_at, str)):
            return [f"{where}: malformed row (round, party or created_at of the wrong type)"]
        if chain_hash(prev_hash, seq, kind, round_, party, payload, created_at) != digest:
            return [f"{where}: hash mismatch (row edited or added without a valid hash)"]
        check_payload(kind, payload)
    except (TypeError, ValueError, LedgerError) as exc:
        return [f"{where}: invalid entry ({exc})"]
    if kind == "client_level":
        if round_ in client_rounds:
            return [f"{where}: round {round_} already recorded at seq {client_rounds[round_]}"]
        client_rounds[round_] = seq
    return []


def format_ledger(entries: Sequence[Entry]) -> str:
    """A readable table of ``entries``, one line each."""
    header = ("seq", "round", "kind", "party", "created_at", "hash", "payload")
    lines = [
        (
            str(e.seq),
            str(e.round),
            e.kind,
            e.party,
            e.created_at[:19] + "Z",
            e.hash[:12],
            " ".join(f"{k}={_short(v)}" for k, v in sorted(e.payload.items())),
        )
        for e in entries
    ]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header) - 1)]
    out = []
    for row in [header, *lines]:
        out.append(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        )
    return "\n".join(line.rstrip() for line in out)


def _short(value: JsonValue) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str):
        return value if value and " " not in value else json.dumps(value)
    return canonical_json(value)


def ledger_guarantee(entries: Sequence[Entry]) -> tuple[JsonValue, JsonValue]:
    """``(epsilon, delta)`` the ledger's entries state for the run (``None`` without any).

    Client level: the newest ``client_level`` or ``discarded_sum`` entry (each carries the
    running total).
    Example level: the worst client's, each client's entries being cumulative.
    """
    client = [e for e in entries if e.kind in CLIENT_KINDS]
    example = [e for e in entries if e.kind == "example_level"]
    if client:
        return client[-1].payload.get("epsilon"), client[-1].payload.get("delta")
    if example:
        worst = max(example, key=lambda e: float(e.payload.get("epsilon") or 0.0))  # type: ignore[arg-type]
        return worst.payload.get("epsilon"), worst.payload.get("delta")
    return None, None


def ledger_json(
    entries: Sequence[Entry], verify_result: VerifyResult | None, *, run_id: str | None = None
) -> dict[str, JsonValue]:
    """JSON-ready form of a ledger for ``fl-secure privacy ledger --json``."""
    client = [e for e in entries if e.kind == "client_level"]
    example = [e for e in entries if e.kind == "example_level"]
    recorded = client or example
    epsilon, delta = ledger_guarantee(entries)
    discarded = [e.round for e in entries if e.kind == "discarded_sum"]
    out: dict[str, JsonValue] = {
        "format_version": FORMAT_VERSION,
        "run_id": run_id,
        "entries": [e.to_dict() for e in entries],
        "rounds_recorded": list[JsonValue](sorted({e.round for e in recorded})),
        "discarded_sums": list[JsonValue](discarded),
        "privacy_unit": "client" if client or discarded else "example" if example else None,
        "epsilon": epsilon,
        "delta": delta,
    }
    if verify_result is not None:
        out["verify"] = {"ok": verify_result.ok, "problems": list(verify_result.problems)}
    return out


def released_model(entries: Sequence[Entry], latest: tuple[int, Path] | None) -> dict[str, Any]:
    """The model the ledger says it released, checked against the run's latest parameters file.

    Every round's ledger rows carry ``model_sha256``: the SHA-256 of the parameters file the
    round released (``checkpoints/round-NNNNNN.safetensors``; ``sha256sum`` of the file gives
    it). Ledgers written before that carry none, which is no problem but leaves the guarantee
    unbound to a file.

    Args:
        entries: The ledger's entries.
        latest: The round and file ``checkpoints/latest.json`` points at (None: none).

    Returns:
        ``checkpoint`` (file name), ``round``, ``sha256`` (of the file), ``ledger_sha256``
        (what the rows of that round name), ``matches_ledger`` (None when the ledger names
        none) and ``problem`` (None, or what is wrong, naming the file and both digests).
    """
    out: dict[str, Any] = {
        "checkpoint": None,
        "round": None,
        "sha256": None,
        "ledger_sha256": None,
        "matches_ledger": None,
        "problem": None,
    }
    if latest is None:
        return out
    round_, path = latest
    out.update(checkpoint=f"checkpoints/{path.name}", round=round_)
    try:
        out["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        out["problem"] = f"the released model's file {out['checkpoint']} cannot be read ({exc})"
        return out
    released = [e for e in entries if e.kind in ("client_level", "example_level")]
    named = {str(e.payload["model_sha256"]) for e in released if "model_sha256" in e.payload}
    later = sorted({e.round for e in released if e.round > round_})
    if later:
        out["problem"] = (
            f"the ledger records round {later[-1]} but checkpoints/latest.json points at round "
            f"{round_}: the run's latest model is not the last one the ledger released"
        )
    of_round = {
        str(e.payload["model_sha256"])
        for e in released
        if e.round == round_ and "model_sha256" in e.payload
    }
    if not of_round:
        if named and out["problem"] is None:  # the ledger names models, but not this one
            out["problem"] = f"the ledger names no model for round {round_}"
        return out
    if len(of_round) > 1:
        out["problem"] = f"the ledger's rows of round {round_} name {len(of_round)} models"
        return out
    out["ledger_sha256"] = recorded = of_round.pop()
    out["matches_ledger"] = recorded == out["sha256"]
    if not out["matches_ledger"] and out["problem"] is None:
        out["problem"] = (
            f"{out['checkpoint']} has SHA-256 {out['sha256'][:16]}, but the ledger's rows of "
            f"round {round_} name {recorded[:16]}: the file is not the model the run released"
        )
    return out


def released_model_of_run(run: Path, entries: Sequence[Entry]) -> dict[str, Any]:
    """:func:`released_model` of the run's latest checkpoint; a broken pointer is a problem."""
    from fl_secure.checkpoints import CheckpointStore

    try:
        latest = CheckpointStore(Path(run) / "checkpoints").latest_file()
    except CheckpointError as exc:
        return {**released_model(entries, None), "problem": str(exc)}
    return released_model(entries, latest)
