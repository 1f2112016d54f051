"""Collect a run's compliance report as one JSON document (``report.json``).

Every number in the report is copied from one of the run's records, never recomputed:
``summary.json``, ``metrics.jsonl``, ``ledger.sqlite`` (verified hash chain) and, when the
run was audited, ``audit/results.json``. Each section names its source. The structure
follows the reporting checklist of Ponomareva et al., "How to DP-fy ML" (2023), Sec. 5.3:
setting, privacy unit, adjacency, mechanism and noise placement (and whom each placement
trusts), clipping, noise, sampling (and whether the accountant's assumption held), rounds,
accountant, (epsilon, delta), delta against 1/N, what is released, tuning, randomness source.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fl_secure.data.manifest import data_manifest
from fl_secure.errors import CheckpointError, FlSecureError
from fl_secure.runs import RunDir, read_json_object

if TYPE_CHECKING:
    from privacy.ledger.entries import Entry

#: Version of the report JSON (``schema/report-v{major}.schema.json``).
REPORT_VERSION = "1.4"  # 1.2: run.failed_attempts, sites; 1.3: sites' example_epsilon
# 1.4: sites' example_epsilon_colluding_peers and unbounded, ledger.summary_states_spending,
# privacy.delta_in_summary
SCHEMA_FILE = Path(__file__).with_name("schema") / "report-v1.schema.json"

#: Whom each noise placement trusts (shown beside the placement).
TRUST = {
    "local": "no one: each client's update is private on its own before it leaves the site",
    "distributed": "the clients to add their noise shares; the server sees only the noisy "
    "sum (secure aggregation)",
    "central": "the server: it sees un-noised updates (or their sum) and adds the noise",
}
HEADLINE = ("tar_at_far_1e-1", "tar_at_far_1e-2", "tar_at_far_1e-3", "rank1", "roc_auc", "eer")


#: A final model whose TAR@FAR=1e-2 is not above the initial one's by more than this is
#: warned about (``no-utility``): a difference this small is within the run-to-run spread of
#: the small evaluation sets.
NO_UTILITY_MARGIN = 0.02


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
        from audits.run_audit import check_results

        check_results(audit, str(audit_path))
    ledger, entries = _ledger(run.path / "ledger.sqlite", summary)
    privacy = _privacy(summary, config, ledger)
    secure = _secure_aggregation(summary, metrics, failed)
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
            "failed_attempts": _failed_attempts(metrics, failed),
            "source": "summary.json, metrics.jsonl (failed attempts)",
        },
        "privacy": privacy,
        "ledger": ledger,
        "secure_aggregation": secure,
        "threat_model": _threat_model(summary, audit),
        "utility": _utility(summary, metrics),
        "provenance": _provenance(run.path, summary, config, config_text),
        "model": _model(run, entries),
        "sites": site_figures(run.path, summary),
    }
    # a NaN or infinite figure (summary.json may hold one; JSON has no such number) is
    # null, shown as n/a, and named in a warning
    not_numbers = _non_finite_to_null(report, "")
    report["warnings"] = _warnings(report, config, metrics) + _site_warnings(report, run.path)
    if not_numbers:
        shown = ", ".join(not_numbers[:10]) + (", ..." if len(not_numbers) > 10 else "")
        report["warnings"].append(
            {
                "code": "non-finite-figures",
                "message": f"{len(not_numbers)} figure(s) in the run's records are NaN or "
                f"infinite; the report states them as null (n/a): {shown}.",
            }
        )
    report["plain_summary"] = _plain_summary(report)
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
    from fl_secure.errors import PrivacyError
    from privacy.ledger.site_ledger import FILE_NAME, SiteLedger

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
        "noise share alone. The run's epsilon above is lower when clients are sampled: it "
        "takes amplification by the server's own sampling; with every client in every round "
        "the two agree (the run's is the PLD accountant's, a hair above the exact figure). "
        "'One image': the site's epsilon for one of its training images (add/remove one "
        "image) over the same releases, with honest and with colluding peers: a client-level "
        "release counts as a Gaussian of sensitivity 2 C (of the noise as above), an "
        "example-level one as its DP-SGD steps at the site's own sampling (PLD accountant)",
        "source": f"clients/<id>/{FILE_NAME} (embedded runs; a standalone server's sites keep "
        "theirs: fl-secure privacy site --state-dir DIR)",
    }


def _model(run: RunDir, entries: list[Entry]) -> dict[str, Any]:
    """The released model's file and SHA-256, checked against what the ledger names."""
    from privacy.ledger.guarantee import released_model_of_run

    source = (
        "checkpoints/latest.json and the parameters file it names; ledger.sqlite "
        "(model_sha256 of that round's rows)"
    )
    model = {**released_model_of_run(run.path, entries), "source": source}
    named = [
        (e.round, str(e.payload["model_sha256"]))
        for e in entries
        if e.kind in ("client_level", "example_level") and "model_sha256" in e.payload
    ]
    if model["checkpoint"] is None and model["problem"] is None and named:
        round_, digest = max(named)  # the last model the ledger says the run released
        model["problem"] = (
            f"the released model is missing: the ledger's rows of round {round_} name a model "
            f"with SHA-256 {digest[:16]}, but the run has no checkpoint "
            "(checkpoints/latest.json is absent)"
        )
    return model


