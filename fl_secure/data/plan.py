"""The federation's data plan: which identities each client holds, and what is held out.

Deterministic by seed (``partition.seed``, or ``run.seed`` when it is unset), so the server
(held-out evaluation) and every client (its own share) derive the same plan independently in
embedded mode. Held-out identities are never seen by
any client; each client's images are split per identity into train and test (the HF-MAML
paper's stratified split).

Held-out clients (``partition.held_out_clients``; the HF-MAML paper's clients 16-20, Sec.
IV-A) are partitioned together with the training clients, take no part in any round and
join only after training; their identities are disjoint from the training clients'.

``partition.kind = "domain"`` (FedFR paper, section 3.1: one labelled source-domain client and
``K`` target-domain clients): client 0 holds ``partition.source_fraction`` of the training
identities in the synthetic generator's source domain; clients ``1..K`` split the others
equally and hold them in the ``"shifted"`` domain, as does the held-out set (the target
domain's evaluation). Every image carries its ``domain`` attribute (0 source, 1 shifted), by
which the ``fedfr`` strategy tells source from target clients.

``partition.kind = "person"`` (the cross-device FedFace / FedGC setting): every client holds
all images of exactly one identity, split into train and test like any client's; the
training identities must number exactly ``num_clients + held_out_clients``. A client's
update then depends on one person only, so client-level DP is person-level DP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fl_secure.config import Config, DataConfig, PartitionConfig
from fl_secure.data.align_report import log_aligned_folder
from fl_secure.data.celeba import load_celeba
from fl_secure.data.degrade import degrade_dataset, parse_degradation
from fl_secure.data.folders import load_identity_folders
from fl_secure.data.splits import (
    attribute_partition,
    dirichlet_partition,
    equal_partition,
    held_out_identities,
    lognormal_partition,
    person_partition,
    stratified_split,
)
from fl_secure.data.synthetic import Domain, SyntheticFaceConfig, generate_synthetic_faces
from fl_secure.data.types import FaceDataset
from fl_secure.errors import DataError


def plan_client_id(index: int) -> str:
    """The id of the client that trains on share ``index`` of the plan.

    Embedded runs spawn their clients under these ids and simulations name them so; a run's
    ``summary.json`` records the pairing as ``client_plan`` (the audit reads it).
    """
    return f"client-{index}"


@dataclass(frozen=True)
class ClientShare:
    """One client's images, split per identity."""

    train: FaceDataset
    test: FaceDataset


@dataclass(frozen=True)
class FederatedData:
    """Everything the embedded mode derives from the config."""

    # sorted global identity ids not held out: the label space of a shared head. Under an
    # attribute partition some may match no client's predicate (see unassigned_identities)
    train_identities: np.ndarray
    held_out: FaceDataset  # identities of no client (server-side evaluation)
    clients: Sequence[ClientShare]  # a list, or lazy_plan.LazyShares (rendered when read)
    held_out_clients: list[ClientShare] = field(default_factory=list)  # join after training

    def client_sizes(self) -> list[int]:
        """Training images per client (written with the run for the report)."""
        return [len(c.train) for c in self.clients]

    def client_plan(self) -> dict[str, int]:
        """Which client id trains on which share (``summary.json``'s ``client_plan``)."""
        return {plan_client_id(k): k for k in range(len(self.clients))}

    def held_out_client_sizes(self) -> list[int]:
        """Training (tuning) images per held-out client."""
        return [len(c.train) for c in self.held_out_clients]

    def manifest(self) -> dict[str, object]:
        """The partition as sampled (``partition.json`` of a run): identity ids per client."""

        def share(c: ClientShare) -> dict[str, object]:
            return {
                "identities": [int(i) for i in c.train.identities()],
                "train_images": len(c.train),
                "test_images": len(c.test),
            }

        return {
            "clients": {plan_client_id(k): share(c) for k, c in enumerate(self.clients)},
            "held_out_clients": [share(c) for c in self.held_out_clients],
            "held_out_identities": [int(i) for i in self.held_out.identities()],
            "unassigned_identities": [int(i) for i in self.unassigned_identities()],
        }

    def unassigned_identities(self) -> np.ndarray:
        """Training identities no client holds (neither trained on nor evaluated).

        Empty except under an attribute partition whose predicates miss some images.
        """
        held = [c.train.identities() for c in self.clients] + [
            c.test.identities() for c in self.clients
        ]
        return np.setdiff1d(self.train_identities, np.concatenate([np.array([], int), *held]))


