"""The in-flight marker beside a run's ledger: an attempt whose release is not yet in it.

The server writes (and syncs) the marker before an attempt's tasks go out, and removes it
once what the server saw of the attempt is in the ledger. A server process that ends in
between leaves it, and the resumed run counts that attempt
(:meth:`privacy.server_round.ServerPrivacy.begin_release`).
"""

from __future__ import annotations

import json
from pathlib import Path

from fl_secure.errors import PrivacyError
from fl_secure.runs import atomic_write_json


def inflight_path(ledger_path: Path) -> Path:
    """Where the marker of ``ledger_path``'s in-flight attempt lives (beside the ledger)."""
    return Path(ledger_path).with_suffix(".inflight.json")


def write_inflight(path: Path, round_: int, attempt: int, cohort_size: int) -> None:
    """Write (atomically, synced) the marker of round ``round_``'s attempt ``attempt``."""
    marker = {"round": round_, "attempt": attempt, "cohort_size": cohort_size}
    atomic_write_json(path, marker)


def read_inflight(path: Path) -> tuple[int, int, int] | None:
    """``(round, attempt, cohort_size)`` of the marker at ``path``; None if there is none.

    Raises:
        PrivacyError: The marker is damaged: the ledger may not count that attempt.
    """
    if not path.exists():
        return None
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
        round_, attempt = int(marker["round"]), int(marker["attempt"])
        cohort = int(marker["cohort_size"])
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise PrivacyError(
            f"the in-flight marker {path} is damaged ({exc}): the last server process "
            "ended during a round whose release the ledger may not count; refusing to "
            "resume until it is restored (or, if that round's updates never left the "
            "clients, removed)"
        ) from exc
    return round_, attempt, cohort