def _ledger(path: Path, summary: dict[str, Any]) -> tuple[dict[str, Any], list[Entry]]:
    """The report's ledger section, and the ledger's entries (none without a ledger)."""
    from privacy.ledger.guarantee import ledger_guarantee
    from privacy.ledger.run_ledger import Ledger
    from privacy.ledger.verification import recorded_head

    recorded = recorded_head(summary)
    if not path.exists():
        spent = summary.get("epsilon")
        rounds = (summary.get("privacy") or {}).get("rounds_accounted")
        return {
            "present": False,
            "recorded_entries": None if recorded is None else recorded[0],
            # a summary from before ledger heads were recorded still states what was spent
            "summary_states_spending": bool(
                (isinstance(spent, (int, float)) and spent > 0)
                or (isinstance(rounds, int) and rounds > 0)
            ),
            "source": "ledger.sqlite",
        }, []
    with Ledger.read(path) as ledger:
        result = ledger.verify(recorded=recorded)
        entries = list(ledger.entries())
    epsilon, delta = ledger_guarantee(entries)
    client_rows = [e for e in entries if e.kind == "client_level"]
    newest = client_rows[-1].payload if client_rows else {}
    example_rows: dict[str, Any] = {}
    for e in entries:
        if e.kind == "example_level":  # the latest row per client is its running total
            example_rows[e.party] = {
                "client": e.party,
                "round": e.round,
                "epsilon": e.payload.get("epsilon"),
                "delta": e.payload.get("delta"),
                "accountant": e.payload.get("accountant"),
                "noise_multiplier": e.payload.get("noise_multiplier"),
                "sample_rate": e.payload.get("sample_rate"),
            }
    return {
        "present": True,
        "verified": result.ok,
        "problems": list(result.problems),
        "entries": result.entries,
        "head": result.head,
        "checked_against_summary": recorded is not None,
        "entries_after_summary": result.after_record,
        # free-text events: a budget stop, a discarded sum the server had seen
        "notes": [
            {"round": e.round, "message": e.payload.get("message")}
            for e in entries
            if e.kind == "note"
        ],
        "epsilon": epsilon,
        "delta": delta,
        "noise_distribution": newest.get("noise_distribution"),
        "effective_noise_multiplier": newest.get("effective_noise_multiplier"),
        "epsilon_by_round": _epsilon_by_round(entries),
        "example_level": [example_rows[k] for k in sorted(example_rows)],
        "source": "ledger.sqlite",
    }, entries


