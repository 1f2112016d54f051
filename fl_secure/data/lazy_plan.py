"""A population's data plan without its images: each client's share rendered when it is used.

:func:`fl_secure.data.plan.plan_federation` renders the whole synthetic data set and then
splits it; for a simulated population of 10,000 clients that is every client's images in the
driver and in every worker (minutes and gigabytes), though a round needs only its cohort's.
:func:`plan_population` computes the same plan from the labels alone (the synthetic
generator's identity-major order is known without rendering), keeps each client's share as
the positions of its images, and renders a share, bit for bit as the eager plan holds it
(:func:`fl_secure.data.synthetic_subset.render_synthetic_subset`), only when
``plan.clients[index]`` is read. The held-out set (the server's evaluation) is rendered at
once: its identities only.

Lazy where the plan depends on labels alone: the synthetic source, no ``data.degrade``, an
identity partition (``equal``, ``lognormal``, ``dirichlet``, ``person``) and no held-out
clients. Any other config gets :func:`plan_federation`'s eager plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from fl_secure.config import Config
from fl_secure.data.degrade import parse_degradation
from fl_secure.data.plan import (
    ClientShare,
    FederatedData,
    check_held_out,
    partition_identities,
    plan_federation,
    synthetic_settings,
)
from fl_secure.data.splits import held_out_identities, stratified_split
from fl_secure.data.synthetic import SyntheticFaceConfig
from fl_secure.data.synthetic_subset import population_labels, render_synthetic_subset
from fl_secure.errors import DataError

#: Partitions whose shares follow from the identities alone.
LAZY_PARTITIONS = ("equal", "lognormal", "dirichlet", "person")


class LazyShares(Sequence[ClientShare]):
    """Clients' shares as image positions; ``shares[k]`` renders client ``k``'s images."""

    def __init__(self, cfg: SyntheticFaceConfig, parts: list[tuple[np.ndarray, np.ndarray]]):
        self.cfg = cfg
        self.parts = parts  # per client: (train positions, test positions), each sorted
        self.rendered = 0  # shares rendered so far

    def __len__(self) -> int:
        return len(self.parts)

    @overload
    def __getitem__(self, index: int) -> ClientShare: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[ClientShare]: ...

    def __getitem__(self, index: int | slice) -> ClientShare | Sequence[ClientShare]:
        """Client ``index``'s share, rendered now (a slice: the lazy shares it selects)."""
        if isinstance(index, slice):
            return LazyShares(self.cfg, self.parts[index])
        train, test = self.parts[index]
        self.rendered += 1
        # one render of both sets (the identity-level work once), then split: each image is
        # rendered from its own (seed, identity, image) alone, so this equals two renders
        both = render_synthetic_subset(self.cfg, np.concatenate([train, test]))
        cut = len(train)
        return ClientShare(
            train=both.subset(np.arange(cut)),
            test=both.subset(np.arange(cut, cut + len(test))),
        )

    def shares(self, indices: Sequence[int]) -> list[ClientShare]:
        """``[self[k] for k in indices]``, rendered in one pass (a batch of jobs' data)."""
        parts = [self.parts[k] for k in indices]
        both = render_synthetic_subset(self.cfg, np.concatenate([p for tt in parts for p in tt]))
        self.rendered += len(parts)
        out, at = [], 0
        for train, test in parts:
            cut, end = at + len(train), at + len(train) + len(test)
            out.append(ClientShare(train=both.subset(np.arange(at, cut)),
                                   test=both.subset(np.arange(cut, end))))  # fmt: skip
            at = end
        return out

    def train_sizes(self) -> list[int]:
        """Training images per client, without rendering any."""
        return [len(train) for train, _ in self.parts]


@dataclass(frozen=True)
class PopulationPlan(FederatedData):
    """A :class:`FederatedData` whose ``clients`` are :class:`LazyShares`."""

    def client_sizes(self) -> list[int]:
        """Training images per client (from the positions; nothing rendered)."""
        assert isinstance(self.clients, LazyShares)
        return self.clients.train_sizes()

    def unassigned_identities(self) -> np.ndarray:
        """None: an identity partition gives every training identity to a client."""
        return np.array([], dtype=np.int64)


def lazy_supported(config: Config) -> bool:
    """Whether :func:`plan_population` can plan ``config`` without rendering its clients."""
    return (
        config.data.source == "synthetic"
        and not parse_degradation(config.data.degrade).steps
        and config.partition.kind in LAZY_PARTITIONS
        and config.partition.held_out_clients == 0
    )


def plan_population(config: Config) -> FederatedData:
    """``plan_federation(config)``, its clients' images rendered only when read.

    Every share, the held-out set and the label space equal the eager plan's bit for bit
    (``tests/fl_secure/data/test_lazy_plan.py``); a config :func:`lazy_supported` refuses
    gets the eager plan.
    """
    if not lazy_supported(config):
        return plan_federation(config)
    seed = config.data_seed
    cfg = synthetic_settings(config.data, seed)  # the source domain, as plan_federation loads
    labels = population_labels(cfg)
    train_ids, held_ids = held_out_identities(
        labels, num_held_out=config.data.held_out_identities, seed=seed
    )
    train_ids = np.sort(np.asarray(train_ids))
    total = config.partition.num_clients
    if len(train_ids) < total:
        raise DataError(
            f"{len(train_ids)} training identities cannot be spread over {total} clients "
            "(partition.num_clients + partition.held_out_clients)"
        )
    held_out = render_synthetic_subset(cfg, np.flatnonzero(np.isin(labels, held_ids)))
    check_held_out(held_out)
    fractions = (1.0 - config.data.test_fraction, config.data.test_fraction)
    per = cfg.images_per_identity
    parts = []
    for k, ids in enumerate(partition_identities(train_ids, config.partition, seed)):
        # an identity's images are consecutive: positions without a scan of every label
        idx = (np.sort(np.asarray(ids, dtype=np.int64))[:, None] * per + np.arange(per)).ravel()
        train_idx, test_idx = stratified_split(labels[idx], fractions=fractions, seed=seed + 1 + k)
        parts.append((idx[train_idx], idx[test_idx]))
    return PopulationPlan(
        train_identities=train_ids, held_out=held_out, clients=LazyShares(cfg, parts)
    )
