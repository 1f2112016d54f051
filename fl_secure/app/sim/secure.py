"""A simulated round's secure aggregation: the cohort's uploads masked, summed and unmasked.

Each cohort member's upload (already clipped, and noised by a ``local`` placement) is
encoded as the gRPC client encodes it (:func:`privacy.secagg.in_process.encode_update`:
fixed point, or the distributed discrete Gaussian with the client's integer noise share),
and the cohort runs a real SecAgg / SecAgg+ round in this process
(:func:`privacy.secagg.in_process.run_cohort_round`, the gRPC path's protocol objects, with
the setup the coordinator would send: :func:`~privacy.secagg.in_process.cohort_setup`).
Dropouts are injected (:func:`~privacy.secagg.in_process.random_dropouts`): ``round(rate
n)`` members of a cohort of ``n`` leave, each at a stage drawn uniformly from advertise ..
unmask. The server then gets only the survivors' sum, turned into the round's update as the
coordinator's relay does it (:meth:`server.secure_relay.SecureRelay.mean`): ``(sum + central
noise) / W`` under client-level DP (:meth:`~privacy.server_round.ServerPrivacy.finish_sum`),
the survivors' mean otherwise.
"""

from __future__ import annotations

import hashlib
import math
import random
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from privacy.secagg.in_process import (
    cohort_setup,
    encode_update,
    random_dropouts,
    run_cohort_round,
)
from privacy.secagg.vectors import unflatten

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from fl_secure.config import Config
    from fl_secure.messages import Tensors, TensorSpec
    from privacy.server_round import ServerPrivacy


@dataclass(frozen=True)
class SecureOutcome:
    """One secure attempt: the round's update (None if it aborted) and its record."""

    mean: Tensors | None
    survivors: tuple[str, ...]
    record: dict[str, Any]
    # an aborted round that reached its unmask stage: the server may have seen the sum
    sum_seen: bool = False


def injected_dropouts(
    seed: int, number: int, attempt: int, cohort: Sequence[str], rate: float
) -> dict[str, int]:
    """Who leaves the round at which stage (reproducible: failures, not secrets)."""
    if rate <= 0:
        return {}
    digest = hashlib.sha256(f"{seed}:dropouts:{number}:{attempt}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "little"))  # noqa: S311 - not a secret
    return random_dropouts(cohort, rate, rng=rng)


def secure_round(
    config: Config,
    privacy: ServerPrivacy | None,
    specs: Sequence[TensorSpec],
    uploads: Mapping[str, Tensors],
    *,
    number: int,
    attempt: int,
    dropout_rate: float = 0.0,
) -> SecureOutcome:
    """Mask, sum and unmask ``uploads`` (client id -> shared tensors) in a real round."""
    plan = privacy.plan if privacy is not None else None
    ddg = None
    if plan is not None and plan.placement == "distributed":  # as SecureRelay._ddg
        ddg = (plan.noise_multiplier, plan.clip_norm, config.server.min_clients)
    cohort = list(uploads)
    setup = cohort_setup(
        config.secure_aggregation,
        cohort,
        sum(math.prod(s.shape) for s in specs),
        round_id=secrets.token_bytes(16),
        ddg=ddg,
        min_inputs=config.server.min_clients,
    )
    encoded = {c: encode_update(setup, uploads[c]) for c in cohort}
    drops = injected_dropouts(config.run.seed, number, attempt, cohort, dropout_rate)
    result = run_cohort_round(setup, encoded, round_id=setup.round_id, dropouts=drops)
    record: dict[str, Any] = {
        "scheme": "secagg" if setup.neighbours == 0 else "secagg+",
        "cohort": cohort,
        "neighbours": setup.neighbours or len(cohort) - 1,
        "threshold": setup.threshold,
        "modulus_bits": setup.modulus_bits,
        "survivors": list(result.survivors) if result.aborted is None else [],
        "dropped": dict(sorted(drops.items())),
        "left": sorted(result.left),
        "aborted": result.aborted or "",
        "bytes_up_per_client": result.stats.get("bytes_up_per_client"),
        "bytes_down_per_client": result.stats.get("bytes_down_per_client"),
    }
    if result.aborted is not None or result.decoded is None or not result.survivors:
        return SecureOutcome(None, (), record, sum_seen="seconds.unmask" in result.stats)
    total = unflatten(result.decoded, list(specs))
    if plan is not None:  # client-level DP: (sum + central noise) / W
        assert privacy is not None
        mean = privacy.finish_sum(total, list(specs))
    else:
        m = len(result.survivors)
        mean = OrderedDict((s.name, (total[s.name] / m).astype(s.dtype)) for s in specs)
    return SecureOutcome(mean, tuple(result.survivors), record)
