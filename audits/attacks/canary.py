"""The empirical epsilon of a run's client-level mechanism, beside the accountant's epsilon.

The mechanism is the one ``summary.json`` states (:mod:`audits.mechanism`), run on
worst-case canaries (:mod:`audits.mechanism_audit`). Unless its size is given, the audit is
sized to test the run's claim (:func:`audits.mechanism_audit.audit_size`).
"""

from __future__ import annotations

from typing import Any

from audits.mechanism import mechanism_of_run
from audits.mechanism_audit import (
    MAX_AUTO_TRIALS,
    MIN_AUDIT_TRIALS,
    audit_mechanism,
    audit_size,
)
from audits.observations import RunContext


def canary_attack(
    run: RunContext, *, canaries: int | None, trials: int | None, seed: int
) -> dict[str, Any]:
    """The canary audit of the run's mechanism, and how its size was chosen.

    Args:
        run: the audited run.
        canaries: canaries of the one-run audit; None: the size of
            :func:`audits.mechanism_audit.audit_size`.
        trials: trials of the Clopper-Pearson audit (``--canary-trials``); None: sized so.
        seed: the audit's randomness (inclusion bits, noise).
    """
    mech = mechanism_of_run(
        run.summary,
        num_clients=len(run.plan.clients),
        min_clients=run.config.server.min_clients,
        rounds=run.config.train.rounds,
        source=str(run.path / "summary.json"),
    )
    size = audit_size(mech)
    return {
        **audit_mechanism(mech, canaries=canaries or size, trials=trials or size, seed=seed),
        "size_chosen": "--canary-trials"
        if trials is not None
        else "to test the accountant's epsilon (at least "
        f"{MIN_AUDIT_TRIALS}, at most {MAX_AUTO_TRIALS})",
    }
