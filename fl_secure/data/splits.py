"""Identity-level and image-level splits, and equal client partitions.

- :func:`held_out_identities`: disjoint train / held-out identity sets, for verification on
  identities never seen in training (open-set evaluation).
- :func:`stratified_split`: each identity's images split by the given fractions, so every
  identity appears in every part, as in HF-MAML (Sec. IV-A: "a stratified split per client,
  which means that every identity is in both the train and the test set"; 70/10/20).
- :func:`equal_partition`: identities dealt evenly to clients (HF-MAML's equal partition).
- :func:`person_partition`: one identity per client (the cross-device FedFace / FedGC
  setting: a device is one person), so client-level DP is person-level DP.

All are deterministic by ``seed`` (numpy ``Generator``; data shuffling, not security).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fl_secure.data.types import FaceDataset
from fl_secure.errors import DataError

Labels = FaceDataset | np.ndarray | torch.Tensor | Sequence[int]


def _labels(data: Labels) -> np.ndarray:
    """Integer label array of a data set, tensor, array or sequence."""
    if isinstance(data, FaceDataset):
        return data.labels.numpy()
    if isinstance(data, torch.Tensor):
        return data.detach().cpu().numpy().astype(np.int64)
    labels = np.asarray(data)
    if labels.ndim != 1 or (labels.size and not np.issubdtype(labels.dtype, np.integer)):
        raise DataError(f"labels must be a 1-d integer sequence, got {labels.dtype} {labels.shape}")
    return labels.astype(np.int64)


def identity_indices(data: Labels, identities: Sequence[int] | np.ndarray) -> np.ndarray:
    """Sorted indices of the images whose label is one of ``identities``."""
    return np.flatnonzero(np.isin(_labels(data), np.asarray(identities, dtype=np.int64)))


def held_out_identities(
    data: Labels,
    *,
    num_held_out: int | None = None,
    fraction: float | None = None,
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Split the identities present in ``data`` into disjoint train and held-out sets.

    Args:
        data: a data set or its labels.
        num_held_out: how many identities to hold out (give this or ``fraction``).
        fraction: share of identities to hold out, rounded to the nearest count.
        seed: shuffling seed.

    Returns:
        ``(train_ids, held_out_ids)``, each sorted, together all identities present; holding
        out zero identities is allowed (an empty held-out set).

    Raises:
        DataError: neither or both of ``num_held_out`` / ``fraction``, or a request that would
            leave no training identity.
    """
    ids = np.unique(_labels(data))
    if (num_held_out is None) == (fraction is None):
        raise DataError("give exactly one of num_held_out and fraction")
    if fraction is not None:
        if not 0.0 < fraction < 1.0:
            raise DataError(f"fraction must be in (0, 1), got {fraction}")
        num_held_out = round(fraction * len(ids))
    if num_held_out is None or not 0 <= num_held_out <= len(ids) - 1:
        raise DataError(
            f"cannot hold out {num_held_out} of {len(ids)} identities: training needs at least one"
        )
    held = np.random.default_rng(seed).permutation(ids)[:num_held_out]
    return np.setdiff1d(ids, held), np.sort(held)


def _allocate(n: int, fractions: np.ndarray) -> np.ndarray:
    """Image counts per part: largest remainder, then at least one per part when possible."""
    if not (np.isfinite(fractions).all() and (fractions >= 0).all() and fractions.sum() > 0):
        raise DataError(f"cannot split by the shares {fractions.tolist()}: not finite shares")
    raw = n * fractions
    counts: np.ndarray = np.floor(raw).astype(np.int64)
    order = np.argsort(-(raw - counts), kind="stable")
    counts[order[: n - counts.sum()]] += 1
    if n >= len(fractions):
        for part in np.flatnonzero(counts == 0):
            counts[int(np.argmax(counts))] -= 1
            counts[part] += 1
    else:  # too few images to cover every part: fill parts in order, train first
        counts = np.array([1] * n + [0] * (len(fractions) - n), dtype=np.int64)
    return counts


