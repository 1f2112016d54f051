"""The federation's data plan: which identities each client holds, and what is held out.

Deterministic by seed, so the server (held-out evaluation) and every client (its own share)
derive the same plan independently in embedded mode. Held-out identities are never seen by
any client; each client's images are split per identity into train and test (the HF-MAML
paper's stratified split).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fl_secure.config import Config, DataConfig, PartitionConfig
from fl_secure.data.folders import load_identity_folders
from fl_secure.data.splits import (
    attribute_partition,
    dirichlet_partition,
    equal_partition,
    held_out_identities,
    lognormal_partition,
    stratified_split,
)
from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces
from fl_secure.data.types import FaceDataset
from fl_secure.errors import DataError


@dataclass(frozen=True)
class ClientShare:
    """One client's images, split per identity."""

    train: FaceDataset
    test: FaceDataset


@dataclass(frozen=True)
class FederatedData:
    """Everything the embedded mode derives from the config."""

    train_identities: np.ndarray  # sorted global identity ids held by the clients
    held_out: FaceDataset  # identities of no client (server-side evaluation)
    clients: list[ClientShare]

    def client_sizes(self) -> list[int]:
        """Training images per client (written with the run for the report)."""
        return [len(c.train) for c in self.clients]


def load_dataset(cfg: DataConfig, seed: int) -> FaceDataset:
    """The whole data set a config describes (synthetic, or identity folders on disk)."""
    if cfg.source == "synthetic":
        return generate_synthetic_faces(
            SyntheticFaceConfig(
                num_identities=cfg.num_identities,
                images_per_identity=cfg.images_per_identity,
                image_size=cfg.image_size,
                seed=seed,
            )
        )
    return load_identity_folders(
        cfg.path,
        image_size=cfg.image_size,
        min_images_per_identity=cfg.min_images_per_identity,
        max_identities=cfg.max_identities or None,
        max_images_per_identity=cfg.max_images_per_identity or None,
        center_crop=cfg.center_crop or None,
    )


def partition_identities(
    train_ids: np.ndarray, cfg: PartitionConfig, seed: int
) -> list[np.ndarray]:
    """Identities of each client under the configured partition (deterministic by seed)."""
    if cfg.kind == "lognormal":
        return lognormal_partition(train_ids, cfg.num_clients, seed, mu=cfg.mu, sigma=cfg.sigma)
    if cfg.kind == "dirichlet":
        return dirichlet_partition(train_ids, cfg.num_clients, seed, alpha=cfg.alpha)
    return equal_partition(train_ids, cfg.num_clients, seed)


def plan_federation(config: Config, dataset: FaceDataset | None = None) -> FederatedData:
    """Split ``dataset`` (default: :func:`load_dataset`) into held-out and client shares."""
    seed = config.run.seed
    data = dataset if dataset is not None else load_dataset(config.data, seed)
    labels = data.labels.numpy()
    train_ids, held_ids = held_out_identities(
        labels, num_held_out=config.data.held_out_identities, seed=seed
    )
    train_ids = np.sort(np.asarray(train_ids))
    if len(train_ids) < config.partition.num_clients:
        raise DataError(
            f"{len(train_ids)} training identities cannot be spread over "
            f"{config.partition.num_clients} clients"
        )
    held_out = data.subset(np.flatnonzero(np.isin(labels, held_ids)))
    fractions = (1.0 - config.data.test_fraction, config.data.test_fraction)
    shares: list[ClientShare] = []
    if config.partition.kind == "attribute":  # images by attribute conjunctions
        candidates = np.flatnonzero(np.isin(labels, train_ids))
        images = attribute_partition(data.attributes, candidates, config.partition.clients)
    else:  # identities, then all their images
        images = [
            np.flatnonzero(np.isin(labels, ids))
            for ids in partition_identities(train_ids, config.partition, seed)
        ]
    for k, idx in enumerate(images):
        mine = data.subset(idx)
        train_idx, test_idx = stratified_split(mine, fractions=fractions, seed=seed + 1 + k)
        shares.append(ClientShare(train=mine.subset(train_idx), test=mine.subset(test_idx)))
    return FederatedData(train_identities=train_ids, held_out=held_out, clients=shares)
