"""Resuming a run on its ledger: the ledger must be the record of the run's checkpoints.

A server that resumes a run rebuilds its accountant from the ledger
(:meth:`privacy.server_round.ServerPrivacy.resume`). Before it does, the ledger must exist
where the run left it, verify (chain, every epsilon recomputed, and, opened with the server's
key, the signed head and its copies in the run folder against that key), record no round
after the last checkpoint
(:func:`resumable_entries`), and account its rounds under a cohort sampling the next rounds
compose with (:func:`check_same_sampling`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fl_secure.errors import PrivacyError
from privacy.dp.accountants.accountant import ADJACENCY
from privacy.ledger.anchors import run_anchors
from privacy.ledger.entries import CLIENT_KINDS, Entry
from privacy.ledger.run_ledger import Ledger

if TYPE_CHECKING:
    from privacy.dp.client_level import ClientLevelPlan

log = logging.getLogger(__name__)


def resumable_entries(ledger: Ledger, completed_round: int) -> list[Entry]:
    """The ledger's entries, once it is shown to be the record of ``completed_round`` rounds.

    A ledger :meth:`~privacy.ledger.run_ledger.Ledger.open` has just created is not the run's
    record: it is closed and removed again.

    Raises:
        PrivacyError: The ledger does not exist (after completed rounds), its chain is broken,
            a row's epsilon is not what its parameters give, the signed head or a copy of it
            does not match (a dropped tail, a rewritten chain, another key), or it records
            rounds after the last checkpoint (it does not belong to this run's checkpoints).
    """
    if completed_round > 0 and ledger.created:
        ledger.close()  # the empty ledger made just now is not the run's record
        ledger.path.unlink(missing_ok=True)
        raise PrivacyError(
            f"the run completed {completed_round} rounds but its privacy ledger "
            f"{ledger.path} does not exist (deleted or moved?); refusing to resume "
            "without it: restore it, or start a new run"
        )
    anchors = None
    if ledger.signer is not None:  # the server's own key: nothing in the run folder decides it
        pinned = ledger.signer.public_key
        anchors = run_anchors(ledger.path.parent, ledger.path, pinned_key=pinned)
    check = ledger.verify(anchors=anchors, recompute=True)
    if not check.ok:
        raise PrivacyError(
            f"the privacy ledger {ledger.path} fails verification; refusing to resume "
            f"on it: {'; '.join(check.problems[:3])}"
        )
    if anchors is not None and (check.unsigned_after or anchors.head is None):
        if check.unsigned_after:
            log.warning(
                "the ledger's last %d entries were committed but not signed (the server "
                "stopped in between); they verify, and are signed now",
                check.unsigned_after,
            )
        ledger.sign_head()
    entries = ledger.entries()
    # a note (a budget stop) names the round that did not run: not a release
    # nor does a discarded sum of the round that aborted (it runs again on resume)
    later = sorted(
        {
            e.round
            for e in entries
            if e.round > completed_round
            and e.kind != "note"
            and not (e.kind == "discarded_sum" and e.round == completed_round + 1)
        }
    )
    if later:
        raise PrivacyError(
            f"the ledger records rounds {later} after the last checkpoint (round "
            f"{completed_round}); it does not match this run's checkpoints"
        )
    return entries


def check_same_sampling(entries: Sequence[Entry], plan: ClientLevelPlan | None) -> None:
    """Refuse to resume under a cohort sampling the ledger's rounds cannot compose with.

    The population is the enrolled set, read when the server starts: a site enrolled
    since (or one removed) changes it. Rounds at another population compose exactly (each
    ledger row keeps its own sample rate and population), but with a fixed
    ``server.clients_per_round`` the change can turn full-participation (Poisson, add/remove
    adjacency) cohorts into fixed-size ones (replace-one), or back, which no accountant
    composes; the round would train and then fail to be accounted.
    """
    rows = [e.payload for e in entries if e.kind in CLIENT_KINDS]
    if plan is None or not rows:
        return
    last = rows[-1]
    was, now = str(last.get("sampling", "poisson")), plan.sampling
    before = last.get("population")
    if was != now:
        kind = {"poisson": "Poisson-sampled", "fixed_size": "fixed-size"}
        raise PrivacyError(
            f"the ledger accounts its rounds with {kind.get(was, was)} cohorts of "
            f"{before} enrolled clients; with the {plan.population} enrolled now, "
            f"server.clients_per_round makes them {kind.get(now, now)}, which no "
            f"accountant composes with those ({ADJACENCY.get(was, was)} vs "
            f"{ADJACENCY[now]} adjacency): resume with the clients the run started with, "
            "or start a new run"
        )
    if before != plan.population:
        log.warning(
            "the enrolled population changed from %s to %d since the last round: the "
            "next rounds are accounted at sample rate %.4g, composed with the ledger's",
            before,
            plan.population,
            plan.sample_rate,
        )