def stratified_split(
    data: Labels, *, fractions: Sequence[float] = (0.7, 0.3), seed: int
) -> tuple[np.ndarray, ...]:
    """Split each identity's images by ``fractions`` (e.g. train/test or train/val/test).

    Every identity with at least ``len(fractions)`` images gets at least one image in each
    part; an identity with fewer fills the parts in order (train first).

    Args:
        data: a data set or its labels.
        fractions: positive shares summing to 1, one per part.
        seed: shuffling seed.

    Returns:
        One sorted index array per part; the parts are disjoint and cover every image.

    Raises:
        DataError: fewer than two fractions, a non-positive fraction, or a sum other than 1.
    """
    labels = _labels(data)
    shares = np.asarray(fractions, dtype=np.float64)
    if shares.ndim != 1 or len(shares) < 2:
        raise DataError(f"fractions needs at least two parts, got {tuple(fractions)}")
    if np.any(shares <= 0) or abs(shares.sum() - 1.0) > 1e-6:
        raise DataError(f"fractions must be positive and sum to 1, got {tuple(fractions)}")
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in shares]
    for identity in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == identity))
        bounds = np.cumsum(_allocate(len(members), shares))[:-1]
        for part, chunk in zip(parts, np.split(members, bounds), strict=True):
            part.append(chunk)
    return tuple(np.sort(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts)


def equal_partition(
    identity_ids: Sequence[int] | np.ndarray, num_clients: int, seed: int
) -> list[np.ndarray]:
    """Deal identities to ``num_clients`` clients evenly (sizes differ by at most one).

    Raises:
        DataError: fewer than one client, duplicate identities, or more clients than
            identities (a client would have no identity).
    """
    ids = np.asarray(identity_ids, dtype=np.int64)
    _check_partition_ids(ids, num_clients)
    shuffled = np.random.default_rng(seed).permutation(ids)
    return [np.sort(part) for part in np.array_split(shuffled, num_clients)]


def person_partition(
    identity_ids: Sequence[int] | np.ndarray, num_clients: int, seed: int
) -> list[np.ndarray]:
    """One identity per client: client ``k`` holds the ``k``-th identity of a seeded shuffle.

    Every identity goes to exactly one client and every client has exactly one identity, so
    a client's update depends on one person only: client-level DP of such clients is
    person-level DP.

    Raises:
        DataError: as :func:`equal_partition`, or a number of identities other than
            ``num_clients`` (an identity left over would belong to no client's person).
    """
    ids = np.asarray(identity_ids, dtype=np.int64)
    _check_partition_ids(ids, num_clients)
    if len(ids) != num_clients:
        raise DataError(
            f"partition.kind = 'person' gives each client exactly one identity: there are "
            f"{len(ids)} training identities for {num_clients} clients (partition.num_clients "
            "+ partition.held_out_clients); make them equal"
        )
    shuffled = np.random.default_rng(seed).permutation(ids)
    return [shuffled[k : k + 1] for k in range(num_clients)]


def _check_partition_ids(ids: np.ndarray, num_clients: int) -> None:
    if ids.ndim != 1:
        raise DataError(f"identity_ids must be 1-d, got shape {ids.shape}")
    if num_clients < 1:
        raise DataError(f"num_clients must be >= 1, got {num_clients}")
    if len(np.unique(ids)) != len(ids):
        raise DataError("identity_ids contains duplicates; each identity goes to one client")
    if num_clients > len(ids):
        raise DataError(
            f"cannot give {len(ids)} identities to {num_clients} clients: each needs at least one"
        )


def _deal(ids: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    shuffled = rng.permutation(ids)
    bounds = np.cumsum(counts)[:-1]
    return [np.sort(part) for part in np.split(shuffled, bounds)]


def lognormal_partition(
    identity_ids: Sequence[int] | np.ndarray,
    num_clients: int,
    seed: int,
    *,
    mu: float = 3.0,
    sigma: float = 3.0,
) -> list[np.ndarray]:
    """HF-MAML's lognormal class partition (Eq. 5): identity counts ``C S_i / sum_j S_j``.

    ``S_i ~ lognormal(mu, sigma)`` once per client (the paper: mu = sigma = 3), ``C`` the
    number of identities; counts are rounded by largest remainder and every client keeps at
    least one identity. A few clients get many identities, many get few. ``mu`` cancels in the
    normalisation (``e^mu`` scales every ``S_i``): only ``sigma`` shapes the split. The shares
    are taken in log space, ``exp(log S_i - max_j log S_j)``, the same numbers as the
    lognormal draws for any ``mu`` and ``sigma`` whose ``S_i`` overflow (or underflow) a float.

    Raises:
        DataError: as :func:`equal_partition`.
    """
    ids = np.asarray(identity_ids, dtype=np.int64)
    _check_partition_ids(ids, num_clients)
    rng = np.random.default_rng(seed)
    if not (np.isfinite(mu) and np.isfinite(sigma) and sigma > 0):
        raise DataError(f"lognormal partition needs a finite mu and sigma > 0: {mu}, {sigma}")
    # numpy's lognormal is exp of this normal draw (the same stream): no overflow in exp
    log_s = rng.normal(loc=mu, scale=sigma, size=num_clients)
    weights = np.exp(log_s - log_s.max())
    counts = _allocate(len(ids), weights / weights.sum())
    return _deal(ids, counts, rng)


def dirichlet_partition(
    identity_ids: Sequence[int] | np.ndarray,
    num_clients: int,
    seed: int,
    *,
    alpha: float = 0.5,
) -> list[np.ndarray]:
    """Identity counts from client shares ``p ~ Dirichlet(alpha 1)`` (smaller alpha: more skew).

    Raises:
        DataError: as :func:`equal_partition`, or ``alpha <= 0``.
    """
    if not alpha > 0:
        raise DataError(f"alpha must be > 0, got {alpha}")
    ids = np.asarray(identity_ids, dtype=np.int64)
    _check_partition_ids(ids, num_clients)
    rng = np.random.default_rng(seed)
    shares = rng.dirichlet(np.full(num_clients, alpha))
    counts = _allocate(len(ids), shares)
    return _deal(ids, counts, rng)


def parse_predicate(text: str) -> list[tuple[str, bool, int]]:
    """``"male=1 & glasses=0 & hair_colour!=3"`` -> ``[(name, equal, value), ...]``."""
    terms: list[tuple[str, bool, int]] = []
    for raw in text.split("&"):
        term = raw.strip()
        op = "!=" if "!=" in term else "="
        if op not in term:
            raise DataError(f"attribute predicate {text!r}: {term!r} is not name=value")
        name, value = (t.strip() for t in term.split(op, 1))
        lowered = value.lower()
        if lowered in ("true", "yes"):
            number = 1
        elif lowered in ("false", "no"):
            number = 0
        else:
            try:
                number = int(value)
            except ValueError:
                raise DataError(
                    f"attribute predicate {text!r}: {value!r} is not an integer or true/false"
                ) from None
        terms.append((name, op == "=", number))
    return terms


def attribute_partition(
    attributes: dict[str, np.ndarray], candidates: np.ndarray, predicates: Sequence[str]
) -> list[np.ndarray]:
    """Image indices per client: the candidates matching each client's attribute conjunction.

    The HF-MAML paper's attribute-based partition (its Table II): a client is a conjunction
    of attribute predicates, so an identity can have images on several clients. An image
    matching several clients goes to the first; one matching none is left out.

    Raises:
        DataError: an unknown attribute (the message lists the known ones), a malformed
            predicate, or a client whose predicate matches no image.
    """
    taken = np.zeros(len(candidates), dtype=bool)
    parts: list[np.ndarray] = []
    for k, text in enumerate(predicates):
        match = np.ones(len(candidates), dtype=bool)
        for name, equal, value in parse_predicate(text):
            if name not in attributes:
                known = ", ".join(sorted(attributes))
                raise DataError(f"client {k}: unknown attribute {name!r}; known: {known}")
            column = np.asarray(attributes[name])[candidates].astype(np.int64)
            match &= (column == value) if equal else (column != value)
        mine = match & ~taken
        if not mine.any():
            raise DataError(f"client {k}: no image matches {text!r}")
        taken |= mine
        parts.append(candidates[mine])
    return parts
