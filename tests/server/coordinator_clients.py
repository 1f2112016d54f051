"""In-process test clients of a :class:`server.coordinator.Coordinator`: no transport, no trainer.

Each answers its training tasks with a constant update the way the servicer would pass it
on, so a test drives the coordinator's round logic (cohorts, retries, accounting, influence
bounds) with updates whose mean it knows.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from fl_secure.errors import FlSecureError
from fl_secure.messages import TaskKind, UpdateHeader
from server.coordinator import Coordinator


def answer_every_task(
    coord: Coordinator,
    cid: str,
    value: float = 0.1,
    examples: int = 1,
    refused: list[str] | None = None,
) -> None:
    """Answer every TRAIN task of ``cid`` with ``value`` in every tensor until the run ends.

    An attempt that closes between the task and the upload is skipped, as a real client's
    call would fail. A refused upload is what the servicer does with it: the client fails
    the attempt, and the refusal's text goes to ``refused`` when one is given.
    """
    while True:
        task = coord.poll(cid, 0)
        if task.kind is TaskKind.FINISHED:
            return
        if task.kind is not TaskKind.TRAIN:
            continue
        try:
            _, params = coord.parameters(cid, task.round, task.nonce)
        except FlSecureError:  # the attempt ended meanwhile
            continue
        update = OrderedDict((k, np.full_like(v, value)) for k, v in params.items())
        size = sum(v.nbytes for v in update.values())
        header = UpdateHeader(task.round, task.nonce, examples, {}, len(update), size)
        try:
            ticket = coord.open_upload(cid, header)
        except FlSecureError:
            continue
        error = None
        try:
            coord.commit_upload(ticket, update)
        except FlSecureError as exc:
            if refused is None:
                raise
            error = str(exc)
            refused.append(error)
        finally:
            coord.release_upload(ticket, error)
