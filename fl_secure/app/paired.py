"""Paired differences of an experiment grid: each algorithm against the baseline, per seed.

In a grid every algorithm runs on the same (partition, seed) cells: with one
``partition.seed`` for the grid the data split is the same in every cell, and ``run.seed``
draws the model's initialisation, batch order and noise. Differences taken seed by seed
cancel what the seed does to both algorithms alike, so they are much tighter than the
difference of two means ± std. For each algorithm and partition the table gives the mean
over seeds of ``metric(algorithm, seed) - metric(baseline, seed)`` with a Student-t
confidence interval (``n - 1`` degrees of freedom, :func:`scipy.stats.t.ppf`) and ``n``, the
seeds where both runs completed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

#: The grid's headline figure: held-out TAR@FAR=1e-2 (identities no client saw).
HEADLINE = "tar_at_far_1e-2"
HEADLINE_LABEL = "held-out TAR@FAR=1e-2"


@dataclass(frozen=True)
class PairedDifference:
    """Mean paired difference of one algorithm against the baseline in one partition."""

    algorithm: str
    partition: str
    n: int  # seeds where both runs completed
    mean: float | None  # None when n = 0
    low: float | None  # the interval; None when n < 2
    high: float | None


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean of ``values`` and its two-sided Student-t interval at ``level``.

    ``mean ± t_{(1 + level) / 2, n - 1} · s / sqrt(n)``, ``s`` the sample std (``ddof = 1``).

    Raises:
        ValueError: fewer than 2 values (no spread to estimate), or ``level`` not in (0, 1).
    """
    if len(values) < 2:
        raise ValueError(f"a t-interval needs at least 2 values, got {len(values)}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level = {level}: expected a number in (0, 1)")
    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean())
    half = float(stats.t.ppf((1.0 + level) / 2.0, len(x) - 1)) * float(x.std(ddof=1))
    half /= math.sqrt(len(x))
    return mean, mean - half, mean + half


def _figure(value: Any) -> float | None:
    """A table cell as a number: None for a missing one ("", None, NaN: an aborted run)."""
    if value is None or value == "":
        return None
    number = float(value)
    return None if math.isnan(number) else number


def paired_differences(
    rows: Iterable[Mapping[str, Any]],
    algorithms: Sequence[str],
    partitions: Sequence[str],
    baseline: str,
    *,
    metric: str = HEADLINE,
    level: float = 0.95,
) -> list[PairedDifference]:
    """Every algorithm but ``baseline`` against it, per partition, paired by seed.

    ``rows``: results rows (``algorithm``, ``partition``, ``seed`` and ``metric``; as
    :func:`fl_secure.app.experiment.run_experiment` returns them or ``results.csv`` holds
    them). A seed counts only where both runs have the figure (an aborted run has none).
    """
    table: dict[tuple[str, str], dict[int, float]] = {}
    for row in rows:
        value = _figure(row.get(metric))
        if value is not None:
            key = (str(row["algorithm"]), str(row["partition"]))
            table.setdefault(key, {})[int(row["seed"])] = value
    out = []
    for partition in partitions:
        reference = table.get((baseline, partition), {})
        for algorithm in algorithms:
            if algorithm == baseline:
                continue
            mine = table.get((algorithm, partition), {})
            diffs = [mine[s] - reference[s] for s in sorted(mine) if s in reference]
            if len(diffs) >= 2:
                mean, low, high = t_interval(diffs, level)
                out.append(PairedDifference(algorithm, partition, len(diffs), mean, low, high))
            else:
                mean_or_none = diffs[0] if diffs else None
                out.append(PairedDifference(algorithm, partition, len(diffs), mean_or_none,
                                            None, None))  # fmt: skip
    return out


def paired_markdown(
    rows: Iterable[Mapping[str, Any]],
    algorithms: Sequence[str],
    partitions: Sequence[str],
    baseline: str,
    partition_seed: int,
) -> str:
    """The results page's section of paired differences against ``baseline`` (95 % t)."""
    if len(algorithms) < 2:
        return ""
    split = (
        f"on the grid's one partition (`partition.seed = {partition_seed}`)"
        if partition_seed >= 0
        else "on that seed's own partition (`run.seed` draws it; no `partition.seed`)"
    )
    lines = [
        f"\n## Paired differences against {baseline} ({HEADLINE_LABEL})\n\n"
        f"Per partition and seed, the algorithm's {HEADLINE_LABEL} minus {baseline}'s in the "
        f"same cell, {split}; mean over seeds with a 95% Student-t interval (n - 1 degrees "
        "of freedom); n: seeds where both runs completed. An interval that excludes 0 is a "
        "difference the seeds resolve; '-': fewer than 2 pairs.\n\n"
        f"| algorithm | partition | mean difference vs {baseline} | 95% CI | n |\n"
        "|---|---|---|---|---|\n"
    ]
    for d in paired_differences(rows, algorithms, partitions, baseline):
        mean = "-" if d.mean is None else f"{d.mean:+.4f}"
        ci = "-" if d.low is None or d.high is None else f"[{d.low:+.4f}, {d.high:+.4f}]"
        lines.append(f"| {d.algorithm} | {d.partition} | {mean} | {ci} | {d.n} |\n")
    return "".join(lines)
