"""Cost-only mode for cohorts too large to mask in a simulation: NOT secure aggregation.

:func:`cost_only_round` sums the survivors' encoded vectors **in the clear** and reports
what a real SecAgg / SecAgg+ round would have cost, from one real round
(:func:`~privacy.secagg.in_process.run_cohort_round`) measured at a smaller cohort and
scaled by a stated linear model. Its result says so (``mode`` is :data:`COST_ONLY`,
``stats["secure"]`` is 0.0): a run that uses it has no secure aggregation, and its report
must not claim any. The sum itself is what a real round would release for the same
survivors (bit-exact: the masks cancel), so the learning is unchanged.

The model, for a cohort of ``n`` with ``k`` neighbours from a probe of ``n_p`` with ``k_p``:
a client's compute grows with the masks it expands (``k + 1`` keystreams of ``d`` words),
the server's with ``n (k + 1)``; a client sends its masked vector plus ``k`` shares (twice)
and receives every advertisement, the survivor list and the signatures (``~n``). Checked
against real rounds up to ``n = 200`` (``python benchmarks/secagg_in_process.py``: within
1.4x of the measured seconds, 1.3x of the bytes); beyond that each client's parsing of ``n``
advertisements and signatures makes a real round grow faster than the model.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Mapping

import numpy as np

from fl_secure.config import SecureAggregationConfig
from privacy.secagg.arithmetic import modulus_mask
from privacy.secagg.in_process import (
    CohortSum,
    check_dropouts,
    cohort_setup,
    resolve_setup,
    run_cohort_round,
)
from privacy.secagg.round_setup import RoundSetup
from privacy.secagg.server_round import decode_total
from privacy.secagg.stages import ADVERTISE, CONSISTENCY, DONE, MASKED, wire_dtype

#: ``CohortSum.mode`` of a cost-only round.
COST_ONLY = "cost-only: NOT secure aggregation (the inputs were summed in the clear)"


@functools.lru_cache(maxsize=16)
def _probe(
    cfg: SecureAggregationConfig, vector_length: int, n: int
) -> tuple[tuple[str, float], ...]:
    ids = [f"probe-{i:05d}" for i in range(n)]
    setup = cohort_setup(cfg, ids, vector_length, round_id=secrets.token_bytes(16))
    zeros = np.zeros(vector_length, dtype=np.uint64)  # encodes 0: a valid input
    result = run_cohort_round(setup, dict.fromkeys(ids, zeros), round_id=setup.round_id)
    if result.aborted:  # pragma: no cover - no dropouts: it cannot abort
        raise RuntimeError(f"the cost probe's round aborted: {result.aborted}")
    return tuple(result.stats.items())


def probe_costs(cfg: SecureAggregationConfig, vector_length: int, n: int = 20) -> dict[str, float]:
    """The stats of one real round of ``n`` clients at this ``vector_length`` (no dropouts).

    Measured once per process for each ``(cfg, vector_length, n)``.
    """
    return dict(_probe(cfg, vector_length, n))


def cost_only_round(
    setup_or_config: RoundSetup | SecureAggregationConfig,
    encoded: Mapping[str, np.ndarray],
    *,
    round_id: bytes,
    dropouts: Mapping[str, int] | None = None,
    probe: Mapping[str, float] | None = None,
    probe_size: int = 20,
) -> CohortSum:
    """NOT secure aggregation: the survivors' plain modular sum, with a real round's modelled cost.

    Who survives follows the injected ``dropouts`` (as in
    :func:`~privacy.secagg.in_process.run_cohort_round`): a client's input is in the sum if
    it uploaded (dropped after the masked-input stage or never). The round is counted as
    aborted when too few advertise, upload or sign for the cohort-wide thresholds; the
    per-neighbourhood thresholds of SecAgg+ are not modelled.

    Args:
        setup_or_config: As for ``run_cohort_round``.
        encoded: Client id -> its encoded vector.
        round_id: The round's id (as for a real round).
        dropouts: Client id -> the stage from which it sends nothing.
        probe: Stats of a real round at the same vector length (``CohortSum.stats``); when
            None one is measured with ``probe_size`` clients (:func:`probe_costs`, needs a
            config, not a setup).
        probe_size: Clients of the measured probe round.

    Returns:
        A :class:`CohortSum` with ``mode`` :data:`COST_ONLY` and ``stats["secure"] = 0.0``;
        ``stats`` holds the probe's figures (``probe.*``) and the modelled cost of a real
        round of this cohort (``modelled.*``).
    """
    setup = resolve_setup(setup_or_config, encoded, round_id)
    drops = check_dropouts(dropouts, setup.cohort)
    if probe is None:
        if not isinstance(setup_or_config, SecureAggregationConfig):
            raise ValueError("a cost-only round from a setup needs probe= stats of a real round")
        probe = probe_costs(setup_or_config, setup.vector_length, probe_size)
    if probe.get("secure") != 1.0 or probe.get("bytes_masked_per_client") != float(
        setup.vector_length * wire_dtype(setup).itemsize
    ):
        raise ValueError("probe must be the stats of a real round at the same vector length")
    config, n = setup.config(), len(setup.cohort)
    stage = {c: drops.get(c, DONE) for c in setup.cohort}
    advertised = sum(s > ADVERTISE for s in stage.values())
    survivors = tuple(c for c in setup.cohort if stage[c] > MASKED)
    signers = sum(stage[c] > CONSISTENCY for c in survivors)
    aborted = None
    if advertised < config.min_adverts:
        aborted = f"{advertised} advertised keys, the round needs {config.min_adverts}"
    elif len(survivors) < max(config.threshold + 1, config.min_inputs):
        aborted = f"{len(survivors)} masked inputs, fewer than the round may unmask"
    elif signers < config.consistency_threshold:
        need = config.consistency_threshold
        aborted = f"{signers} signed the survivor set, the consistency check needs {need}"
    k, kp, np_ = config.degree, probe["k"], probe["n"]
    masked = probe["bytes_masked_per_client"]
    per_client = probe["seconds.clients"] / np_ * (k + 1) / (kp + 1)
    server = probe["seconds.server"] * n * (k + 1) / (np_ * (kp + 1))
    stats = {f"probe.{key}": value for key, value in probe.items()}
    stats.update(
        {
            "n": float(n),
            "k": float(k),
            "t": float(config.threshold),
            "survivors": float(0 if aborted else len(survivors)),
            "secure": 0.0,
            "modelled.seconds_per_client": per_client,
            "modelled.seconds_server": server,
            "modelled.seconds_round": per_client * n + server,
            "modelled.bytes_up_per_client": masked
            + (probe["bytes_up_per_client"] - masked) * k / kp,
            "modelled.bytes_down_per_client": probe["bytes_down_per_client"] * n / np_,
        }
    )
    if aborted:
        return CohortSum(None, (), f"{COST_ONLY}: modelled abort: {aborted}", stats, COST_ONLY)
    total = np.zeros(setup.vector_length, dtype=np.uint64)
    for c in survivors:  # uint64 wraps mod 2^64, and 2^bits divides it
        total += np.asarray(encoded[c], dtype=np.uint64)
    total &= modulus_mask(setup.modulus_bits)
    decoded = decode_total(setup, total, len(survivors))
    return CohortSum(total, survivors, None, stats, COST_ONLY, decoded)
