"""A hash of what a run's data was, never the images: generator parameters or a file list.

:func:`server.setup.build_server` records it in the run's ``partition.json`` when the run
starts (and keeps the first one on resume), so that a report states the data the run trained
on, not whatever the folder holds when the report is written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fl_secure.data.folders import IMAGE_SUFFIXES


def data_manifest(data: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest of a ``[data]`` table (as a dict).

    Synthetic data: SHA-256 of the table (the generator is deterministic in it). Folders:
    SHA-256 over the sorted relative paths and SHA-256 of every image file under the data
    root (other files, such as a README, are not data and are left out).
    """
    source = data.get("source", "synthetic")
    if source == "synthetic":
        text = json.dumps(dict(data), sort_keys=True, default=str).encode()
        return {
            "kind": "synthetic generator parameters",
            "sha256": hashlib.sha256(text).hexdigest(),
        }
    root = Path(str(data.get("root") or data.get("path") or ""))
    if not root.is_dir():
        return {"kind": "files", "sha256": None, "note": f"data folder {root} not readable here"}
    digest = hashlib.sha256()
    count = 0
    images = (
        p
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES
    )
    for f in sorted(images):
        digest.update(f.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(f.read_bytes()).digest())
        count += 1
    return {
        "kind": "image files (relative path + SHA-256 of each)",
        "files": count,
        "sha256": digest.hexdigest(),
    }
