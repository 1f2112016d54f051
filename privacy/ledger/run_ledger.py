"""A run's privacy ledger: an append-only, hash-chained record of every privacy release.

``RUN_DIR/ledger.sqlite`` holds one row per privacy-relevant event (:mod:`privacy.ledger.entries`).
An entry is committed and synced to disk *before* the round's model is released, so the
ledger never under-reports what has left the server; on resume it is the source of truth for
which rounds have already been counted. Opened with the server's :class:`HeadSigner`, every
commit also rewrites the signed head beside it (``ledger.head.json``,
:mod:`privacy.ledger.signed_head`); :meth:`Ledger.verify` with the run's anchors
(:mod:`privacy.ledger.anchors`) then detects a rewritten chain or a dropped tail, and
recomputes every row's epsilon (:mod:`privacy.ledger.recompute`).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from privacy.ledger.anchors import Anchors
from privacy.ledger.entries import (
    FORMAT_VERSION,
    Entry,
    JsonValue,
    Kind,
    LedgerError,
    canonical_json,
    chain_hash,
    check_payload,
    genesis_hash,
)
from privacy.ledger.signed_head import HeadSigner, SignedHead, head_path, read_head, write_head
from privacy.ledger.verification import VerifyResult, verify_ledger

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
        signer: HeadSigner | None = None,
    ) -> None:
        self._conn: sqlite3.Connection | None = conn
        self._lock = threading.Lock()
        self.path = path
        self.run_id = run_id
        self._writable = writable
        self._clock: Callable[[], datetime] = clock
        self.created = False  #: Ledger.open made the file (it did not exist before)
        self.signer = signer  #: signs the head after every commit (the server's key)
        self._signed: SignedHead | None = None  # the head this process last signed

    @classmethod
    def open(
        cls,
        path: Path,
        run_id: str,
        *,
        clock: Callable[[], datetime] | None = None,
        signer: HeadSigner | None = None,
    ) -> Ledger:
        """Create the ledger of run ``run_id`` at ``path``, or open it; refuse another run's.

        With ``signer`` each commit is followed by a signed head (``ledger.head.json``); a new
        ledger gets the signed head of its empty chain at once. An existing ledger's head
        file is left as it is until it has been verified (:meth:`sign_head`).
        """
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
        ledger = cls(conn, path, run_id, writable=True, clock=clock or _utc_now, signer=signer)
        ledger.created = not existed
        if signer is not None and not existed:
            ledger.sign_head()
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
            if self.signer is not None:  # after the commit: a crash leaves it unsigned, not lost
                self._signed = self.signer.sign(self.run_id, seq, digest)
                write_head(self.head_path, self._signed)
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

    @property
    def head_path(self) -> Path:
        """The signed head file beside the ledger (``ledger.head.json``)."""
        return head_path(self.path)

    def signed_head(self) -> SignedHead | None:
        """The head this process last signed, else the signed head file (None: neither)."""
        return self._signed if self._signed is not None else read_head(self.head_path)

    def sign_head(self) -> SignedHead:
        """Sign the current head and write it beside the ledger (after a verified resume)."""
        if self.signer is None:
            raise LedgerError(f"ledger {self.path} was opened without a signing key")
        with self._lock:
            row = self._db().execute("SELECT seq, hash FROM entries ORDER BY seq DESC LIMIT 1")
            last = row.fetchone()
            count, head = (0, genesis_hash(self.run_id)) if last is None else (last[0], last[1])
            signed = self.signer.sign(self.run_id, int(count), str(head))
            write_head(self.head_path, signed)
            self._signed = signed
        return signed

    def verify(
        self,
        expected_head: str | None = None,
        *,
        recorded: tuple[int, str] | None = None,
        anchors: Anchors | None = None,
        recompute: bool = False,
    ) -> VerifyResult:
        """Recheck meta, the whole chain and every epsilon; anchors catch a dropped tail.

        Args:
            expected_head: The hash the newest entry must have.
            recorded: ``(entries, head)`` written elsewhere when the run ended (``summary.json``):
                the ledger must hold at least that many entries and its ``entries``-th must
                have that hash. Entries after it are counted in ``after_record``, not flagged
                (a resumed run appends to a ledger whose summary is older).
            anchors: The signed head and its copies (:func:`privacy.ledger.anchors.run_anchors`).
            recompute: Recompute every row's epsilon from its parameters (what ``--verify``,
                a resume and the report do; off only for rows written by hand, as in tests).
        """
        with self._lock:
            conn = self._db()
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            rows = conn.execute(f"SELECT {_COLUMNS} FROM entries ORDER BY seq").fetchall()  # noqa: S608
        return verify_ledger(
            meta, rows, self.run_id, expected_head, recorded, anchors, recompute=recompute
        )


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
