"""What a run's rounds leave in ``metrics.jsonl``, and the log of every attempt.

One object per completed round (``"round": n``, round 0 the untrained model), and one per
failed attempt (``"kind": "aborted"``): retried or the end of the run, each is recorded, so the
report can list them; readers of completed rounds skip records with a ``kind``.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fl_secure.messages import TaskKind
    from fl_secure.runs import RunDir
    from server.attempt import Attempt


class RoundRecords:
    """Writes the round records of a run directory and keeps the attempts' events."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        #: One event per attempt that drew a cohort: who was in it, who delivered, who failed.
        self.events: list[dict[str, Any]] = []

    def attempt_event(
        self, rnd: Attempt, secure_record: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Log the attempt's cohort and outcome; return the event."""
        event: dict[str, Any] = {
            "round": rnd.number,
            "attempt": rnd.attempt,
            "kind": rnd.kind.value,
            "cohort": sorted(rnd.cohort),
            "received": sorted(rnd.received),
            "failed": rnd.failed,
            "dropped": sorted(rnd.pending),
        }
        if rnd.capped:  # the server's cap on an update's weight (server.influence)
            event["weights_capped"] = dict(sorted(rnd.capped.items()))
        if secure_record is not None:
            event["secure_aggregation"] = secure_record
        self.events.append(event)
        return event

    def last_event(self, number: int) -> dict[str, Any] | None:
        """The last attempt's event, if it was one of round ``number``."""
        return self.events[-1] if self.events and self.events[-1]["round"] == number else None

    def untrained(self, record: dict[str, Any]) -> None:
        """Round 0's record: the untrained model's scores, the baseline of every later round."""
        self.run_dir.append_metrics(record)

    def completed(
        self,
        rnd: Attempt,
        *,
        secure: dict[str, Any] | None = None,
        bytes_per_client: dict[str, int] | None = None,
        privacy: dict[str, Any] | None = None,
        held_out: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Write a completed round's record: its attempt, updates, clients, privacy, scores."""
        record: dict[str, Any] = {
            "round": rnd.number,
            "attempt": rnd.attempt,
            "cohort_size": len(rnd.cohort),
            "num_updates": len(rnd.received),
            "dropped": sorted(rnd.pending),
            "failed": rnd.failed,
            "num_examples": sum(h.num_examples for h in rnd.received.values()),
            "duration_s": round(time.monotonic() - rnd.started, 3),
            "clients": {c: h.metrics for c, h in sorted(rnd.received.items())},
        }
        if rnd.capped:
            record["weights_capped"] = dict(sorted(rnd.capped.items()))
        if secure is not None:
            record["secure_aggregation"] = secure
        if bytes_per_client is not None:
            record["bytes_per_client"] = bytes_per_client
        if privacy is not None:
            record["privacy"] = privacy
            record["epsilon"] = privacy["epsilon"]
        if held_out is not None:
            record["held_out"] = held_out
        self.run_dir.append_metrics(record)
        return record

    def failed_attempt(
        self,
        number: int,
        attempt: int,
        kind: TaskKind,
        reason: str,
        event: dict[str, Any] | None = None,
    ) -> None:
        """A failed attempt of round ``number``, in metrics.jsonl as ``"kind": "aborted"``.

        ``event``: the attempt's cohort, updates received, failures and secure-aggregation
        record, when it got that far.
        """
        record: dict[str, Any] = {
            "kind": "aborted",
            "round": number,
            "attempt": attempt,
            "task": kind.value,
            "reason": reason,
        }
        keys = ("cohort", "received", "failed", "dropped", "secure_aggregation")
        record |= {k: event[k] for k in keys if event is not None and k in event}
        self.run_dir.append_metrics(finite_or_none(record))


def finite_or_none(value: Any) -> Any:
    """``value`` with NaN/Inf floats (at any depth) as None: metrics.jsonl is strict JSON.

    A finite model can still evaluate to NaN (its embeddings overflow float32); the round's
    record says so with a null instead of the write failing after the round was aggregated.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def describe_shortfall(failed: dict[str, str], silent: list[str]) -> str:
    """Why a round's cohort fell short, one clause per reason (for the abort message).

    The same refusal from every client (a diverged training's non-finite loss, say) reads
    once with the clients it hit, so the user learns the cause from the command's own
    output instead of from the server's log.
    """
    by_reason: dict[str, list[str]] = {}
    for client, reason in sorted(failed.items()):
        by_reason.setdefault(reason, []).append(client)
    parts = [f"{', '.join(clients)}: {reason}" for reason, clients in by_reason.items()]
    if silent:
        parts.append(f"{', '.join(silent)}: sent nothing before the round's timeout")
    return "; ".join(parts)