def _epsilon_by_round(entries: list[Entry]) -> list[dict[str, Any]]:
    """Epsilon after each round (client level), or the largest client's (example level).

    A client-level release the server saw in a discarded attempt is a row of its own (marked
    ``discarded_sum``): it is composed like a round.

    Example-level rows are each client's running total; a round's is the largest total of
    every client so far (a client without a row in that round keeps its latest), so the
    series never goes down.
    """
    from privacy.ledger.entries import CLIENT_KINDS

    rows = [
        {"round": e.round, "epsilon": e.payload.get("epsilon"), "at": e.created_at}
        | ({"discarded_sum": True} if e.kind == "discarded_sum" else {})
        for e in entries
        if e.kind in CLIENT_KINDS
    ]
    if rows:
        return rows
    example = [
        (e, eps)
        for e in entries
        if e.kind == "example_level"
        and isinstance(eps := e.payload.get("epsilon"), (int, float))
        and not isinstance(eps, bool)
    ]
    latest: dict[str, tuple[Entry, float]] = {}  # each client's running total so far
    out = []
    for number in sorted({e.round for e, _ in example}):
        latest.update((e.party, (e, eps)) for e, eps in example if e.round == number)
        top, eps = max(latest.values(), key=lambda row: row[1])
        out.append({"round": number, "epsilon": eps, "at": top.created_at})
    return out


