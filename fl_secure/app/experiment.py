"""Experiment grids: algorithm x partition x seed, simulated in one process, tabulated.

An experiment file names a base run config and the grid::

    [experiment]
    name = "fedpe-vs-fedavg"
    base = "../quickstart.toml"          # relative to this file
    algorithms = ["fedpe", "fedavg"]
    partitions = ["equal", "lognormal"]
    seeds = [0, 1, 2, 3, 4]
    partition_seed = 0                   # one data split for every cell (-1: each run.seed's)
    baseline = "fedavg"                  # paired differences against it (default: the first)
    set = ["train.rounds=5"]             # overrides applied to every run (relative file
                                         # paths in them: from this file's folder, as base)
    far = "1e-1"                         # FAR of the client-group tables ("1e-1" or "1e-2")
    pretrain = {passes = 10}             # optional: one shared pretrained start (see
                                         # fl_secure.app.pretrain: public identities, cached)

An algorithm entry may carry its own overrides after ``+``: ``"hfmaml+embedding_reg=1"``
runs ``hfmaml`` with ``algorithm.embedding_reg = 1`` (a bare key is an ``[algorithm]`` key,
a dotted one any ``section.key``); the entry as written labels its rows.

Every cell runs :func:`fl_secure.app.simulation.simulate` (the gRPC path's algorithm code without
the network), its clients in this process or, with ``executor``, on Ray actors (the same
figures). ``results.csv`` has one row per run; ``results.md`` one row per (algorithm,
partition) with mean ± std over seeds of the held-out TAR@FAR, and the clients' own
figures with their spread across clients (the HF-MAML paper's fairness measure); then, in
the layout of the HF-MAML paper's Tables V-X, TAR@FAR of the training clients and of the
held-out clients (``partition.held_out_clients``, joining after training), untuned and tuned
(``eval.tune_steps`` local batches; :mod:`fl_secure.app.tuning`), each as the mean over clients
and as the std over clients (fairness), mean ± std over seeds.

The partition is drawn once per grid: every cell sets ``partition.seed = partition_seed``
(default 0), so all algorithms and seeds train on the same clients' data and ``run.seed``
varies only the model's initialisation, batch order and noise. ``results.md`` then gives,
per partition, each algorithm's paired difference against ``baseline`` in the held-out
TAR@FAR=1e-2, seed by seed, as a mean with a 95% Student-t interval and n
(:mod:`fl_secure.app.paired`).

A run whose training diverges (NaN/Inf in an update, the global model or its embeddings),
or whose fine-tuning after training does, aborts as the gRPC coordinator aborts a run: its
row has ``status = aborted``, the ``reason`` and no figures, ``results.md`` lists it, and the
grid goes on with the next cell.

A little over 500 lines: the experiment file's format, its cells and their shared pretrained
start (built by :mod:`fl_secure.app.pretrain`) are read in one place, so that one format has
one reader; the paired differences are :mod:`fl_secure.app.paired`'s.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fl_secure.app.paired import paired_markdown
from fl_secure.app.pretrain import Pretrain, ensure_pretrained, parse_pretrain, start_markdown
from fl_secure.app.sim.engine import ExecutorFactory
from fl_secure.app.simulation import check_simulable, simulate
from fl_secure.config import load_config, parse_override
from fl_secure.config.loading import PATH_KEYS
from fl_secure.config.values import RUN_NAME
from fl_secure.errors import ConfigError, RoundAborted
from fl_secure.runs import atomic_write_bytes

#: Client groups of the paper-layout table: column prefix -> summary key of the simulation.
GROUPS = {
    "train_untuned": "clients_summary",
    "train_tuned": "clients_tuned_summary",
    "new_untuned": "held_out_clients_summary",
    "new_tuned": "held_out_clients_tuned_summary",
}
GROUP_FARS = ("1e-1", "1e-2")
GROUP_COLUMNS = tuple(
    f"{group}_tar_at_far_{far}_{stat}"
    for group in GROUPS
    for far in GROUP_FARS
    for stat in ("mean", "std")
)
COLUMNS = (
    "algorithm", "partition", "seed", "status", "reason", "tar_at_far_1e-1", "tar_at_far_1e-2",
    "rank1",
    "clients_tar_at_far_1e-2_mean", "clients_tar_at_far_1e-2_std", "clients_rank1_mean",
    "clients_rank1_std", "untrained_tar_at_far_1e-2", *GROUP_COLUMNS, "bytes_per_round",
    "duration_s",
)  # fmt: skip


@dataclass(frozen=True)
class Experiment:
    """A parsed experiment file."""

    name: str
    base: Path
    algorithms: tuple[str, ...]
    partitions: tuple[str, ...]
    seeds: tuple[int, ...]
    overrides: tuple[str, ...] = field(default_factory=tuple)
    source: str = ""  # the experiment file as given on the command line
    far: str = "1e-1"  # FAR of the client-group tables (the HF-MAML paper reports 0.1)
    folder: Path | None = None  # the experiment file's: relative paths in overrides start here
    # partition.seed of every cell: one data split for the grid; -1 leaves it to run.seed
    partition_seed: int = 0
    baseline: str = ""  # the algorithm the paired differences are taken against ("": first)
    # [experiment.pretrain]: one backbone every cell starts from (None: random starts)
    pretrain: Pretrain | None = None

    @property
    def reference(self) -> str:
        """The baseline algorithm of the paired differences (``baseline`` or the first)."""
        return self.baseline or self.algorithms[0]

    def cells(self) -> list[tuple[str, str, int]]:
        """Every (algorithm, partition, seed) of the grid, in order."""
        return list(itertools.product(self.algorithms, self.partitions, self.seeds))

    def grid_overrides(self) -> list[str]:
        """The grid's ``set``, relative file paths taken from the experiment file's folder."""
        folder = self.folder
        return [_anchored(o, folder) for o in self.overrides] if folder else [*self.overrides]

    def cell_overrides(self, algorithm: str, partition: str, seed: int) -> list[str]:
        """The ``--set`` overrides of one cell: the grid's, then the entry's own.

        Relative file paths in them (``data.path``, ``model.pretrained``, ...) are taken from
        the experiment file's folder, as its ``base`` is, not from the current directory.
        """
        written = [*self.overrides, *algorithm_overrides(algorithm)]
        anchored = [_anchored(o, self.folder) for o in written] if self.folder else written
        split = [f"partition.seed={self.partition_seed}"] if self.partition_seed >= 0 else []
        return [*anchored, f"partition.kind={partition}", *split, f"run.seed={seed}"]


def _anchored(override: str, folder: Path) -> str:
    """``override`` with a relative file path of a path key made absolute from ``folder``."""
    keys, value = parse_override(override)
    if tuple(keys) not in PATH_KEYS or not isinstance(value, str) or not value:
        return override
    if Path(value).is_absolute():
        return override
    return f"{'.'.join(keys)}={json.dumps(str((folder / value).resolve()))}"


def algorithm_overrides(entry: str) -> list[str]:
    """``"hfmaml+embedding_reg=1+train.lr=0.01"`` -> ``algorithm.name=hfmaml`` and the rest."""
    name, *extra = (part.strip() for part in entry.split("+"))
    overrides = [f"algorithm.name={name}"]
    for part in extra:
        key = part.split("=", 1)[0]
        if "=" not in part or not key.strip():
            raise ConfigError(f"algorithm entry {entry!r}: {part!r} is not key=value")
        overrides.append(part if "." in key else f"algorithm.{part}")
    return overrides


def load_experiment(path: str | Path) -> Experiment:
    """Read and check an experiment file (unknown keys and empty lists are refused)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"experiment file {p} does not exist")
    try:
        table = tomllib.loads(p.read_text(encoding="utf-8")).get("experiment")
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p} is not a UTF-8 text file (TOML is UTF-8): {exc}") from exc
    if not isinstance(table, dict):
        raise ConfigError(f"{p} has no [experiment] table")
    allowed = {"name", "base", "algorithms", "partitions", "seeds", "set", "far",
               "partition_seed", "baseline", "pretrain"}  # fmt: skip
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"unknown key {', '.join(unknown)} in [experiment]; allowed: "
                          f"{', '.join(sorted(allowed))}")  # fmt: skip
    for key in ("base", "algorithms", "partitions", "seeds"):
        if key not in table:
            raise ConfigError(f"[experiment] needs {key!r}")
    lists = {k: table[k] for k in ("algorithms", "partitions", "seeds")}
    for key, value in lists.items():
        if not isinstance(value, list) or not value:
            raise ConfigError(f"experiment.{key} must be a non-empty list")
        kind = int if key == "seeds" else str
        odd = [v for v in value if isinstance(v, bool) or not isinstance(v, kind)]
        if odd:
            raise ConfigError(
                f"experiment.{key} holds {odd[0]!r}: expected "
                + ("integers" if kind is int else "strings")
            )
        repeated = sorted({repr(v) for v in value if value.count(v) > 1})
        if repeated:  # a repeated cell would count as a second seed in the spread
            raise ConfigError(f"experiment.{key} repeats {', '.join(repeated)}")
    overrides = table.get("set", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError('experiment.set must be a list of "section.key=value" strings')
    if any(parse_override(o)[0] == ["partition", "seed"] for o in overrides):
        raise ConfigError(
            "experiment.set holds partition.seed: the grid sets it in every cell; use "
            "experiment.partition_seed (-1: each run.seed draws its own partition)"
        )
    partition_seed = table.get("partition_seed", 0)
    if (
        isinstance(partition_seed, bool)
        or not isinstance(partition_seed, int)
        or not -1 <= partition_seed < 2**63
    ):
        raise ConfigError(
            f"experiment.partition_seed = {partition_seed!r}: expected an integer in "
            "[0, 2**63) (one partition for every cell), or -1 (each run.seed's own)"
        )
    baseline = table.get("baseline", "")
    if baseline != "" and baseline not in lists["algorithms"]:
        raise ConfigError(
            f"experiment.baseline = {baseline!r} is not one of experiment.algorithms "
            f"({', '.join(map(repr, lists['algorithms']))}); the paired differences are "
            "taken against it"
        )
    name = table.get("name", p.stem)
    if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
        raise ConfigError(
            f"experiment.name = {name!r}: expected a plain folder name of 1-100 characters, no "
            "'/', '\\' or control characters, not starting with '.' or a space (the results "
            "go to runs/experiments/NAME)"
        )
    far = table.get("far", "1e-1")
    if far not in GROUP_FARS:  # the text names the table columns: "1e-1", not 0.1
        raise ConfigError(
            f"experiment.far = {far!r}; allowed: {', '.join(GROUP_FARS)} (as strings, the "
            "columns' names)"
        )
    return Experiment(
        name=name,
        base=(p.parent / str(table["base"])).resolve(),
        algorithms=tuple(lists["algorithms"]),
        partitions=tuple(lists["partitions"]),
        seeds=tuple(lists["seeds"]),
        overrides=tuple(overrides),
        source=str(path),
        far=far,
        folder=p.resolve().parent,
        partition_seed=partition_seed,
        baseline=baseline,
        pretrain=parse_pretrain(table["pretrain"], overrides) if "pretrain" in table else None,
    )


def run_experiment(
    experiment: Experiment,
    out: Path,
    *,
    progress: bool = False,
    overwrite: bool = False,
    executor: ExecutorFactory | None = None,
) -> list[dict[str, Any]]:
    """Simulate every cell; write ``results.csv`` and ``results.md`` under ``out``.

    ``executor``: where each cell's clients train (:func:`~fl_secure.app.simulation.simulate`;
    default this process); each cell's executor is closed when the cell ends.

    Raises:
        ConfigError: a cell's config is refused, or ``out`` already holds files (earlier
            results) and ``overwrite`` is not set.
    """
    configs = []
    for algorithm, partition, seed in experiment.cells():  # validate every cell first
        overrides = experiment.cell_overrides(algorithm, partition, seed)
        try:
            config = load_config(experiment.base, overrides)
            # what the algorithm refuses (a setting it would ignore, such as
            # algorithm.embedding_reg) and what the simulation does, before any cell runs
            check_simulable(config)
        except ConfigError as exc:
            raise ConfigError(
                f"cell algorithm {algorithm!r}, partition {partition!r}, seed {seed} "
                f"(base {experiment.base}, set {list(overrides)}): {exc}"
            ) from exc
        configs.append((algorithm, partition, seed, config))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder for the results")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:  # earlier results are not replaced silently
        raise ConfigError(
            f"--out {out} is not empty ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}"
            "): give another --out, or --overwrite to replace its results.csv and results.md"
        )
    weights = None
    if experiment.pretrain is not None:  # one shared start: every cell loads the same bytes
        weights = ensure_pretrained(
            experiment.pretrain, experiment.base, experiment.grid_overrides(), configs[0][3],
            out, progress=progress,
        )  # fmt: skip
        configs = [
            (a, p, s, load_config(experiment.base, [
                *experiment.cell_overrides(a, p, s), f"model.pretrained={json.dumps(str(weights))}"
            ]))
            for a, p, s, _ in configs
        ]  # fmt: skip
    rows: list[dict[str, Any]] = []
    for i, (algorithm, partition, seed, config) in enumerate(configs, 1):
        if progress:
            print(f"[{i}/{len(configs)}] {algorithm} / {partition} / seed {seed}", flush=True)
        started = time.time()
        try:
            summary = simulate(config, executor=executor).summary
        except RoundAborted as exc:  # diverged: as the coordinator, abort this run, not the grid
            if progress:
                print(f"  aborted: {exc}", flush=True)
            row: dict[str, Any] = dict.fromkeys(COLUMNS)
            row.update(algorithm=algorithm, partition=partition, seed=seed, status="aborted",
                       reason=str(exc), duration_s=round(time.time() - started, 1))  # fmt: skip
            rows.append(row)
            _write(out, experiment, rows, weights)
            continue
        clients = summary["clients_summary"]
        row = {
            "algorithm": algorithm,
            "partition": partition,
            "seed": seed,
            "status": summary["status"],
            "reason": None,
            "tar_at_far_1e-1": summary.get("tar_at_far_1e-1"),
            "tar_at_far_1e-2": summary.get("tar_at_far_1e-2"),
            "rank1": summary.get("rank1"),
            "clients_tar_at_far_1e-2_mean": clients.get("tar_at_far_1e-2_mean"),
            "clients_tar_at_far_1e-2_std": clients.get("tar_at_far_1e-2_std"),
            "clients_rank1_mean": clients.get("rank1_mean"),
            "clients_rank1_std": clients.get("rank1_std"),
            "untrained_tar_at_far_1e-2": summary["untrained"].get("tar_at_far_1e-2"),
            # payload one client receives and sends in a round (parameters, broadcast)
            "bytes_per_round": summary.get("bytes_per_client", {}).get("total"),
            **_group_columns(summary),
            "duration_s": summary["duration_s"],
        }
        rows.append(row)
        _write(out, experiment, rows, weights)  # after every cell: a stopped grid keeps its rows
    return rows


def _group_columns(summary: dict[str, Any]) -> dict[str, Any]:
    """Mean and std over clients of each group's TAR@FAR (missing group: empty)."""
    row: dict[str, Any] = {}
    for group, key in GROUPS.items():
        figures = summary.get(key, {})
        for far in GROUP_FARS:
            for stat in ("mean", "std"):
                row[f"{group}_tar_at_far_{far}_{stat}"] = figures.get(f"tar_at_far_{far}_{stat}")
    return row


def _write(
    out: Path, experiment: Experiment, rows: list[dict[str, Any]], weights: Path | None = None
) -> None:
    out.mkdir(parents=True, exist_ok=True)  # once a cell has run: a refused grid leaves none
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")  # quotes a label with , " or a newline
    writer.writerow(COLUMNS)
    writer.writerows([_csv(row[c]) for c in COLUMNS] for row in rows)
    atomic_write_bytes(out / "results.csv", text.getvalue().encode())
    page = markdown(experiment, rows, out=out, start=weights)
    atomic_write_bytes(out / "results.md", page.encode())


def _csv(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _mean_std(values: list[Any]) -> str:
    present = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not present:
        return "-"
    if len(present) == 1:
        return f"{present[0]:.3f}"
    return f"{np.mean(present):.3f} ± {np.std(present, ddof=0):.3f}"


def markdown(
    experiment: Experiment,
    rows: list[dict[str, Any]],
    out: Path | None = None,
    *,
    start: Path | None = None,
) -> str:
    """The results page: the paper-style table, paired differences, aborted runs, groups.

    ``start``: the shared pretrained backbone every cell loaded (None: random starts).

    Mean ± std over seeds per (algorithm, partition); then each algorithm's paired difference
    against the baseline (:func:`fl_secure.app.paired.paired_markdown`).
    """
    command = f"fl-secure experiment --config {experiment.source}"
    command += f" --out {out}" if out is not None else ""  # the exact command, to rerun
    head = (
        f"# {experiment.name}\n\n"
        f"Produced by `{command}` (in-process "
        "simulation of the gRPC path's algorithm code).\n\n"
        f"Base config `{experiment.base.name}`, overrides {list(experiment.overrides)}, "
        f"seeds {list(experiment.seeds)}, {_split(experiment)}; mean ± std over seeds "
        "(population std). "
        "Held-out: identities no client saw. Clients: each client's own test images (with its "
        "private personalisation where the design has one, e.g. AdaFedFR's adapter); "
        "'spread' is the std across clients (fairness).\n\n"
        f"{start_markdown(start, out)}"
        "| algorithm | partition | held-out TAR@FAR=1e-1 | held-out TAR@FAR=1e-2 | "
        "clients TAR@FAR=1e-2 | clients spread | clients rank-1 | untrained TAR@FAR=1e-2 | "
        "MB per client and round | s per run |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = []
    for algorithm in experiment.algorithms:
        for partition in experiment.partitions:
            cell = [r for r in rows if (r["algorithm"], r["partition"]) == (algorithm, partition)]
            if not cell:
                continue

            def col(key: str, cell: list[dict[str, Any]] = cell) -> str:
                return _mean_std([r[key] for r in cell])

            body.append(
                f"| {algorithm} | {partition} | {col('tar_at_far_1e-1')} | "
                f"{col('tar_at_far_1e-2')} | {col('clients_tar_at_far_1e-2_mean')} | "
                f"{col('clients_tar_at_far_1e-2_std')} | {col('clients_rank1_mean')} | "
                f"{col('untrained_tar_at_far_1e-2')} | {_megabytes(cell)} | {_seconds(cell)} |"
            )
    return (
        head + "\n".join(body) + "\n"
        + paired_markdown(rows, experiment.algorithms, experiment.partitions,
                          experiment.reference, experiment.partition_seed)
        + _aborted_markdown(rows) + client_groups_markdown(experiment, rows)
    )  # fmt: skip


def _split(experiment: Experiment) -> str:
    """How the grid's cells draw their data split (the results page's header says it)."""
    if experiment.partition_seed >= 0:
        return f"one partition for every cell (partition.seed = {experiment.partition_seed})"
    return "each seed's own partition (run.seed draws it)"


def _aborted_markdown(rows: list[dict[str, Any]]) -> str:
    """The runs that aborted (their figures are left out of the means above), and why."""
    aborted = [r for r in rows if r.get("status") == "aborted"]
    if not aborted:
        return ""
    lines = [f"- {r['algorithm']} / {r['partition']} / seed {r['seed']}: {r['reason']}"
             for r in aborted]  # fmt: skip
    return (
        f"\n{len(aborted)} of {len(rows)} runs aborted; their figures are left out of the "
        "table (mean ± std over the runs that completed):\n\n" + "\n".join(lines) + "\n"
    )


def _seconds(cell: list[dict[str, Any]]) -> str:
    """Wall-clock seconds per simulated run (every round, evaluations included), mean ± std."""
    values = [float(r["duration_s"]) for r in cell if r.get("duration_s") is not None]
    if not values:
        return "-"
    return (
        f"{np.mean(values):.0f} ± {np.std(values):.0f}" if len(values) > 1 else f"{values[0]:.0f}"
    )


def _megabytes(cell: list[dict[str, Any]]) -> str:
    """Bytes per client and round in MB (the same in every seed of a cell)."""
    values = sorted({int(r["bytes_per_round"]) for r in cell if r.get("bytes_per_round")})
    return ", ".join(f"{v / 1e6:.2f}" for v in values) if values else "n/a"


def client_groups_markdown(experiment: Experiment, rows: list[dict[str, Any]]) -> str:
    """One table per partition in the layout of the HF-MAML paper's Tables V-X."""
    far = experiment.far
    out = [
        f"\n## Training vs held-out clients, untuned vs tuned (TAR@FAR={far})\n\n"
        "Layout of the HF-MAML paper's Tables V-VII (performance) and VIII-X (fairness). "
        "Train: the clients that took part in the rounds; new: the held-out clients "
        "(`partition.held_out_clients`, identities disjoint from training) that join after "
        "training. Untuned: the final global backbone as it is; tuned: after `eval.tune_steps` "
        "local batches of fine-tuning of the global backbone with the client's head (a new "
        "client's head is freshly initialised over its identities). Each client is scored on "
        "its own test images (all pairs). 'mean' is the mean over clients, 'std' the std over "
        "clients (fairness, lower is fairer); each is then mean ± std over seeds. "
        "'-': no such client (or no client with two identities to verify).\n"
    ]
    for partition in experiment.partitions:
        lines = []
        for mode in ("untuned", "tuned"):
            for algorithm in experiment.algorithms:
                cell = [
                    r for r in rows if (r["algorithm"], r["partition"]) == (algorithm, partition)
                ]
                if not cell:
                    continue
                figures = [
                    _mean_std([r.get(f"{group}_{mode}_tar_at_far_{far}_{stat}") for r in cell])
                    for stat in ("mean", "std")
                    for group in ("train", "new")
                ]
                lines.append(f"| {mode} | {algorithm} | " + " | ".join(figures) + " |")
        if lines:
            out.append(
                f"\n### {partition}\n\n"
                "| | algorithm | train mean | new mean | train std | new std |\n"
                "|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n"
            )
    return "".join(out)


def read_results(path: Path) -> list[dict[str, str]]:
    """``results.csv`` as dictionaries (for tests and reports)."""
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))