def load_dataset(cfg: DataConfig, seed: int, domain: Domain | None = None) -> FaceDataset:
    """The whole data set a run uses, degraded by ``data.degrade``: every run loads it here.

    The server's held-out set, each client's share (embedded clients and ``--plan-index``),
    the in-process simulation, ``fl-secure eval`` and the audits all take their images from
    :func:`plan_federation`, which calls this; a client with its own ``--data`` folder
    degrades it with :func:`degrade_for_run`. ``domain`` (synthetic only): the generator's
    shifted domain instead of the source one.
    """
    return degrade_for_run(load_source(cfg, seed, domain), cfg, seed)


def degrade_for_run(data: FaceDataset, cfg: DataConfig, seed: int) -> FaceDataset:
    """``data`` degraded by ``cfg.degrade`` under the run's ``seed`` ("": ``data`` itself).

    Deterministic per image: its occlusion box comes from ``seed``, its identity's name and
    its rank among that identity's images, so every site and the server degrade an image
    alike, and loading twice gives identical tensors.
    """
    return degrade_dataset(data, parse_degradation(cfg.degrade), run_seed=seed)


def synthetic_settings(
    cfg: DataConfig, seed: int, domain: Domain | None = None
) -> SyntheticFaceConfig:
    """The synthetic generator's settings for ``cfg`` under the data ``seed``."""
    return SyntheticFaceConfig(
        num_identities=cfg.num_identities,
        images_per_identity=cfg.images_per_identity,
        image_size=cfg.image_size,
        seed=seed,
        expression_strength=cfg.expression_strength,
        domain=domain,
    )


def load_source(cfg: DataConfig, seed: int, domain: Domain | None = None) -> FaceDataset:
    """The data set a config describes, as loaded and resized (before ``data.degrade``)."""
    if cfg.source == "synthetic":
        return generate_synthetic_faces(synthetic_settings(cfg, seed, domain))
    if cfg.source == "celeba":
        return load_celeba(
            cfg.path,
            cfg.attributes_file,
            cfg.identities_file,
            image_size=cfg.image_size,
            min_images_per_identity=cfg.min_images_per_identity,
            max_identities=cfg.max_identities or None,
            max_images_per_identity=cfg.max_images_per_identity or None,
            center_crop=cfg.center_crop or None,
        )
    log_aligned_folder(cfg.path, cfg.image_size)
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
    """Identities of each client under the configured partition (deterministic by seed).

    Training clients first, then the held-out clients: all are partitioned together.
    """
    total = cfg.num_clients + cfg.held_out_clients
    if cfg.kind == "lognormal":
        return lognormal_partition(train_ids, total, seed, mu=cfg.mu, sigma=cfg.sigma)
    if cfg.kind == "dirichlet":
        return dirichlet_partition(train_ids, total, seed, alpha=cfg.alpha)
    if cfg.kind == "person":
        return person_partition(train_ids, total, seed)
    return equal_partition(train_ids, total, seed)


def _attribute_images(
    data: FaceDataset, train_ids: np.ndarray, cfg: PartitionConfig
) -> list[np.ndarray]:
    """Attribute partition; held-out clients drop images of identities a training client has.

    With identity-level attributes (CelebA here, or the synthetic traits ``male``, ``beard``,
    ``age``, ``hair_colour``, ``bushy_eyebrows``) nothing is dropped; per-image attributes
    (``glasses``, ``hat``, ``smile``) can spread an identity over clients.
    """
    labels = data.labels.numpy()
    candidates = np.flatnonzero(np.isin(labels, train_ids))
    parts = attribute_partition(data.attributes, candidates, cfg.clients)
    train_parts, new_parts = parts[: cfg.num_clients], parts[cfg.num_clients :]
    seen = np.unique(labels[np.concatenate(train_parts)])
    kept = []
    for k, part in enumerate(new_parts):
        mine = part[~np.isin(labels[part], seen)]
        if not len(mine):
            raise DataError(
                f"held-out client {k} ({cfg.clients[cfg.num_clients + k]!r}) has no identity "
                "that the training clients lack: use identity-level attributes for it"
            )
        kept.append(mine)
    return train_parts + kept