def _shared_value(values: list[Any]) -> Any:
    """The value every client used; None if they differ (the ledger table lists each)."""
    distinct = {v for v in values if v is not None}
    return distinct.pop() if len(distinct) == 1 else None


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
    p = summary.get("privacy") or {}
    unit = summary.get("privacy_unit", "none")
    placement = summary.get("noise_placement")
    population = summary.get("num_clients")
    population_of = "clients (enrolled): the unit is a whole client"
    z, rate = p.get("noise_multiplier"), p.get("client_sample_rate")
    rounds = p.get("rounds_accounted")
    if unit == "example":  # each client runs DP-SGD on its own images, and accounts them
        rows = ledger.get("example_level") or []
        population = example_population(summary)
        population_of = (
            "training images of the smallest client: the unit is one image, and each "
            "client's guarantee covers its own images"
        )
        z = _shared_value([r.get("noise_multiplier") for r in rows])
        rate = _shared_value([r.get("sample_rate") for r in rows])
        rounds = max((r["round"] for r in rows), default=None)
        if population is None:
            population_of = (
                "not released: at the example level a site's image count stays on the site "
                "(each client checks delta < 1/N for its own N)"
            )
    kept = ledger.get("epsilon")
    # the ledger's (epsilon, delta) is the record: one pair, from one source
    delta = summary.get("delta") if kept is None or ledger.get("delta") is None else ledger["delta"]
    out: dict[str, Any] = {
        "setting": "cross-silo federated learning (a few institutions, each a client)",
        "differential_privacy": unit != "none",
        "privacy_unit": unit,
        "adjacency": p.get("adjacency"),
        "mechanism": _mechanism(unit, p),
        "noise_placement": placement,
        "noise_placement_trusts": TRUST.get(placement or "", None),
        "clip_norm": p.get("clip_norm"),
        "noise_multiplier": z,
        "target_epsilon": p.get("target_epsilon"),
        "sampling": p.get("client_sampling"),
        "sample_rate": rate,
        "sampling_assumption": _sampling_note(p),
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


def _mechanism(unit: str, p: dict[str, Any]) -> str:
    if unit == "none":
        return "none: no differential privacy in this run"
    if unit == "client":
        return (
            "DP-FedAvg: each client's update of the shared parameters clipped to L2 norm C, "
            "Gaussian noise of std z C on the sum (discrete Gaussian under secure "
            "aggregation with distributed noise)"
        )
    return (
        "DP-SGD (Opacus) on each client: per-example clipping, Gaussian noise, Poisson-"
        "sampled batches; each client accounts its own epsilon"
    )


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
    return (
        f"{sampling} sampling at rate {rate}: amplification assumes the cohort is drawn "
        "as the accountant models it; resampled cohorts (too few clients online) break it"
    )


def _failed_attempts(
    metrics: list[dict[str, Any]], failed: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each failed attempt of a round (metrics.jsonl's ``"kind": "aborted"`` records).

    ``outcome``: ``retried`` when a later attempt of the same round was made (recorded as
    failed too, or as the completed round), else ``round aborted``.
    """
    done = {m.get("round") for m in metrics}
    out = []
    for m in failed:
        later = m.get("round") in done or any(
            f.get("round") == m.get("round") and _int(f.get("attempt")) > _int(m.get("attempt"))
            for f in failed
        )
        out.append(
            {
                "round": m.get("round"),
                "attempt": m.get("attempt"),
                "task": m.get("task"),
                "reason": str(m.get("reason") or ""),
                "outcome": "retried" if later else "round aborted",
                "failed": {str(c): str(why) for c, why in (m.get("failed") or {}).items()},
            }
        )
    return out


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def _secure_aggregation(
    summary: dict[str, Any], metrics: list[dict[str, Any]], failed: list[dict[str, Any]]
) -> dict[str, Any]:
    """The scheme, and each attempt's record (completed rounds and failed attempts, in order)."""
    sa = dict(summary.get("secure_aggregation") or {"scheme": "none"})
    rounds = []
    aborted: list[Any] = []
    for m in sorted(metrics + failed, key=lambda m: (_int(m.get("round")), _int(m.get("attempt")))):
        rec = m.get("secure_aggregation")
        if not isinstance(rec, dict):
            continue
        row = {
            "round": m.get("round"),
            "attempt": m.get("attempt"),
            "cohort": rec.get("cohort"),
            "survivors": rec.get("survivors"),
            "threshold": rec.get("threshold"),
            "dropped": rec.get("dropped"),
            "aborted": rec.get("aborted") or "",
        }
        if m.get("kind") == "aborted" and not row["aborted"]:
            row["aborted"] = str(m.get("reason") or "aborted")
        rounds.append(row)
    for m in failed:  # rounds with a failed attempt, once each
        if m.get("round") not in aborted:
            aborted.append(m.get("round"))
    return {
        "scheme": sa.pop("scheme", "none"),
        "server_sees": sa.pop("server_sees", None),
        "parameters": {k: v for k, v in sa.items() if not k.endswith("_per_round")},
        "rounds": rounds,
        "aborted_rounds": aborted,
        "source": "summary.json (secure_aggregation), metrics.jsonl",
    }


def _threat_model(summary: dict[str, Any], audit: dict[str, Any] | None) -> dict[str, Any]:
    exposure = summary.get("exposure")
    sa = (summary.get("secure_aggregation") or {}).get("server_sees")
    design = {
        "global-head": "the global model including the classification head (one row per "
        "identity of every site) is shared with every client and the server",
        "server-sees-heads": "every client's class embeddings (its identities' templates) are "
        "uploaded to the server, which returns each to its owner only",
        "private-embedding": "class embeddings never leave their site; only the backbone is shared",
    }.get(exposure or "", "unknown design")
    out: dict[str, Any] = {
        "exposure": exposure,
        "design": design,
        "server_sees": sa,
        "audited": audit is not None,
        "source": "summary.json" + (", audit/results.json" if audit is not None else ""),
    }
    if audit is not None:
        from audits.run_audit import table_rows

        out["audit_summary"] = table_rows(audit)  # one row per party view, beside chance
        out["audit"] = audit
    return out


def _utility(summary: dict[str, Any], metrics: list[dict[str, Any]]) -> dict[str, Any]:
    per_round = []
    for m in metrics:
        held = m.get("held_out")
        if isinstance(held, dict) and "round" in m:
            per_round.append({"round": m["round"], **{k: held[k] for k in HEADLINE if k in held}})
    clients = summary.get("clients") or {}
    return {
        "evaluation": summary.get("evaluation"),
        "final": {k: summary.get(k) for k in HEADLINE if k in summary},
        "untrained": {k: v for k, v in (summary.get("untrained") or {}).items() if k in HEADLINE},
        "initial_model": summary.get("initial_model", "untrained (random initialisation)"),
        "roc": {  # final held-out ROC operating points, TAR at each FAR of the key
            k: v
            for k, v in (summary.get("held_out") or {}).items()
            if k.startswith("roc_tar_at_far_")
        },
        "per_round": per_round,
        "clients": {
            c: {k: v for k, v in m.items() if k in HEADLINE} for c, m in sorted(clients.items())
        },
        "clients_spread": _spread(summary.get("clients_summary")),
        # the initial model on the same clients' test images (runs without held-out
        # identities are judged by these two)
        "untrained_clients_spread": _spread(summary.get("untrained_clients_summary")),
        "source": "summary.json, metrics.jsonl",
    }


def _spread(summary: dict[str, Any] | None) -> dict[str, Any]:
    """The headline figures' across-client mean/std/min/max of a ``*_summary`` block."""
    return {k: v for k, v in (summary or {}).items() if k.rsplit("_", 1)[0] in HEADLINE}


def _provenance(
    path: Path, summary: dict[str, Any], config: dict[str, Any], config_text: bytes
) -> dict[str, Any]:
    prov = summary.get("provenance") or {}
    return {
        "version": prov.get("version", summary.get("version")),
        "commit": prov.get("commit"),
        "packages": prov.get("packages", {}),
        "started_at": prov.get("started_at"),
        # the server's later starts on the run (--resume); absent from older summaries
        "resumed_at": [s for s in prov.get("resumed_at") or [] if isinstance(s, str)],
        "ended_at": prov.get("ended_at"),
        "config_sha256": hashlib.sha256(config_text).hexdigest(),
        "data_manifest": _recorded_manifest(path, config),
        "source": "summary.json (provenance), config.toml, partition.json (data manifest)",
    }


def _recorded_manifest(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The data manifest ``partition.json`` recorded when the run started.

    Runs written before it was recorded get one computed now, said as such.
    """
    partition = path / "partition.json"
    if partition.is_file():
        recorded = read_json_object(partition, "the run's partition record")
        manifest = recorded.get("data_manifest")
        if isinstance(manifest, dict):  # with "changed_on_resume" when a resume saw other data
            return manifest
    import dataclasses

    from fl_secure.config import config_from_dict

    try:  # the table with its defaults filled in, as the server hashes it
        parsed = config_from_dict(config)
        data, seed = dataclasses.asdict(parsed.data), parsed.run.seed
    except FlSecureError:
        data, seed = config.get("data", {}), 0
    return {
        **data_manifest(data, seed=seed),
        "note": "computed when this report was written: the run recorded no data manifest",
    }


def _warnings(
    report: dict[str, Any], config: dict[str, Any], metrics: list[dict[str, Any]] | None = None
) -> list[dict[str, str]]:
    w: list[dict[str, str]] = []
    p = report["privacy"]
    if not p["differential_privacy"]:
        w.append(
            {
                "code": "dp-off",
                "message": "Differential privacy was off: the released "
                "models carry no (epsilon, delta) guarantee.",
            }
        )
    elif p["epsilon"] is not None and p["epsilon"] > 10:
        w.append(
            {
                "code": "epsilon-above-10",
                "message": f"epsilon = {p['epsilon']:.3g} is above "
                "10: the formal guarantee is weak.",
            }
        )
    if p["delta_below_one_over_population"] is False:
        w.append(
            {
                "code": "delta-not-below-1-over-n",
                "message": f"delta = {p['delta']:.3g} is not below 1/N for N = "
                f"{p['population']} {p.get('population_of', 'clients')}: a mechanism could "
                f"release one {'image' if p['privacy_unit'] == 'example' else 'client'}'s "
                "data outright.",
            }
        )
    if p["privacy_unit"] == "example" and not (config.get("privacy") or {}).get("sample_rate"):
        w.append(
            {
                "code": "example-count-public",
                "message": "privacy.sample_rate was not set: each client's DP-SGD sampling rate "
                "q = batch_size / N came from its image count N and was sent with its updates, "
                "so N is treated as public (Opacus' convention); the guarantee covers which "
                "images a site holds given their number. Set privacy.sample_rate to keep N "
                "private.",
            }
        )
    if report["secure_aggregation"]["scheme"] == "none":
        w.append(
            {
                "code": "no-secure-aggregation",
                "message": "No secure aggregation: the "
                "server saw every client's individual update.",
            }
        )
    elif not p["differential_privacy"]:
        who = "every client" if report["secure_aggregation"]["scheme"] == "ckks" else "the server"
        w.append(
            {
                "code": "secure-sum-without-dp",
                "message": "Secure aggregation without differential privacy hides whose "
                f"update is whose, not who took part: the summed update ({who} sees it) can "
                "still show which identities trained (see the audit's secure_sum entries).",
            }
        )
    if "plaintext" in str(report["run"].get("transport", "")):
        w.append(
            {
                "code": "insecure-transport",
                "message": "Plaintext transport was used "
                "(--insecure): updates and models crossed the network unencrypted.",
            }
        )
    if p.get("noise_from_csprng") is False:
        w.append(
            {
                "code": "noise-not-cryptographic",
                "message": "DP noise came from a seeded "
                "generator (privacy.secure_rng = false), not a CSPRNG.",
            }
        )
    if p["differential_privacy"] and p["noise_placement"] == "central":
        w.append(
            {
                "code": "central-noise",
                "message": "Noise was added by the server "
                "(central placement): the guarantee holds only if the server is trusted.",
            }
        )
    done = report["run"].get("rounds_completed")
    recorded = {m.get("round") for m in metrics or []} - {0}  # round 0: the initial model
    if metrics is not None and isinstance(done, int) and not set(range(1, done + 1)) <= recorded:
        w.append(
            {
                "code": "metrics-incomplete",
                "message": f"metrics.jsonl records {len(recorded & set(range(1, done + 1)))} "
                f"of the {done} completed rounds "
                "(missing, truncated or edited): the per-round figures and the secure-aggregation "
                "table below are incomplete.",
            }
        )
    led = report["ledger"]
    if not led.get("present") and (led.get("recorded_entries") or 0) > 0:
        w.append(
            {
                "code": "ledger-missing",
                "message": f"ledger.sqlite is missing, but the run recorded "
                f"{led['recorded_entries']} ledger entries: the privacy statement cannot be "
                "checked against its record.",
            }
        )
    elif not led.get("present") and led.get("summary_states_spending"):
        w.append(
            {
                "code": "ledger-missing",
                "message": "ledger.sqlite is missing, but summary.json states privacy spent "
                "(epsilon or accounted rounds): the privacy statement cannot be checked "
                "against its record.",
            }
        )
    stated_delta, kept_delta = p.get("delta_in_summary"), led.get("delta")
    if isinstance(stated_delta, (int, float)) and isinstance(kept_delta, (int, float)):
        if not math.isclose(stated_delta, kept_delta, rel_tol=1e-9, abs_tol=0.0):
            w.append(
                {
                    "code": "ledger-summary-mismatch",
                    "message": f"summary.json states delta = {stated_delta:.6g} but the privacy "
                    f"ledger records {kept_delta:.6g}; this report states the ledger's.",
                }
            )
    stated, kept = p.get("epsilon_in_summary"), led.get("epsilon")
    if isinstance(stated, (int, float)) and isinstance(kept, (int, float)):
        if not math.isclose(stated, kept, rel_tol=1e-9, abs_tol=1e-12):
            w.append(
                {
                    "code": "ledger-summary-mismatch",
                    "message": f"summary.json states epsilon = {stated:.6g} but the privacy "
                    f"ledger records {kept:.6g}; this report states the ledger's.",
                }
            )
    if report["ledger"].get("present") and not report["ledger"].get("verified"):
        w.append(
            {
                "code": "ledger-tampered",
                "message": "The privacy ledger failed "
                "verification: " + "; ".join(report["ledger"]["problems"]),
            }
        )
    model = report.get("model") or {}
    if model.get("problem") and not model.get("checkpoint"):
        w.append({"code": "model-missing", "message": f"{model['problem']}."})
    elif model.get("problem"):
        w.append({"code": "model-not-the-released-one", "message": f"{model['problem']}."})
    elif led.get("present") and model.get("sha256") and model.get("ledger_sha256") is None:
        w.append(
            {
                "code": "model-not-in-ledger",
                "message": "The ledger does not name the model it released (a ledger written "
                "before ledgers recorded model_sha256): the privacy statement is not tied to "
                f"{model.get('checkpoint')} by the ledger.",
            }
        )
    u = report["utility"]
    final, untrained = u["final"].get("tar_at_far_1e-2"), u["untrained"].get("tar_at_far_1e-2")
    where = "held-out identities"
    if final is None:  # no held-out identities: the clients' own test images
        final = u["clients_spread"].get("tar_at_far_1e-2_mean")
        untrained = u.get("untrained_clients_spread", {}).get("tar_at_far_1e-2_mean")
        where = "the clients' own test images (mean over clients; the run held out no identity)"
    if final is not None and untrained is not None and final <= untrained + NO_UTILITY_MARGIN:
        w.append(
            {
                "code": "no-utility",
                "message": f"The final model is no better than the initial one, "
                f"{u['initial_model']}, on {where}: TAR@FAR=1e-2 {final:.3f} vs "
                f"{untrained:.3f} (within {NO_UTILITY_MARGIN} or below); the privacy noise or "
                "the training budget left it unusable.",
            }
        )
    audit = report["threat_model"].get("audit")
    if audit is not None:
        from audits.run_audit import findings

        derived = findings(audit)
        stated = audit.get("findings")  # absent from results written before they were stored
        if stated is not None and stated != derived:
            w.append(
                {
                    "code": "audit-findings-differ",
                    "message": "audit/results.json states findings that its own numbers do "
                    "not give (the file was edited, or written by another version of "
                    f"fl-secure): it states {[f['code'] for f in stated]}, its numbers give "
                    f"{[f['code'] for f in derived]}; the warnings below are the latter.",
                }
            )
        w += derived
    redrawn = [m["round"] for m in metrics or [] if m.get("round") and m.get("attempt")]
    rate = p.get("sample_rate")
    if p["privacy_unit"] == "client" and rate is not None and rate < 1 and redrawn:
        w.append(
            {
                "code": "cohort-redrawn",
                "message": f"Rounds {redrawn} were released by a later attempt, after an "
                "attempt with too few updates: the released cohort is a draw conditioned on "
                "that failure, not exactly the sampling the accountant's amplification "
                f"assumes ({p['sampling']} at rate {rate}); the stated epsilon may be low.",
            }
        )
    if report["run"]["status"] != "completed":
        w.append(
            {
                "code": "run-not-completed",
                "message": f"The run ended with status "
                f"{report['run']['status']!r}: {report['run']['reason']}",
            }
        )
    return w


def _site_warnings(report: dict[str, Any], run_dir: Path) -> list[dict[str, str]]:
    """Site ledgers that could not be read, and releases the run's ledger does not account.

    A site's release of a round counts against the server only under local or distributed
    noise (central noise trusts the server). Per round, the run accounts its completed round
    and each discarded sum; a round with a failed attempt on record is left out (an attempt
    that ended before its sum was unmasked released nothing to the server, and one that
    did not is a discarded sum already). More releases than that in a round with no failed
    attempt on record are unexplained: a server that died mid-round under a version that did
    not mark attempts in flight, or a ledger that does not belong to these sites.
    """
    from collections import Counter

    from fl_secure.errors import PrivacyError
    from privacy.ledger.site_ledger import SiteLedger

    w: list[dict[str, str]] = []
    sites = report["sites"]["sites"]
    damaged = [s["client"] for s in sites if s["problem"]]
    if damaged:
        w.append(
            {
                "code": "site-ledger-unreadable",
                "message": f"The site ledgers of {damaged} could not be read (see the sites "
                "table): those sites' own figures are missing from this report.",
            }
        )
    if report["privacy"]["privacy_unit"] != "client" or not report["ledger"].get("present"):
        return w
    accounted = Counter(r["round"] for r in report["ledger"].get("epsilon_by_round") or [])
    with_failures = {f["round"] for f in report["run"]["failed_attempts"]}
    unexplained: dict[str, list[int]] = {}
    for site in sites:
        if site["problem"]:
            continue
        try:
            releases = SiteLedger(run_dir / "clients" / site["client"]).releases
        except PrivacyError:  # pragma: no cover - read just above without a problem
            continue
        counted = Counter(
            r.round
            for r in releases
            if r.unit == "client" and r.placement in ("local", "distributed")
        )
        rounds = sorted(
            r for r, n in counted.items() if r not in with_failures and n > accounted[r]
        )
        if rounds:
            unexplained[site["client"]] = rounds
    if unexplained:
        w.append(
            {
                "code": "sites-released-more",
                "message": "Sites released more updates in some rounds than the run's ledger "
                f"accounts for them, with no failed attempt on record: {unexplained} (site: "
                "rounds). A server that died mid-round under a version that did not mark "
                "attempts in flight leaves such releases unaccounted; each site's own figure "
                "in the sites table counts them all.",
            }
        )
    return w


def round_up(value: float, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits, rounded up: a stated bound is never lower."""
    if not (math.isfinite(value) and value > 0):
        return f"{value:.{digits}g}"
    step = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return f"{math.ceil(value / step - 1e-9) * step:.{digits}g}"


def _plain_summary(report: dict[str, Any]) -> list[str]:
    p, sa, u = report["privacy"], report["secure_aggregation"], report["utility"]
    lines = []
    if p["differential_privacy"] and not p["epsilon"]:  # None, or 0: nothing released
        lines.append("Differential privacy was configured, but no round was accounted.")
    elif p["differential_privacy"]:
        unit = "institution" if p["privacy_unit"] == "client" else "face image"
        change = {
            "replace-one": f"whether any one {unit} is replaced by another",
            "zero-out": f"whether any one {unit} sent its real update or a zero one (its "
            "noise share is sent either way)",
        }.get(p["adjacency"], f"whether or not any one {unit} took part")
        lines.append(
            f"Training was differentially private at the level of a whole {unit}: with "
            f"epsilon = {round_up(p['epsilon'])} and delta = "
            f"{round_up(p['delta']) if p['delta'] is not None else 'not recorded'} "
            f"({p['adjacency']} adjacency, {p['accountant']} accountant), the probability of "
            "any outcome of the released models changes by at most a factor e^epsilon = "
            f"{round_up(math.exp(min(p['epsilon'], 700)))} (plus delta) {change}"
            + (" (a weak bound: epsilon is above 5)." if p["epsilon"] > 5 else ".")
        )
    else:
        lines.append("Training was not differentially private.")
    if sa["scheme"] == "none":
        lines.append("The server saw each institution's individual model update.")
    else:
        lines.append(f"Updates were combined with {sa['scheme']}: {sa['server_sees']}.")
    lines.append(f"Design: {report['threat_model']['design']}.")
    final = u["final"].get("tar_at_far_1e-2")
    if final is not None:
        lines.append(f"Accuracy on identities no site trained on: TAR = {final:.3f} at FAR = 1e-2.")
    return lines


def json_text(report: dict[str, Any]) -> str:
    """``report.json``'s text (sorted keys, so regenerating it gives the same bytes).

    Raises:
        CheckpointError: The report holds a NaN or infinite number (strict JSON has none).
    """
    try:
        return json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except ValueError as exc:
        raise CheckpointError(f"the report cannot be written as JSON: {exc}") from exc


def write_json(report: dict[str, Any], path: Path) -> None:
    """Write ``report.json`` (atomically)."""
    from fl_secure.runs import atomic_write_bytes

    atomic_write_bytes(path, json_text(report).encode())
