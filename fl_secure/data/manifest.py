"""A hash of what a run's data was, never the images: generator parameters or a file list.

:func:`server.run_files.write_partition_record` records it in the run's ``partition.json``
when the run starts (and keeps the first one on resume), so that a report states the data the
run trained on, not whatever the folder holds when the report is written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fl_secure.data.folders import IMAGE_SUFFIXES

#: the synthetic manifest's kind; manifests of an earlier kind hashed the table alone
SYNTHETIC_KIND = "synthetic generator parameters and run.seed"


def data_manifest(data: Mapping[str, Any], *, seed: int) -> dict[str, Any]:
    """The manifest of a ``[data]`` table (as a dict) under the run's ``run.seed``.

    Synthetic data: SHA-256 of the table and the seed (the generator is deterministic in the
    two). Folders: SHA-256 over the sorted relative paths and SHA-256 of every image file
    under the data root (other files, such as a README, are not data and are left out);
    CelebA adds its two annotation files, which give the labels and attributes.
    """
    source = data.get("source", "synthetic")
    if source == "synthetic":
        text = json.dumps({"data": dict(data), "seed": seed}, sort_keys=True, default=str)
        return {"kind": SYNTHETIC_KIND, "sha256": hashlib.sha256(text.encode()).hexdigest()}
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
    manifest: dict[str, Any] = {
        "kind": "image files (relative path + SHA-256 of each)",
        "files": count,
    }
    if source == "celeba":  # the labels and attributes are in these, not in the images
        manifest["kind"] = "image files and annotation files (SHA-256 of each)"
        for key in ("identities_file", "attributes_file"):
            annotation = Path(str(data.get(key) or ""))
            if not annotation.is_file():
                return {**manifest, "sha256": None, "note": f"{key} {annotation} not readable here"}
            digest.update(key.encode() + b"\0" + hashlib.sha256(annotation.read_bytes()).digest())
    return {**manifest, "sha256": digest.hexdigest()}
