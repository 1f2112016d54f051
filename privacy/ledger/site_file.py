"""The site ledger's file (``site_ledger.json``): its format, versions, and strict reading."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from fl_secure.errors import PrivacyError
from fl_secure.runs import atomic_write_json
from privacy.ledger.site_release import Release

FORMAT = "fl-secure site ledger"
VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Version 1 rows lack the DP-SGD fields: an example-level one counts as unbounded."""


@dataclass
class SiteRecords:
    """What a site ledger's file holds.

    Attributes:
        releases: Every update that left the site.
        secure_rounds: Secure-aggregation round ids (hex) the site has taken part in.
        run_configs: Each run id's config SHA-256, from the site's first join of it.
        evaluations: Evaluation tasks answered: (run id, round, nonce hex).
    """

    releases: list[Release]
    secure_rounds: list[str]
    run_configs: dict[str, str]
    evaluations: list[tuple[str, int, str]]


def read_site_records(path: Path) -> SiteRecords:
    """Read a site ledger's file strictly.

    Raises:
        PrivacyError: Naming the file and what is wrong with it (it is left as it is).
    """
    where = str(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise PrivacyError(
            f"the site ledger {where} cannot be read ({exc}); it is left as it is: restore "
            "it from a backup (starting a new one forgets what this site has released)"
        ) from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PrivacyError(f"{where} is not a site ledger (format {FORMAT!r} expected)")
    version = doc.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise PrivacyError(f"{where}: site ledger version {version!r} is unknown")
    rows = doc.get("releases")
    if not isinstance(rows, list):
        raise PrivacyError(f"{where}: 'releases' must be a list")
    releases = [Release.from_dict(row, where) for row in rows]
    ids = doc.get("secure_round_ids", [])
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise PrivacyError(f"{where}: 'secure_round_ids' must be a list of strings")
    runs = doc.get("run_configs", {})
    if not isinstance(runs, dict) or not all(isinstance(v, str) for v in runs.values()):
        raise PrivacyError(f"{where}: 'run_configs' must map run ids to SHA-256 strings")
    evaluations = doc.get("evaluations", [])
    ok = isinstance(evaluations, list) and all(
        isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
        and type(e[1]) is int and isinstance(e[2], str)
        for e in evaluations
    )  # fmt: skip
    if not ok:
        raise PrivacyError(f"{where}: 'evaluations' must be a list of [run, round, nonce]")
    return SiteRecords(releases, ids, runs, [(e[0], e[1], e[2]) for e in evaluations])


def write_site_records(path: Path, records: SiteRecords) -> None:
    """Write a site ledger's file atomically (its folder made if need be)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        path,
        {
            "format": FORMAT,
            "version": VERSION,
            "releases": [asdict(r) for r in records.releases],
            "secure_round_ids": records.secure_rounds,
            "run_configs": records.run_configs,
            "evaluations": [list(e) for e in records.evaluations],
        },
    )
