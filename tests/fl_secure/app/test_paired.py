"""Paired differences against a grid's baseline: known numbers, a t-table value, scipy."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from fl_secure.app.paired import paired_differences, paired_markdown, t_interval

#: differences 0.02, 0.04, 0.03, 0.05, 0.01 on baselines that vary far more across seeds
BASE = [0.50, 0.90, 0.70, 0.60, 0.80]
DIFFS = [0.02, 0.04, 0.03, 0.05, 0.01]


def _rows(as_text: bool = False) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for seed, (b, d) in enumerate(zip(BASE, DIFFS, strict=True)):
        for algorithm, value in (("fedavg", b), ("fedpe", b + d)):
            rows.append({"algorithm": algorithm, "partition": "equal", "seed": seed,
                         "tar_at_far_1e-2": f"{value:.6g}" if as_text else value})  # fmt: skip
    return rows


def test_t_interval_by_hand_and_by_scipy() -> None:
    # By hand: mean 0.03; s = sqrt(0.001 / 4) = 0.0158114; t(0.975, 4) = 2.776445 (t tables:
    # 2.776); half width = 2.776445 * 0.0158114 / sqrt(5) = 0.0196324
    mean, low, high = t_interval(DIFFS)
    assert mean == pytest.approx(0.03, abs=1e-15)
    assert (high - low) / 2 == pytest.approx(2.776 * math.sqrt(0.00025) / math.sqrt(5), rel=2e-4)
    assert (low, high) == pytest.approx((0.03 - 0.0196324, 0.03 + 0.0196324), abs=1e-7)
    ref = stats.t.interval(0.95, 4, loc=0.03, scale=stats.sem(DIFFS))
    assert (low, high) == pytest.approx(ref, abs=1e-12)


def test_t_interval_two_values_and_refusals() -> None:
    # n = 2: t(0.975, 1) = 12.706 (t tables); s of [0.1, 0.12] = 0.02 / sqrt(2) = 0.0141421
    mean, low, high = t_interval([0.1, 0.12])
    assert mean == pytest.approx(0.11)
    assert high - mean == pytest.approx(12.7062047 * 0.0141421356 / math.sqrt(2), rel=1e-7)
    with pytest.raises(ValueError, match="at least 2"):
        t_interval([0.1])
    with pytest.raises(ValueError, match="level"):
        t_interval([0.1, 0.2], level=1.0)


@pytest.mark.parametrize("as_text", [False, True])  # rows as returned, or read from results.csv
def test_paired_differences_pair_by_seed(as_text: bool) -> None:
    (d,) = paired_differences(_rows(as_text), ["fedavg", "fedpe"], ["equal"], "fedavg")
    assert (d.algorithm, d.partition, d.n) == ("fedpe", "equal", 5)
    assert d.mean == pytest.approx(0.03, abs=1e-9)
    assert (d.low, d.high) == pytest.approx((0.03 - 0.0196324, 0.03 + 0.0196324), abs=1e-6)
    # unpaired, the baselines' spread (std 0.141) would swamp a 0.03 difference
    assert d.low is not None and d.low > 0


def test_a_seed_without_both_figures_is_left_out() -> None:
    # Prepare: fedpe's seed 4 aborted (no figure); fedavg lacks seed 3 (not run)
    rows = [r for r in _rows() if not (r["algorithm"] == "fedavg" and r["seed"] == 3)]
    for r in rows:
        if r["algorithm"] == "fedpe" and r["seed"] == 4:
            r["tar_at_far_1e-2"] = None
    # Execute
    (d,) = paired_differences(rows, ["fedavg", "fedpe"], ["equal"], "fedavg")
    # Assert: the pairs of seeds 0, 1, 2 only
    assert d.n == 3
    assert (d.mean, d.low, d.high) == pytest.approx(
        (0.03, *stats.t.interval(0.95, 2, loc=0.03, scale=0.01 / math.sqrt(3))), abs=1e-9
    )


def test_one_pair_has_a_mean_and_no_interval() -> None:
    rows = [r for r in _rows() if r["seed"] == 0]
    (d,) = paired_differences(rows, ["fedavg", "fedpe"], ["equal"], "fedavg")
    assert d.n == 1 and d.mean == pytest.approx(0.02) and d.low is None and d.high is None


def test_markdown_states_the_figures_and_the_split() -> None:
    md = paired_markdown(_rows(), ["fedavg", "fedpe"], ["equal"], "fedavg", partition_seed=0)
    assert "## Paired differences against fedavg (held-out TAR@FAR=1e-2)" in md
    assert "on the grid's one partition (`partition.seed = 0`)" in md
    assert "| fedpe | equal | +0.0300 | [+0.0104, +0.0496] | 5 |" in md
    assert paired_markdown(_rows(), ["fedavg"], ["equal"], "fedavg", 0) == ""
    assert "no `partition.seed`" in paired_markdown(_rows(), ["fedavg", "fedpe"], ["equal"],
                                                    "fedavg", partition_seed=-1)  # fmt: skip
