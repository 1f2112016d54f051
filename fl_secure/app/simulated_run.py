"""A run directory from the in-process simulation, so that fast runs can be audited too.

:func:`write_simulated_run` runs the simulation engine (:mod:`fl_secure.app.sim`: the gRPC
path's round code without the network; sampled cohorts and client-level DP with its ledger)
and writes the layout ``fl-secure train`` writes (:mod:`fl_secure.runs`): ``config.toml``,
``metrics.jsonl``, ``summary.json`` (with the ``secure_aggregation`` and privacy fields of
:mod:`server.summary`), a checkpoint per round (with its ledger rows and the ledger's signed
head, as the coordinator writes them before the ledger commit), ``ledger.sqlite`` of a
private run; the last checkpoint has FedGC's server-held heads in
``clients-%06d.safetensors``. Clients' private heads are not written: the simulation keeps
them in memory, and neither the server nor another client sees them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fl_secure.app.sim.run import run_simulation
from fl_secure.checkpoints import CheckpointStore
from fl_secure.config import Config, config_to_toml
from fl_secure.runs import RunDir, atomic_write_bytes, new_run_dir
from server.summary import _secure_aggregation as secure_aggregation_summary

if TYPE_CHECKING:
    from fl_secure.app.sim.engine import ExecutorFactory


def write_simulated_run(
    config: Config,
    base: Path,
    *,
    progress: bool = False,
    executor: ExecutorFactory | None = None,
    dropout_rate: float = 0.0,
) -> Path:
    """Simulate ``config`` and write a run directory under ``base``; return its path.

    ``executor``: builds the engine's client executor (default: serial, in this process);
    ``dropout_rate``: securely aggregated rounds, the fraction of a cohort that leaves mid-round.
    """
    run = RunDir(new_run_dir(base, config.run.name))
    atomic_write_bytes(run.config, config_to_toml(config).encode())
    result = run_simulation(
        config, run_dir=run, executor=executor, dropout_rate=dropout_rate, progress=progress
    )
    for record in result.records:
        run.append_metrics(record)
    if result.privacy is not None:
        statement = result.privacy
        privacy: dict[str, Any] = {
            **{
                k: statement[k]
                for k in ("epsilon", "delta", "accountant", "privacy_unit", "noise_placement")
            },
            "privacy": statement,
        }
    else:
        privacy = {
            "epsilon": None,
            "delta": None,
            "accountant": None,
            "privacy_unit": "none",
            "noise_placement": None,
        }
    s = config.server
    summary: dict[str, Any] = {
        **result.summary,
        "rounds_planned": config.train.rounds,
        "num_clients": config.partition.num_clients,
        "cohort_sampling": {
            "clients_per_round": s.clients_per_round,
            "sample_rate": s.sample_rate,
            "draw": "server.membership.Membership.sample_cohort (secrets.SystemRandom)",
        },
        **privacy,
        "secure_aggregation": {
            **secure_aggregation_summary(config, result.records, heads=bool(result.heads)),
            "dropout_rate": dropout_rate,
        },
    }
    run.write_summary(summary)
    if not result.rounds_completed:  # each round's checkpoint is written as it completes
        CheckpointStore(run.checkpoints).save(0, result.params, {"status": result.status})
    return run.path
