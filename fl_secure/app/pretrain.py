"""A grid's shared pretrained start: one backbone trained centrally on public identities.

The seed papers fine-tune a backbone pretrained on public faces (HF-MAML, AdaFedFR, FedGC);
a grid that starts each cell from random weights compares the methods in another regime. An
experiment file's optional table::

    [experiment.pretrain]
    identities = 200            # public synthetic identities trained on (default 200)
    images_per_identity = 20    # default 20
    held_out_identities = 20    # of them, kept out of training to score the pretraining
    passes = 10                 # passes over the public images (train.rounds of the run)
    set = ["train.lr=0.002"]    # overrides of the pretraining run only (after the grid's)

trains **one** backbone with :func:`fl_secure.app.centralized.train_centralized_model` (the
code of ``fl-secure train --centralized``) on the synthetic generator's identities
``data.num_identities, data.num_identities + 1, ...`` under the grid's data seed
(``partition_seed``). A site's identities are ``0 .. data.num_identities - 1`` of that seed
(its held-out identities and held-out clients included), and a synthetic identity depends on
``(seed, index)`` only, so the public identities are disjoint from every site's. AdaFedFR's and
FedFR-public's public set (:func:`fl_secure.algorithms.adafedfr.public_dataset`) is the first
``algorithm.public_identities`` of these same identities, so the server's representations
``R`` describe identities the backbone was pretrained on, as in the paper.

The backbone is cached as ``pretrain/<key>/backbone.safetensors`` in the grid's output folder,
where ``<key>`` is the SHA-256 of the pretraining run's full config and of the public faces'
settings: a rerun with the same settings (``--overwrite``) reuses it, and any change trains a
new one. Every cell then sets ``model.pretrained`` to that file, so every cell starts from
the same bytes; ``pretrain.json`` next to it states its settings, held-out scores and digest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import tomllib
from pathlib import Path
from typing import Any

from fl_secure.app.centralized import train_centralized_model
from fl_secure.config import Config, config_to_toml, load_config, parse_override
from fl_secure.data.plan import plan_federation
from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces
from fl_secure.data.types import FaceDataset
from fl_secure.errors import ConfigError, RoundAborted
from fl_secure.models import save_weights
from fl_secure.runs import atomic_write_bytes

#: Settings each run of the pretraining fixes (a single site, no privacy, no network).
FIXED = (
    "algorithm.name=fedavg",
    "partition.kind=equal",
    "partition.num_clients=1",
    "partition.held_out_clients=0",
    "server.min_clients=1",
    "privacy.unit=none",
    "secure_aggregation.scheme=none",
    'data.degrade=""',
    'model.pretrained=""',
    "train.local_steps=0",
    "train.local_epochs=1",
)
#: The model's keys the pretraining shares with every cell (its ``set`` may not change them).
FROZEN_MODEL = (["model", "backbone"], ["model", "embedding_size"], ["model", "pretrained"])
#: Keys of ``[experiment.pretrain]``.
KEYS = ("identities", "images_per_identity", "held_out_identities", "passes", "seed", "set")


@dataclasses.dataclass(frozen=True)
class Pretrain:
    """``[experiment.pretrain]``: the public pretraining every cell of a grid starts from."""

    identities: int = 200
    images_per_identity: int = 20
    held_out_identities: int = 20
    passes: int = 10
    seed: int = 0  # run.seed of the pretraining (initialisation, batch order)
    overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key in ("identities", "images_per_identity", "passes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"experiment.pretrain.{key} = {value!r}: expected an integer >= 1"
                )
        held = self.held_out_identities
        if isinstance(held, bool) or not isinstance(held, int) or not 0 <= held < self.identities:
            raise ConfigError(
                f"experiment.pretrain.held_out_identities = {held!r}: expected an integer in "
                f"[0, identities = {self.identities})"
            )
        if self.images_per_identity < 2:
            raise ConfigError(
                "experiment.pretrain.images_per_identity must be >= 2 (each identity's images "
                "split into train and test)"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"experiment.pretrain.seed = {self.seed!r}: expected an integer >= 0")


def parse_pretrain(table: Any, grid_overrides: list[str]) -> Pretrain:
    """``[experiment.pretrain]`` checked (unknown keys and bad values are refused).

    ``grid_overrides``: the grid's ``set``, which may not give a start of its own.
    """
    if not isinstance(table, dict):
        raise ConfigError("experiment.pretrain must be a table (e.g. pretrain = {passes = 10})")
    if any(parse_override(o)[0] == ["model", "pretrained"] for o in grid_overrides):
        raise ConfigError(
            "experiment.set holds model.pretrained and [experiment.pretrain] trains one: "
            "give one start (remove one of them)"
        )
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise ConfigError(
            f"unknown key {', '.join(unknown)} in [experiment.pretrain]; allowed: {', '.join(KEYS)}"
        )
    overrides = table.get("set", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError('experiment.pretrain.set must be a list of "section.key=value" strings')
    for override in overrides:
        keys = parse_override(override)[0]
        if keys[0] in ("data", "partition") or keys in FROZEN_MODEL:
            raise ConfigError(
                f"experiment.pretrain.set holds {override!r}: the pretraining takes the grid's "
                "model and image size, and its own data from the pretrain keys "
                f"({', '.join(KEYS[:4])})"
            )
    fields = {k: table[k] for k in KEYS[:5] if k in table}
    return Pretrain(**fields, overrides=tuple(overrides))


def public_faces(cell: Config, spec: Pretrain) -> FaceDataset:
    """The public identities the grid pretrains on, disjoint from every site's identities.

    The synthetic generator's identities ``data.num_identities ..`` under ``cell``'s data
    seed: the sites hold ``0 .. data.num_identities - 1`` of the same seed.
    """
    return generate_synthetic_faces(public_settings(cell, spec))


def public_settings(cell: Config, spec: Pretrain) -> SyntheticFaceConfig:
    """What :func:`public_faces` renders for the grid whose (any) cell is ``cell``."""
    return SyntheticFaceConfig(
        num_identities=spec.identities,
        images_per_identity=spec.images_per_identity,
        image_size=cell.data.image_size,
        seed=cell.data_seed,
        first_identity=cell.data.num_identities,
    )


def pretrain_config(base: Path, grid_overrides: list[str], spec: Pretrain) -> Config:
    """The centralized run's config: the grid's model and optimiser on the public faces."""
    return load_config(
        base,
        [
            *grid_overrides,
            *spec.overrides,
            *FIXED,
            'data.source="synthetic"',
            f"data.num_identities={spec.identities}",
            f"data.images_per_identity={spec.images_per_identity}",
            f"data.held_out_identities={spec.held_out_identities}",
            f"train.rounds={spec.passes}",
            f"run.seed={spec.seed}",
            f"partition.seed={spec.seed}",  # its held-out identities and train/test split
        ],
    )


#: The sections of the pretraining's config its bytes depend on (not algorithm, privacy, ...).
KEYED = ("run", "data", "partition", "model", "train")


def cache_key(config: Config, public: SyntheticFaceConfig) -> str:
    """SHA-256 of everything the pretrained bytes depend on (config, public faces).

    Only :data:`KEYED` sections count, so grids that differ in their algorithms' settings
    alone (FedGC's lambda, AdaFedFR's k) pretrain the same backbone under the same key.
    """
    sections = tomllib.loads(config_to_toml(config))
    keyed = {k: sections.get(k) for k in KEYED}
    text = json.dumps({"config": keyed, "public": dataclasses.asdict(public)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def ensure_pretrained(
    spec: Pretrain,
    base: Path,
    grid_overrides: list[str],
    cell: Config,
    out: Path,
    *,
    progress: bool = False,
) -> Path:
    """The shared backbone's file under ``out/pretrain/<key>/``: trained once, then reused.

    ``cell``: any cell's config (the cells share the data seed and image size).

    Raises:
        RoundAborted: the pretraining diverged (nothing is cached).
    """
    config = pretrain_config(base, grid_overrides, spec)
    public = public_settings(cell, spec)
    folder = out / "pretrain" / cache_key(config, public)[:16]
    weights = folder / "backbone.safetensors"
    if weights.is_file() and (folder / "pretrain.json").is_file():
        if progress:
            print(f"pretrained backbone: reusing {weights}", flush=True)
        return weights.resolve()
    if progress:
        print(
            f"pretraining one backbone on {spec.identities} public identities x "
            f"{spec.images_per_identity} images, {spec.passes} passes -> {weights}",
            flush=True,
        )
    started = time.time()
    faces = generate_synthetic_faces(public)
    plan = plan_federation(config, faces)
    try:
        backbone, history = train_centralized_model(config, plan, progress=progress)
    except RoundAborted as exc:
        raise RoundAborted(f"the grid's pretraining diverged: {exc}") from exc
    save_weights(backbone, weights)
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    record = {
        "identities": f"synthetic {public.first_identity}..."
        f"{public.first_identity + public.num_identities - 1} (seed {public.seed})",
        "settings": dataclasses.asdict(spec),
        "public": dataclasses.asdict(public),
        "held_out": history[-1] if history else {},
        "held_out_by_pass": history,
        "sha256": digest,
        "duration_s": round(time.time() - started, 1),
        "config": config_to_toml(config),
    }
    atomic_write_bytes(folder / "pretrain.json", json.dumps(record, indent=2).encode())
    return weights.resolve()


def start_markdown(weights: Path | None, out: Path | None = None) -> str:
    """The results page's line on where every cell started ("" for random starts)."""
    if weights is None:
        return ""
    record = json.loads((weights.parent / "pretrain.json").read_text(encoding="utf-8"))
    settings, held = record["settings"], record["held_out"]
    where = weights.parent.relative_to(out.resolve()) if out is not None else weights.parent
    scores = ", ".join(f"{k} {held[k]:.3f}" for k in ("tar_at_far_1e-1", "tar_at_far_1e-2")
                       if k in held)  # fmt: skip
    return (
        f"Start: every cell loads one backbone pretrained centrally (`fl-secure train "
        f"--centralized`'s code) on {settings['identities']} public identities "
        f"({record['identities']}; none of them a site's) x {settings['images_per_identity']} "
        f"images, {settings['passes']} passes (`{where}/pretrain.json`; SHA-256 "
        f"{record['sha256'][:16]}...; its {settings['held_out_identities']} held-out public "
        f"identities: {scores or 'not scored'}). 'untrained' below is that start.\n\n"
    )
