"""What a site states beside its updates and evaluations under DP: data-independent figures.

Under differential privacy (``privacy.unit`` client, example or identity) the site's data
set is what is protected, and its size is part of it: at the example level one image more or
less *is* the neighbouring data set, and at the client level the size describes the site.
So every figure a private site sends in the clear must be the same whatever data it holds:

* the example count (at join, in every update and evaluation header) is
  :data:`PRIVATE_EXAMPLE_COUNT`; the DP and secure means are unweighted, so the server has no
  use for it;
* beside a training update, only the figures the server's accountant composes
  (:func:`training_figures`): at the example and identity levels the DP-SGD release's
  ``dp_*`` figures (:data:`privacy.dp.example_level.EXAMPLE_KEYS` and ``dp_noise_secure``),
  at the client level nothing. The schedule (``local_steps``, which is epochs x N / batch
  without ``train.local_steps``) and the wall-clock time (``local_seconds``) both grow
  with N and stay on the site;
* beside an evaluation, the scores without the counts of test images or pairs they were
  computed on (:data:`EVALUATION_COUNTS`). The scores themselves are not covered by DP (a run
  sends two evaluations: the untrained and the final model).

One exception remains, named by the report (``example-count-public``): with
``privacy.sample_rate`` unset, DP-SGD's rate is ``q = batch_size / N``, derived from N, and
the server needs ``q`` to account the release; set ``privacy.sample_rate`` to keep N private.

The client applies :func:`released_header` to each header before it leaves
(:mod:`client.app`, :mod:`client.secure_round`), and the server applies it again to what it
records (``metrics.jsonl``), so a client that sends more (an older version) does not have
its figures published further. Without DP nothing changes: the count weights the mean.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from fl_secure.config.values import DPSGD_UNITS
from fl_secure.messages import UpdateHeader
from privacy.dp.example_level import EXAMPLE_KEYS

#: The example count a private site states at join and in every header.
PRIVATE_EXAMPLE_COUNT = 1

#: Example and identity level: the figures of a DP-SGD release the server's accountant needs.
DPSGD_FIGURES = frozenset({*EXAMPLE_KEYS, "dp_noise_secure"})

#: Evaluation figures that count the site's test images or pairs (dropped under DP).
EVALUATION_COUNTS = frozenset({"num_genuine", "num_impostor"})


def training_figures(unit: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """The figures that may go beside a training update of a run with ``privacy.unit`` ``unit``.

    ``none``: all of them. ``client``: none. ``example``, ``identity``: the DP-SGD release's
    (:data:`DPSGD_FIGURES`).
    """
    if unit == "none":
        return dict(metrics)
    allowed = DPSGD_FIGURES if unit in DPSGD_UNITS else frozenset()
    return {k: float(v) for k, v in metrics.items() if k in allowed}


def evaluation_figures(unit: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """The scores that may go beside an evaluation: under DP without counts or times."""
    if unit == "none":
        return dict(metrics)
    dropped = EVALUATION_COUNTS | {"local_steps", "local_seconds"}
    return {k: float(v) for k, v in metrics.items() if k not in dropped}


def released_header(header: UpdateHeader, *, unit: str, train: bool) -> UpdateHeader:
    """``header`` as a site of a run with ``privacy.unit`` ``unit`` may send (or be recorded).

    Under DP the example count is :data:`PRIVATE_EXAMPLE_COUNT` and the figures are those of
    :func:`training_figures` (``train``) or :func:`evaluation_figures`; without DP, ``header``.
    """
    if unit == "none":
        return header
    figures = training_figures if train else evaluation_figures
    return dataclasses.replace(
        header, num_examples=PRIVATE_EXAMPLE_COUNT, metrics=figures(unit, header.metrics)
    )
