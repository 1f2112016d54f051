"""Run directories: resolved config, per-round metrics, final summary.

Layout: ``config.toml``, ``metrics.jsonl`` (one JSON object per round, and one per failed
attempt with ``"kind": "aborted"``), ``summary.json``,
``checkpoints/`` (safetensors), later ``ledger.sqlite``, ``audit/`` and ``report/``.
Writes that must survive a crash are atomic (temporary file, fsync, rename).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fl_secure.errors import CheckpointError


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def run_keyed_path(directory: Path, stem: str, suffix: str, run_id: str) -> Path:
    """``directory/<stem>-<digest><suffix>``: a client's file for the run ``run_id``.

    The digest is the first 16 hex digits of the run id's SHA-256: the run id comes from the
    server, so it is never used as a path itself. Without a run id: ``directory/<stem><suffix>``.
    """
    if not run_id:
        return directory / f"{stem}{suffix}"
    digest = hashlib.sha256(run_id.encode("utf-8")).hexdigest()[:16]
    return directory / f"{stem}-{digest}{suffix}"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A run file holding one JSON object; CheckpointError names a missing or damaged one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} does not exist: is this a finished run?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what} {path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{what} {path} is damaged: a JSON object was expected")
    return value


def new_run_dir(base: Path, name: str) -> Path:
    """A fresh, unique run directory ``base/name-YYYYmmdd-HHMMSS[-k]``."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        candidate = base / (f"{name}-{stamp}" + (f"-{k}" if k else ""))
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:
            continue
        return candidate
    raise CheckpointError(f"could not create a run directory under {base}")  # pragma: no cover


@contextlib.contextmanager
def removed_if_setup_fails(path: Path | None) -> Iterator[None]:
    """Remove ``path``, a run directory this process just made, if its set-up fails.

    A server that cannot start (a port in use, a data plan that does not fit) has run
    nothing, so it leaves no run directory to mistake for a run. ``None`` (a resumed run,
    whose directory holds a real history) is never touched.
    """
    try:
        yield
    except BaseException:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
        raise


@dataclass(frozen=True)
class RunDir:
    """Paths and append-only files of one run."""

    path: Path

    @property
    def config(self) -> Path:
        """Resolved configuration."""
        return self.path / "config.toml"

    @property
    def metrics(self) -> Path:
        """One JSON object per round."""
        return self.path / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        """Final figures."""
        return self.path / "summary.json"

    @property
    def checkpoints(self) -> Path:
        """Safetensors checkpoints and round state."""
        return self.path / "checkpoints"

    @property
    def certs(self) -> Path:
        """Certificates made for an embedded run."""
        return self.path / "certs"

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold this run for one process (training or auditing it); refuse if another holds it.

        Two servers on one run directory (a resume started while the first still runs)
        would both append to metrics.jsonl and the ledger and write checkpoints; an audit of
        a run still training would attack a checkpoint that moves under it. An
        exclusive ``flock`` on ``.run.lock`` stops the second before it touches anything. The
        kernel releases the lock when the process ends, however it ends, so a crashed
        run resumes without any clean-up.

        Raises:
            CheckpointError: another process holds the run (its pid is named).
        """
        import fcntl

        lock = self.path / ".run.lock"
        handle = open(lock, "a+", encoding="utf-8")  # noqa: SIM115 - held until the end
        try:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                raise CheckpointError(
                    f"{self.path} is in use by another fl-secure process (pid {holder}); "
                    "stop it first, or wait for it to end"
                ) from None
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            yield
        finally:
            handle.close()  # releases the lock

    def append_metrics(self, record: dict[str, Any]) -> None:
        """Append one round's metrics and sync to disk."""
        self.path.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, sort_keys=True, allow_nan=False) + "\n"
        with self.metrics.open("a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def read_metrics(self) -> list[dict[str, Any]]:
        """All metric records; a torn last line (crash mid-write) is ignored."""
        return list(self._iter_metrics())

    def _iter_metrics(self) -> Iterator[dict[str, Any]]:
        if not self.metrics.exists():
            return
        text = self.metrics.read_text(encoding="utf-8")
        lines = text.splitlines()
        last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
        # every append ends with "}\n": a last line without either was cut mid-write
        torn = not text.endswith("\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                if number == last and (torn or not line.endswith("}")):
                    continue  # torn final write (a crash mid-append); resume drops it
                raise CheckpointError(f"{self.metrics}:{number} is not JSON: {exc}") from exc
            if not isinstance(record, dict):
                raise CheckpointError(f"{self.metrics}:{number} is not a JSON object")
            yield record

    def truncate_metrics_after(self, round_: int) -> int:
        """Keep only records of rounds <= ``round_`` (resume); return how many were dropped.

        Records with a ``kind`` (a failed attempt) are kept whatever their round: the attempt
        happened, and what it showed the server is accounted (a ``discarded_sum`` row).
        """
        records = self.read_metrics()
        kept = [r for r in records if "kind" in r or int(r.get("round", 0)) <= round_]
        if len(kept) != len(records) or self.metrics.exists():
            text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept)
            atomic_write_bytes(self.metrics, text.encode())
        return len(records) - len(kept)

    def read_summary(self) -> dict[str, Any]:
        """``summary.json``; CheckpointError when it is missing or damaged."""
        return read_json_object(self.summary, "the run summary")

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Atomically write the final summary."""
        atomic_write_json(self.summary, summary)
