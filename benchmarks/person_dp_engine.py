"""Person-level DP through the simulation engine, with the ledger (JSON out).

The acceptance measurement of person-level DP: the rounds are the gRPC coordinator's round
code run by the simulation engine (:mod:`fl_secure.app.sim`, ``docs/simulation.md``), each run
a run directory with its ledger (:func:`fl_secure.app.simulated_run.write_simulated_run`).

1. Pretrain ``cnn-small`` centrally on *public* synthetic identities (identity numbers from
   1,000,000: no device holds one, nor the server's AdaFedFR set ``R``, nor the held-out
   set), CosFace s = 30, m = 0.4; written once as safetensors in ``--work`` and set as
   ``model.pretrained``.
2. Run ``examples/person_dp.toml`` (``partition.kind = "person"``: one identity per device;
   AdaFedFR; only the embedding layer trains) through the engine with the serial executor:
   without DP, then with central client-level DP (= person-level DP) at each target epsilon,
   ``delta = 1 / N``, the noise multiplier calibrated by the engine to the stated epsilon.
   Every run starts from the same pretrained weights; each row runs ``--repeats`` times (the
   cohorts and the noise differ: they come from the CSPRNG).

Prints one JSON object: held-out TAR@FAR=1e-2 / 1e-3 of the pretrained start (the engine's
round-0 evaluation), of the non-private run and of each epsilon (mean, std, every run), the
fraction of the non-private gain each private run keeps,
``(private - start) / (non-private - start)``, the epsilon the run's ledger states (its last
``client_level`` row and ``summary.json``), the noise multiplier and the wall time.

    python benchmarks/person_dp_engine.py                          # 1,000 devices, eps 1, 4, 8
    python benchmarks/person_dp_engine.py --epsilons 8 --rounds 5  # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fl_secure.app.simulated_run import write_simulated_run  # noqa: E402
from fl_secure.config import load_config  # noqa: E402
from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces  # noqa: E402
from fl_secure.models.factory import get_backbone, save_weights  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_FIRST_IDENTITY = 1_000_000  # far from every device's, R's and the held-out identities
FARS = ("1e-2", "1e-3")


def pretrain(args: argparse.Namespace, image_size: int, embedding: int, seed: int) -> Path:
    """Train the whole backbone centrally on the public identities; cache its weights."""
    path = (
        Path(args.work)
        / f"public-{args.public_identities}x{args.public_images}-e{embedding}.safetensors"
    )
    if path.exists():
        return path
    public = generate_synthetic_faces(
        SyntheticFaceConfig(
            num_identities=args.public_identities,
            images_per_identity=args.public_images,
            image_size=image_size,
            seed=seed,
            first_identity=PUBLIC_FIRST_IDENTITY,
        )
    )
    images, labels = public.images, public.labels
    torch.manual_seed(0)
    model = get_backbone("cnn-small", embedding_size=embedding, image_size=image_size)
    classes = torch.nn.Parameter(torch.randn(int(labels.max()) + 1, embedding) * 0.01)
    opt = torch.optim.Adam([*model.parameters(), classes], lr=2e-3)
    for _ in range(args.pretrain_epochs):
        for batch in torch.randperm(len(labels)).split(128):
            emb = F.normalize(model(images[batch]), dim=1)
            cos = emb @ F.normalize(classes, dim=1).T
            cos = cos - 0.4 * F.one_hot(labels[batch], cos.shape[1])
            loss = F.cross_entropy(30.0 * cos, labels[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_weights(model, path)
    return path


def ledger_epsilon(run: Path) -> float | None:
    """The epsilon of the ledger's last client-level release (``None``: no ledger)."""
    if not (run / "ledger.sqlite").exists():
        return None
    with sqlite3.connect(run / "ledger.sqlite") as db:
        rows = db.execute(
            "SELECT payload FROM entries WHERE kind = 'client_level' ORDER BY seq"
        ).fetchall()
    return float(json.loads(rows[-1][0])["epsilon"]) if rows else None