def check_held_out(held_out: FaceDataset) -> None:
    """A held-out set must give both kinds of pair its verification ROC needs (or be empty).

    Impostor pairs need two identities, genuine pairs two images of one identity; without
    either every evaluation of the run would fail, so the plan is refused before it starts.
    """
    if len(held_out) == 0:
        return
    counts = np.unique(held_out.labels.numpy(), return_counts=True)[1]
    if len(counts) < 2:
        raise DataError(
            f"data.held_out_identities = {len(counts)}: the held-out evaluation compares "
            "faces of different identities (impostor pairs), so it needs at least 2 held-out "
            "identities; set data.held_out_identities >= 2, or 0 for no held-out evaluation"
        )
    if counts.max() < 2:
        raise DataError(
            f"the {len(counts)} held-out identities (data.held_out_identities) have one image "
            "each: the held-out evaluation needs genuine pairs, two images of one identity; "
            "use data with at least 2 images per identity (data.min_images_per_identity >= 2), "
            "or data.held_out_identities = 0 for no held-out evaluation"
        )


def plan_federation(config: Config, dataset: FaceDataset | None = None) -> FederatedData:
    """Split ``dataset`` (default: :func:`load_dataset`) into held-out and client shares.

    Seeded by ``config.data_seed``: ``partition.seed`` when set, else ``run.seed``. Runs that
    differ only in ``run.seed`` under one ``partition.seed`` get the same plan, image for
    image (an experiment grid's paired comparison).
    """
    seed = config.data_seed
    data = dataset if dataset is not None else load_dataset(config.data, seed)
    labels = data.labels.numpy()
    train_ids, held_ids = held_out_identities(
        labels, num_held_out=config.data.held_out_identities, seed=seed
    )
    train_ids = np.sort(np.asarray(train_ids))
    total = config.partition.num_clients + config.partition.held_out_clients
    if len(train_ids) < total:
        raise DataError(
            f"{len(train_ids)} training identities cannot be spread over {total} clients "
            "(partition.num_clients + partition.held_out_clients)"
        )
    fractions = (1.0 - config.data.test_fraction, config.data.test_fraction)
    if config.partition.kind == "domain":
        return _domain_plan(config, data, train_ids, held_ids, fractions)
    held_out = data.subset(np.flatnonzero(np.isin(labels, held_ids)))
    check_held_out(held_out)
    shares: list[ClientShare] = []
    if config.partition.kind == "attribute":  # images by attribute conjunctions
        images = _attribute_images(data, train_ids, config.partition)
    else:  # identities, then all their images
        images = [
            np.flatnonzero(np.isin(labels, ids))
            for ids in partition_identities(train_ids, config.partition, seed)
        ]
    for k, idx in enumerate(images):
        mine = data.subset(idx)
        train_idx, test_idx = stratified_split(mine, fractions=fractions, seed=seed + 1 + k)
        shares.append(ClientShare(train=mine.subset(train_idx), test=mine.subset(test_idx)))
    first_new = config.partition.num_clients
    clients, newcomers = shares[:first_new], shares[first_new:]
    if newcomers:  # the label space of a global head: identities of the training clients
        train_ids = np.setdiff1d(train_ids, labels[np.concatenate(images[first_new:])])
    return FederatedData(
        train_identities=train_ids, held_out=held_out, clients=clients, held_out_clients=newcomers
    )


def _domain_plan(
    config: Config,
    source: FaceDataset,
    train_ids: np.ndarray,
    held_ids: np.ndarray,
    fractions: tuple[float, float],
) -> FederatedData:
    """``partition.kind = "domain"``: client 0 source domain, clients 1.. and held-out shifted."""
    if source.attributes.get("domain") is None:
        raise DataError("partition.kind = 'domain' needs synthetic data (a 'domain' attribute)")
    seed, num_targets = config.data_seed, config.partition.num_clients - 1
    target = load_dataset(config.data, seed, domain="shifted")
    order = np.random.default_rng([seed, 7]).permutation(train_ids)
    n_source = int(round(config.partition.source_fraction * len(order)))
    n_source = min(max(n_source, 1), len(order) - num_targets)
    parts = [np.sort(order[:n_source]), *equal_partition(order[n_source:], num_targets, seed)]
    shares = []
    for k, ids in enumerate(parts):
        domain = source if k == 0 else target
        mine = domain.subset(np.flatnonzero(np.isin(domain.labels.numpy(), ids)))
        train_idx, test_idx = stratified_split(mine, fractions=fractions, seed=seed + 1 + k)
        shares.append(ClientShare(train=mine.subset(train_idx), test=mine.subset(test_idx)))
    held_out = target.subset(np.flatnonzero(np.isin(target.labels.numpy(), held_ids)))
    check_held_out(held_out)
    return FederatedData(train_identities=train_ids, held_out=held_out, clients=shares)
