"""A run directory from the in-process simulation, so that fast runs can be audited too.

:func:`write_simulated_run` runs :func:`fl_secure.app.simulation.simulate` (the gRPC path's
algorithm code without the network; non-private, no secure aggregation) and writes the layout
``fl-secure train`` writes (:mod:`fl_secure.runs`): ``config.toml``, ``metrics.jsonl``,
``summary.json`` (with the ``secure_aggregation`` and privacy fields of
:mod:`server.summary`) and the final checkpoint, including FedGC's server-held heads in
``clients-%06d.safetensors``. Clients' private heads are not written: the simulation keeps
them in memory, and neither the server nor another client sees them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fl_secure.app.simulation import simulate
from fl_secure.checkpoints import CheckpointStore
from fl_secure.config import Config, config_to_toml
from fl_secure.runs import RunDir, atomic_write_bytes, new_run_dir


def write_simulated_run(config: Config, base: Path, *, progress: bool = False) -> Path:
    """Simulate ``config`` and write a run directory under ``base``; return its path."""
    result = simulate(config, progress=progress)
    run = RunDir(new_run_dir(base, config.run.name))
    atomic_write_bytes(run.config, config_to_toml(config).encode())
    for record in result.records:
        run.append_metrics(record)
    heads = bool(result.heads)
    sees = "every client's update and class embeddings" if heads else "every client's update"
    summary: dict[str, Any] = {
        **result.summary,
        "rounds_planned": config.train.rounds,
        "num_clients": config.partition.num_clients,
        "epsilon": None,
        "delta": None,
        "accountant": None,
        "privacy_unit": "none",
        "noise_placement": None,
        "secure_aggregation": {"scheme": "none", "server_sees": sees},
    }
    run.write_summary(summary)
    CheckpointStore(run.checkpoints).save(
        config.train.rounds,
        result.params,
        {"status": "completed"},
        client_tensors=result.heads or None,
    )
    return run.path
