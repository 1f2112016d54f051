"""The report's provenance section: versions, times, the config's hash and the data manifest."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from fl_secure.config import config_from_dict
from fl_secure.data.manifest import data_manifest
from fl_secure.errors import FlSecureError
from fl_secure.runs import read_json_object


def provenance_section(
    path: Path, summary: dict[str, Any], config: dict[str, Any], config_text: bytes
) -> dict[str, Any]:
    """Versions, start/resume/end times, the SHA-256 of ``config.toml``, the data manifest."""
    prov = summary.get("provenance") or {}
    return {
        "version": prov.get("version", summary.get("version")),
        "commit": prov.get("commit"),
        "packages": prov.get("packages", {}),
        "started_at": prov.get("started_at"),
        # the server's later starts on the run (--resume); absent from older summaries
        "resumed_at": [s for s in prov.get("resumed_at") or [] if isinstance(s, str)],
        "ended_at": prov.get("ended_at"),
        "config_sha256": hashlib.sha256(config_text).hexdigest(),
        # model.pretrained: the weights' file and SHA-256 (and a built-in's source); None for
        # a random start
        "pretrained": prov.get("pretrained"),
        "data_manifest": _recorded_manifest(path, config),
        "source": "summary.json (provenance), config.toml, partition.json (data manifest)",
    }


def _recorded_manifest(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The data manifest ``partition.json`` recorded when the run started.

    Runs written before it was recorded get one computed now, said as such.
    """
    partition = path / "partition.json"
    if partition.is_file():
        recorded = read_json_object(partition, "the run's partition record")
        manifest = recorded.get("data_manifest")
        if isinstance(manifest, dict):  # with "changed_on_resume" when a resume saw other data
            return manifest

    try:  # the table with its defaults filled in, as the server hashes it
        parsed = config_from_dict(config)
        data, seed = dataclasses.asdict(parsed.data), parsed.data_seed
    except FlSecureError:
        data, seed = config.get("data", {}), 0
    return {
        **data_manifest(data, seed=seed),
        "note": "computed when this report was written: the run recorded no data manifest",
    }