def one_run(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """One engine run of the config with ``overrides``; its held-out figures and ledger."""
    config = load_config(args.config, overrides)
    t0 = time.monotonic()
    run = write_simulated_run(config, Path(args.work) / "runs")
    summary = json.loads((run / "summary.json").read_text())
    privacy = summary.get("privacy") or {}
    return {
        "start": {f: summary["untrained"][f"tar_at_far_{f}"] for f in FARS},
        "tar": {f: summary["held_out"][f"tar_at_far_{f}"] for f in FARS},
        "status": summary["status"],
        "rounds_completed": summary["rounds_completed"],
        "mean_cohort": round(float(np.mean(summary.get("cohort_sizes") or [0])), 1),
        "epsilon_summary": summary.get("epsilon"),
        "epsilon_ledger": ledger_epsilon(run),
        "noise_multiplier": privacy.get("noise_multiplier"),
        # trusts the server's secret, honest Poisson draw (privacy.dp.amplification)
        "epsilon_amplified": privacy.get("epsilon_amplified"),
        "seconds": round(time.monotonic() - t0, 1),
        "run_dir": str(run.relative_to(ROOT)) if run.is_relative_to(ROOT) else str(run),
    }


def main() -> None:
    """Run the comparison and print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "person_dp.toml"))
    parser.add_argument("--work", default=str(ROOT / "runs" / "person-dp-engine"))
    parser.add_argument("--public-identities", type=int, default=500)
    parser.add_argument("--public-images", type=int, default=10)
    parser.add_argument("--pretrain-epochs", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2, help="runs per row (mean, std)")
    parser.add_argument("--epsilons", default="1,4,8")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="config overrides for every run (section.key=value), e.g. train.rounds=15",
    )
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    started = time.monotonic()
    config = load_config(args.config, args.set)
    weights = pretrain(args, config.data.image_size, config.model.embedding_size, config.run.seed)
    population = config.partition.num_clients
    delta = 1.0 / population
    common = [*args.set, f"model.pretrained={json.dumps(str(weights))}"]
    prepared = time.monotonic() - started

    def row(overrides: list[str]) -> dict[str, Any]:
        runs = [one_run(args, [*common, *overrides]) for _ in range(args.repeats)]
        out: dict[str, Any] = {}
        for f in FARS:
            values = [r["tar"][f] for r in runs]
            out[f"tar_at_far_{f}"] = round(float(np.mean(values)), 4)
            out[f"tar_at_far_{f}_std"] = round(float(np.std(values)), 4)
            out[f"tar_at_far_{f}_runs"] = [round(v, 4) for v in values]
        out["runs"] = runs
        return out

    rows: dict[str, dict[str, Any]] = {"non_private": row(["privacy.unit=none"])}
    for eps in [float(e) for e in args.epsilons.split(",") if e]:
        rows[f"epsilon_{eps:g}"] = row(
            [
                "privacy.unit=client",
                "privacy.noise_placement=central",
                "privacy.noise_multiplier=0",
                f"privacy.target_epsilon={eps}",
                f"privacy.delta={delta}",
            ]
        )
    first = rows["non_private"]["runs"][0]["start"]  # every run's round 0: the same start
    starts = {f: sorted({r["start"][f] for x in rows.values() for r in x["runs"]}) for f in FARS}
    for name, r in rows.items():
        if name.startswith("epsilon_"):
            for f in FARS:
                gain = rows["non_private"][f"tar_at_far_{f}"] - first[f]
                mine = r[f"tar_at_far_{f}"] - first[f]
                r[f"gain_kept_{f}"] = round(mine / gain, 3) if gain > 0 else None
    print(
        json.dumps(
            {
                "backend": "simulation engine (fl_secure.app.sim), serial executor",
                "devices": population,
                "identities_per_device": 1,
                "delta": delta,
                "repeats": args.repeats,
                "overrides": args.set,
                "public_pretraining_identities": args.public_identities,
                "pretrained_start": {f"tar_at_far_{f}": first[f] for f in FARS},
                "pretrained_start_every_run": starts,
                "rows": rows,
                "prepare_seconds": round(prepared, 1),
                "total_seconds": round(time.monotonic() - started, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
