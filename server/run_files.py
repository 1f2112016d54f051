"""The server's records in a run directory besides metrics, checkpoints and the ledger.

``config.toml`` (the resolved config), ``partition.json`` (the federation plan, the data
manifest of the run's first start, and every start of the server on the run), and the run id
a run keeps when its folder is renamed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fl_secure.checkpoints import CheckpointStore
from fl_secure.config import config_to_toml
from fl_secure.data.manifest import data_manifest
from fl_secure.runs import atomic_write_bytes, read_json_object
from privacy.ledger.entries import LedgerError
from privacy.ledger.run_ledger import Ledger

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from fl_secure.config import Config
    from fl_secure.data.plan import FederatedData
    from fl_secure.runs import RunDir

log = logging.getLogger(__name__)


def write_config(run_dir: RunDir, config: Config) -> Path:
    """Write the resolved config into the run directory."""
    atomic_write_bytes(run_dir.config, config_to_toml(config).encode())
    return run_dir.config


def write_partition_record(run_dir: RunDir, config: Config, plan: FederatedData) -> None:
    """Write ``partition.json``: the plan, the first start's data manifest, the starts so far.

    This start is added by :func:`record_start` once the run is accepted.
    """
    manifest = {
        "kind": config.partition.kind,
        **plan.manifest(),
        "data_manifest": _first_data_manifest(run_dir, config),
        "starts": _recorded_starts(run_dir),  # this start is added once resume() accepts
    }
    atomic_write_bytes(
        run_dir.path / "partition.json", (json.dumps(manifest, indent=1) + "\n").encode()
    )


def _first_data_manifest(run_dir: RunDir, config: Config) -> dict[str, Any]:
    """The data manifest of the run's first start (a resume keeps it, and notes a change).

    The report states it: the data the run trained on, hashed when it started, not what the
    folder holds when the report is written.
    """
    now = data_manifest(dataclasses.asdict(config.data), seed=config.data_seed)
    previous = run_dir.path / "partition.json"
    if not previous.is_file():
        return now
    recorded = read_json_object(previous, "the run's partition record").get("data_manifest")
    if not isinstance(recorded, dict):
        return now
    if recorded.get("kind") != now.get("kind"):  # hashed by an earlier release: not comparable
        log.info("the run's data manifest was recorded as %r; kept", recorded.get("kind"))
        return recorded
    if recorded.get("sha256") != now.get("sha256"):
        log.warning(
            "the data differ from those the run started with (manifest %s, now %s)",
            recorded.get("sha256"),
            now.get("sha256"),
        )
        changes = list(recorded.get("changed_on_resume", []))
        return {**recorded, "changed_on_resume": [*changes, now]}
    return recorded


def starts_of(record: Mapping[str, Any]) -> list[str]:
    """The server's starts on a run (first, then resumes), from its ``partition.json`` record."""
    starts = record.get("starts")
    return [s for s in starts if isinstance(s, str)] if isinstance(starts, list) else []


def _recorded_starts(run_dir: RunDir) -> list[str]:
    """The server's starts on this run so far, as ``partition.json`` records them."""
    previous = run_dir.path / "partition.json"
    if not previous.is_file():
        return []
    return starts_of(read_json_object(previous, "the run's partition record"))


def record_start(run_dir: RunDir) -> None:
    """Add this start (UTC, ISO 8601) to ``partition.json``'s ``starts``: first, then resumes.

    Called once :meth:`~server.coordinator.Coordinator.resume` accepted the run (a refused
    resume never ran), so that the summary and the report state when the run began and each
    time it was resumed, not only the last start.
    """
    path = run_dir.path / "partition.json"
    record = read_json_object(path, "the run's partition record")
    record["starts"] = [*starts_of(record), datetime.now(UTC).isoformat(timespec="seconds")]
    atomic_write_bytes(path, (json.dumps(record, indent=1) + "\n").encode())


def recorded_run_id(run_dir: RunDir) -> str | None:
    """The run id the run recorded (its ledger's), whatever the folder is called now.

    A run's id starts as its folder's name; once a checkpoint (or, before the first one, the
    ledger) records it, a folder that was renamed or moved still resumes as the same run,
    against the same ledger.
    """
    state = CheckpointStore(run_dir.checkpoints).latest_state()
    run_id = state.get("run_id") if state is not None else None
    if isinstance(run_id, str) and run_id:
        return run_id
    # No checkpoint yet, but the server may have made the ledger before it died: the ledger's
    # id is the run's (a folder renamed before round 1 would otherwise refuse its own ledger)
    ledger = run_dir.path / "ledger.sqlite"
    if state is None and ledger.is_file():
        try:
            with Ledger.read(ledger) as held:
                return held.run_id or None
        except LedgerError:
            return None  # opening it for the run names the damage
    return None
