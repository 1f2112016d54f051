"""Collect a run's compliance report as one JSON document (``report.json``), and its statement.

Every number in the report is copied from one of the run's records, never recomputed:
``summary.json``, ``metrics.jsonl``, ``ledger.sqlite`` (verified hash chain) and, when the
run was audited, ``audit/results.json``. Each section names its source. The privacy
statement follows the reporting checklist of Ponomareva et al., "How to DP-fy ML" (2023),
Sec. 5.3: setting, privacy unit, adjacency, mechanism and noise placement (and whom each
placement trusts), clipping, noise, sampling (and whether the accountant's assumption held),
rounds, accountant, (epsilon, delta), delta against 1/N, what is released, tuning, randomness
source. It is collected here, beside each site's own epsilon from its site ledger
(:func:`site_figures`); ``fl-secure train`` prints those and the statement's population N
(:func:`example_population`) as well. The other sections each have a module: the ledger and
the released model (:mod:`~fl_secure.app.report.ledger`), the attempts of each round
(:mod:`~fl_secure.app.report.attempts`), the threat model and audit
(:mod:`~fl_secure.app.report.threat_model`), utility, provenance, the warnings
(:mod:`~fl_secure.app.report.report_warnings`) and the plain-language summary.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

from audits.results import check_results
from fl_secure.app.report.attempts import failed_attempts, secure_aggregation_section
from fl_secure.app.report.ledger import ledger_section, model_section
from fl_secure.app.report.plain_summary import plain_summary
from fl_secure.app.report.provenance import provenance_section
from fl_secure.app.report.report_warnings import report_warnings, site_warnings
from fl_secure.app.report.threat_model import threat_model_section
from fl_secure.app.report.units import DPSGD_UNITS, RECORD_IN_FULL, dpsgd_population, mechanism
from fl_secure.app.report.utility import utility_section
from fl_secure.errors import CheckpointError, PrivacyError
from fl_secure.runs import RunDir, read_json_object
from privacy.ledger.site_ledger import FILE_NAME, SiteLedger

#: Version of the report JSON (``schema/report-v{major}.schema.json``).
REPORT_VERSION = "1.4"  # 1.2: run.failed_attempts, sites; 1.3: sites' example_epsilon
# 1.4: sites' example_epsilon_colluding_peers and unbounded, ledger.summary_states_spending,
# privacy.delta_in_summary
SCHEMA_FILE = Path(__file__).with_name("schema") / "report-v1.schema.json"


def load_schema() -> dict[str, Any]:
    """The JSON Schema of the report format."""
    schema: dict[str, Any] = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    return schema


#: summary.json fields the report reads, with the JSON types each may have (null aside)
SUMMARY_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("epsilon", "delta"), (int, float)),
    **dict.fromkeys(("rounds_completed", "rounds_planned", "num_clients"), (int,)),
    **dict.fromkeys(
        (
            "status",
            "reason",
            "algorithm",
            "exposure",
            "transport",
            "accountant",
            "version",
            "privacy_unit",
            "noise_placement",
            "evaluation",
            "partition",
            "initial_model",
        ),
        (str,),
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "privacy",
            "secure_aggregation",
            "provenance",
            "held_out",
            "untrained",
            "clients",
            "client_reported_examples",
            "clients_summary",
            "untrained_clients_summary",
        ),
        (dict,),
    ),  # fmt: skip
    "client_train_sizes": (list,),
}


def check_summary(summary: dict[str, Any], path: Path) -> None:
    """Refuse a ``summary.json`` whose fields have the wrong JSON type, naming the field.

    Raises:
        CheckpointError: A field the report reads is of another type (the file was edited
            or damaged); a missing field is the report's n/a, not an error.
    """
    for key, types in SUMMARY_TYPES.items():
        value = summary.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            wanted = " or ".join(t.__name__ for t in types)
            raise CheckpointError(
                f"{path}: {key} is {type(value).__name__} {str(value)[:40]!r}, expected "
                f"{wanted} (the file was edited or damaged)"
            )


def build_report(run_dir: Path) -> dict[str, Any]:
    """The report of a run directory as a JSON-ready dict (deterministic for a given run)."""
    run = RunDir(Path(run_dir))
    if not run.config.exists():
        raise CheckpointError(f"{run_dir} is not a run directory (no config.toml)")
    summary = run.read_summary()
    check_summary(summary, run.path / "summary.json")
    if summary.get("algorithm") == "centralized":
        raise CheckpointError(
            f"{run_dir} is a centralized baseline run (fl-secure train --centralized): no "
            "federation, no privacy statement or secure aggregation to report"
        )
    records = run.read_metrics()
    # completed rounds; a record with a "kind" is something else: a failed attempt ("aborted")
    metrics = [m for m in records if "kind" not in m]
    failed = [m for m in records if m.get("kind") == "aborted"]
    config_text = run.config.read_bytes()
    try:
        config = tomllib.loads(config_text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"the run's config {run.config} is not valid TOML: {exc}") from exc
    audit_path = run.path / "audit" / "results.json"
    audit = read_json_object(audit_path, "the audit results") if audit_path.exists() else None
    if audit is not None:
        check_results(audit, str(audit_path))
    ledger, entries = ledger_section(run.path / "ledger.sqlite", summary)
    privacy = _privacy(summary, config, ledger)
    secure = secure_aggregation_section(summary, metrics, failed)
    report: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "run": {
            "name": run.path.name,
            "status": summary.get("status"),
            "reason": summary.get("reason"),
            "algorithm": summary.get("algorithm"),
            "exposure": summary.get("exposure"),
            "rounds_completed": summary.get("rounds_completed"),
            "rounds_planned": summary.get("rounds_planned"),
            "num_clients": summary.get("num_clients"),
            "partition": summary.get("partition"),
            "client_train_sizes": summary.get("client_train_sizes"),
            "client_reported_examples": summary.get("client_reported_examples"),
            "transport": summary.get("transport"),
            "failed_attempts": failed_attempts(metrics, failed),
            "source": "summary.json, metrics.jsonl (failed attempts)",
        },
        "privacy": privacy,
        "ledger": ledger,
        "secure_aggregation": secure,
        "threat_model": threat_model_section(summary, audit),
        "utility": utility_section(summary, metrics),
        "provenance": provenance_section(run.path, summary, config, config_text),
        "model": model_section(run, entries),
        "sites": site_figures(run.path, summary),
    }
    # a NaN or infinite figure (summary.json may hold one; JSON has no such number) is
    # null, shown as n/a, and named in a warning
    not_numbers = _non_finite_to_null(report, "")
    report["warnings"] = report_warnings(report, config, metrics) + site_warnings(report, run.path)
    if not_numbers:
        shown = ", ".join(not_numbers[:10]) + (", ..." if len(not_numbers) > 10 else "")
        report["warnings"].append(
            {
                "code": "non-finite-figures",
                "message": f"{len(not_numbers)} figure(s) in the run's records are NaN or "
                f"infinite; the report states them as null (n/a): {shown}.",
            }
        )
    report["plain_summary"] = plain_summary(report)
    return report


def _non_finite_to_null(node: Any, path: str) -> list[str]:
    """Replace NaN/Inf floats in ``node`` (in place, at any depth) by None; their paths."""
    found: list[str] = []
    if isinstance(node, dict):
        items: list[tuple[Any, Any]] = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return found
    for key, value in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(value, float) and not math.isfinite(value):
            node[key] = None
            found.append(where)
        else:
            found += _non_finite_to_null(value, where)
    return found


def json_text(report: dict[str, Any]) -> str:
    """``report.json``'s text (sorted keys, so regenerating it gives the same bytes).

    Raises:
        CheckpointError: The report holds a NaN or infinite number (strict JSON has none).
    """
    try:
        return json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except ValueError as exc:
        raise CheckpointError(f"the report cannot be written as JSON: {exc}") from exc


#: Whom each noise placement trusts (shown beside the placement).
TRUST = {
    "local": "no one: each client's update is private on its own before it leaves the site",
    "distributed": "the clients to add their noise shares; the server sees only the noisy "
    "sum (secure aggregation)",
    "central": "the server: it sees un-noised updates (or their sum) and adds the noise",
}


def example_population(summary: dict[str, Any]) -> int | None:
    """Training images of the smallest client (each client's DP-SGD covers its own).

    Known when the server holds the data plan; sites that bring their own data keep their
    counts (they state 1 at join under DP), so it is ``None`` then.
    """
    sizes = summary.get("client_train_sizes")
    counts = [int(n) for n in sizes or [] if isinstance(n, (int, float)) and n > 0]
    return min(counts) if counts else None


def _privacy(
    summary: dict[str, Any], config: dict[str, Any], ledger: dict[str, Any]
) -> dict[str, Any]:
    """The privacy statement, item by item of the checklist, from the summary and the ledger."""
    p = summary.get("privacy") or {}
    unit = summary.get("privacy_unit", "none")
    placement = summary.get("noise_placement")
    population = summary.get("num_clients")
    population_of = "clients (enrolled): the unit is a whole client"
    z, rate = p.get("noise_multiplier"), p.get("client_sample_rate")
    rounds = p.get("rounds_accounted")
    if unit in DPSGD_UNITS:  # each client runs DP-SGD on its own records, and accounts them
        rows = ledger.get("example_level") or []
        population, population_of = dpsgd_population(unit, example_population(summary))
        z = _shared_value([r.get("noise_multiplier") for r in rows])
        rate = _shared_value([r.get("sample_rate") for r in rows])
        rounds = max((r["round"] for r in rows), default=None)
    kept = ledger.get("epsilon")
    # the ledger's (epsilon, delta) is the record: one pair, from one source
    delta = summary.get("delta") if kept is None or ledger.get("delta") is None else ledger["delta"]
    out: dict[str, Any] = {
        "setting": "cross-silo federated learning (a few institutions, each a client)",
        "differential_privacy": unit != "none",
        "privacy_unit": unit,
        "protected_record": RECORD_IN_FULL.get(unit),
        "adjacency": p.get("adjacency"),
        "mechanism": mechanism(unit),
        "noise_placement": placement,
        "noise_placement_trusts": TRUST.get(placement or "", None),
        "clip_norm": p.get("clip_norm"),
        "noise_multiplier": z,
        "target_epsilon": p.get("target_epsilon"),
        "sampling": p.get("client_sampling"),
        "sample_rate": rate,
        "sampling_assumption": _sampling_note(p),
        # the rate epsilon is accounted at (1: no amplification), and the amplified figure
        "accounted_sample_rate": p.get("accounted_sample_rate"),
        "epsilon_amplified": p.get("epsilon_amplified"),
        "epsilon_amplified_trusts": p.get("epsilon_amplified_trusts"),
        "rounds_accounted": rounds,
        "accountant": summary.get("accountant"),
        # the ledger is the record; summary.json's copy is kept beside it (a warning if apart)
        "epsilon": summary.get("epsilon") if kept is None else kept,
        "epsilon_in_summary": summary.get("epsilon"),
        "epsilon_source": "summary.json" if kept is None else "ledger.sqlite",
        "delta": delta,
        "delta_in_summary": summary.get("delta"),
        "population": population,
        "population_of": population_of,
        "delta_below_one_over_population": (
            None if delta is None or not population else bool(delta < 1.0 / population)
        ),
        "released": p.get("covers", "every round's global model is sent to the clients"),
        "hyperparameter_tuning_accounted": False,
        "noise_from_csprng": p.get("noise_secure"),
        "noise_generator": p.get("noise_generator"),
        "noise_distribution": ledger.get("noise_distribution"),
        "effective_noise_multiplier": ledger.get("effective_noise_multiplier"),
        "noise_shares_required": p.get("noise_shares_required"),
        # releases the server saw in attempts it discarded, composed like rounds
        "discarded_sums_accounted": p.get("discarded_sums_accounted"),
        "ledger_entries": p.get("ledger_entries"),
        "ledger_head": p.get("ledger_head"),
        "source": "summary.json (privacy), ledger.sqlite",
    }
    if ledger.get("example_level"):
        out["example_level_clients"] = len(ledger["example_level"])
    return out


def _sampling_note(p: dict[str, Any]) -> str | None:
    sampling = p.get("client_sampling")
    if sampling is None:
        return None
    rate = p.get("client_sample_rate")
    if rate == 1.0:
        return (
            "held: every client takes part in every round (sampling rate 1), so the "
            "accountant uses no amplification by sampling"
        )
    if sampling == "poisson" and p.get("accounted_sample_rate") == 1.0:
        return (
            f"poisson sampling at rate {rate}, accounted without amplification: each "
            "round's cohort is published and known to the server (and a draw below "
            "min_clients is drawn again), so epsilon counts every client in every round and "
            "holds against the server too; epsilon_amplified trusts the server to draw the "
            "cohorts honestly and in secret"
        )
    return (
        f"{sampling} sampling at rate {rate}: amplification assumes the cohort is drawn "
        "as the accountant models it and kept secret; resampled cohorts (too few clients "
        "online) break it, and it does not hold against the server, which draws it"
    )


def _shared_value(values: list[Any]) -> Any:
    """The value every client used; None if they differ (the ledger table lists each)."""
    distinct = {v for v in values if v is not None}
    return distinct.pop() if len(distinct) == 1 else None


#: A site row's epsilons; an infinite one (a release without noise against the server) is
#: null in the JSON and named in the row's ``unbounded`` list.
SITE_EPSILONS = (
    "epsilon",
    "epsilon_colluding_peers",
    "example_epsilon",
    "example_epsilon_colluding_peers",
)


def site_figures(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Each site's own epsilon against the server, from the site ledgers in the run folder.

    Embedded runs keep each client's state folder under ``clients/<id>/``, with its
    ``site_ledger.json`` (:mod:`privacy.ledger.site_ledger`). A standalone server's sites keep
    theirs at the sites; the section then lists none.
    """
    delta = summary.get("delta")
    delta = float(delta) if isinstance(delta, (int, float)) and 0 < delta < 1 else 1e-5
    folder = run_dir / "clients"
    rows: list[dict[str, Any]] = []
    for path in sorted(folder.glob(f"*/{FILE_NAME}")) if folder.is_dir() else []:
        row: dict[str, Any] = {"client": path.parent.name, "problem": None, "unbounded": []}
        try:
            found = SiteLedger(path.parent, delta=delta).summary()
        except PrivacyError as exc:
            row |= {"problem": str(exc), "releases": None, "epsilon": None}
            row |= {"epsilon_colluding_peers": None, "releases_without_client_level_noise": None}
            row["example_epsilon"] = row["example_epsilon_colluding_peers"] = None
        else:
            row |= {k: found[k] for k in ("releases", "epsilon", "epsilon_colluding_peers")}
            row["releases_without_client_level_noise"] = found[
                "releases_without_client_level_noise"
            ]
            row["example_epsilon"] = found["example_epsilon"]
            row["example_epsilon_colluding_peers"] = found["example_epsilon_colluding_peers"]
            for key in SITE_EPSILONS:  # no noise against the server: stated as unbounded
                if isinstance(row[key], float) and math.isinf(row[key]):
                    row[key] = None
                    row["unbounded"].append(key)
        rows.append(row)
    return {
        "delta": delta,
        "sites": rows,
        "what": "each site's client-level epsilon against the server, computed by the site "
        "from the updates it released: no amplification by the server's client sampling "
        "(the server knows whom it sampled), exact composition of the Gaussian releases, "
        "and only the noise the protocol guarantees (the site's own under local noise, the "
        "threshold's shares under distributed noise); 'colluding peers': the site's own "
        "noise share alone. The run's epsilon above takes no amplification by the server's "
        "sampling either (its epsilon_amplified does, trusting the server), so the two agree "
        "but for the noise the site counts (the run's is the PLD accountant's, a hair above "
        "the exact figure). "
        "'One image': the site's epsilon for one of its training images (add/remove one "
        "image) over the same releases, with honest and with colluding peers: a client-level "
        "release counts as a Gaussian of sensitivity 2 C (of the noise as above), an "
        "example-level one as its DP-SGD steps at the site's own sampling (PLD accountant)",
        "source": f"clients/<id>/{FILE_NAME} (embedded runs; a standalone server's sites keep "
        "theirs: fl-secure privacy site --state-dir DIR)",
    }
