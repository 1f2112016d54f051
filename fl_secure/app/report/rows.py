"""The report's tables as rows of text, shared by the HTML and the Markdown.

Each function turns one section of ``report.json`` into a header and rows (or a sentence);
the renderers only escape and lay them out. The audit's tables are in
:mod:`~fl_secure.app.report.audit_rows`.
"""

from __future__ import annotations

from typing import Any

from fl_secure.app.report.formatting import BOUNDS, fmt, fmt_bound, fmt_figure

RUN_ROWS = (
    ("status", "Status"),
    ("reason", "Reason"),
    ("algorithm", "Algorithm"),
    ("exposure", "Exposure"),
    ("rounds_completed", "Rounds completed"),
    ("rounds_planned", "Rounds planned"),
    ("num_clients", "Clients (enrolled)"),
    ("partition", "Partition (config)"),
    ("client_train_sizes", "Training images per client"),
    ("client_reported_examples", "Examples each site reported at join"),
    ("transport", "Transport"),
)


def run_rows(run: dict[str, Any]) -> list[list[str]]:
    """The run's facts that it recorded (a row left out when the run did not record it)."""
    return [[label, fmt(run.get(k))] for k, label in RUN_ROWS if run.get(k) is not None]


def failed_rows(run: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Each failed attempt of a round: what happened next, why, and each client's failure."""
    header = ["round", "attempt", "task", "outcome", "reason", "clients that failed"]
    rows = [
        [fmt(a["round"]), fmt(a["attempt"]), fmt(a["task"]), a["outcome"], a["reason"],
         "; ".join(f"{c}: {why}" for c, why in sorted(a["failed"].items()))]
        for a in run.get("failed_attempts") or []
    ]  # fmt: skip
    return header, rows


PRIVACY_ROWS = (
    ("setting", "Setting"),
    ("privacy_unit", "Privacy unit"),
    ("protected_record", "Protected record"),
    ("adjacency", "Adjacency"),
    ("mechanism", "Mechanism"),
    ("noise_placement", "Noise placement"),
    ("noise_placement_trusts", "Who must be trusted"),
    ("clip_norm", "Clip norm C"),
    ("noise_multiplier", "Noise multiplier z"),
    ("noise_distribution", "Noise distribution"),
    ("effective_noise_multiplier", "Noise the released sum carried (last round, in units of C)"),
    (
        "noise_shares_required",
        "Noise shares a release needs (distributed noise: each client adds z C / sqrt(t); "
        "t = server.min_clients, not the secure-aggregation threshold)",
    ),
    ("target_epsilon", "Target epsilon"),
    ("sampling", "Client sampling"),
    ("sample_rate", "Sampling rate"),
    ("sampling_assumption", "Accountant's sampling assumption"),
    ("rounds_accounted", "Rounds accounted"),
    (
        "discarded_sums_accounted",
        "Releases the server saw in attempts it discarded (each composed like a round)",
    ),
    ("accountant", "Accountant"),
    ("epsilon", "Epsilon"),
    ("delta", "Delta"),
    ("epsilon_amplified", "Epsilon with amplification by the server's Poisson sampling"),
    ("epsilon_amplified_trusts", "That figure trusts"),
    ("population", "Population N"),
    ("population_of", "N counts"),
    ("delta_below_one_over_population", "delta < 1/N"),
    ("released", "What is released"),
    ("hyperparameter_tuning_accounted", "Hyper-parameter tuning accounted"),
    ("noise_from_csprng", "Noise from a CSPRNG"),
    ("noise_generator", "Noise generator"),
)


def privacy_rows(p: dict[str, Any]) -> list[list[str]]:
    """The privacy statement's rows; bounds (epsilon, delta) rounded up."""
    return [[label, (fmt_bound if k in BOUNDS else fmt)(p.get(k))] for k, label in PRIVACY_ROWS]


def no_ledger(led: dict[str, Any]) -> str:
    """Why the run has no ledger, and whether it should have one."""
    if led.get("recorded_entries"):
        return (
            f"No ledger: ledger.sqlite is MISSING, though the run recorded "
            f"{led['recorded_entries']} entries."
        )
    if led.get("summary_states_spending"):
        return "No ledger: ledger.sqlite is MISSING, though summary.json states privacy spent."
    return "No ledger: this run spent no privacy budget."


def against_summary(led: dict[str, Any]) -> str:
    """Whether the ledger was checked against the head ``summary.json`` recorded."""
    if not led.get("checked_against_summary"):
        return "No head recorded in summary.json: entries dropped from the end go unseen."
    after = led.get("entries_after_summary") or 0
    return "Checked against the entry count and head summary.json recorded" + (
        f" ({after} entries appended since)." if after else "."
    )


def note_lines(led: dict[str, Any]) -> list[str]:
    """The ledger's notes (a discarded sum the server saw, a budget stop), one per line."""
    return [f"Round {fmt(n.get('round'))}: {fmt(n.get('message'))}" for n in led["notes"]]


def example_rows(led: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Each client's example-level epsilon (running total) with its DP-SGD settings."""
    header = ["client", "round", "epsilon", "delta", "noise multiplier z", "sampling rate q",
              "accountant"]  # fmt: skip
    rows = [
        [r["client"], fmt(r["round"]), fmt_bound(r["epsilon"]), fmt_bound(r["delta"]),
         fmt(r.get("noise_multiplier")), fmt(r.get("sample_rate")), fmt(r.get("accountant"))]
        for r in led["example_level"]
    ]  # fmt: skip
    return header, rows


def sites_text(sites: dict[str, Any]) -> str:
    """What the sites' table states, at which delta, and where the figures come from."""
    return f"At delta = {fmt_bound(sites['delta'])}: {sites['what']}. Source: {sites['source']}."


def site_rows(sites: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Each site's own epsilon against the server (its site ledger)."""
    header = ["site", "updates released", "epsilon (peers honest)", "epsilon (peers collude)",
              "releases without client-level noise", "epsilon (one image, peers honest)",
              "epsilon (one image, peers collude)", "problem"]  # fmt: skip

    def eps(r: dict[str, Any], key: str) -> str:
        return "∞ (unbounded)" if key in r.get("unbounded", ()) else fmt_bound(r.get(key))

    rows = [
        [r["client"], fmt(r["releases"]), eps(r, "epsilon"), eps(r, "epsilon_colluding_peers"),
         fmt(r["releases_without_client_level_noise"]), eps(r, "example_epsilon"),
         eps(r, "example_epsilon_colluding_peers"), r["problem"] or ""]
        for r in sites["sites"]
    ]  # fmt: skip
    return header, rows


def secure_rows(sa: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The secure-aggregation rounds, one row per attempt (HTML and Markdown alike)."""
    header = ["round", "attempt", "cohort", "survivors", "SecAgg threshold (shares to unmask)",
              "dropped", "aborted"]  # fmt: skip
    rows = [
        [fmt(r["round"]), fmt(r.get("attempt")), str(len(r["cohort"] or [])),
         str(len(r["survivors"] or [])), fmt(r["threshold"]), fmt(r.get("dropped")),
         r["aborted"]]
        for r in sa["rounds"]
    ]  # fmt: skip
    return header, rows


def utility_rows(u: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The final model's headline figures beside the initial model's (null figures: n/a)."""
    rows = [[k, fmt_figure(v), fmt_figure(u["untrained"].get(k))] for k, v in u["final"].items()]
    return ["measure", "final", f"round 0: {u['initial_model']}"], rows


def client_rows(u: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Each client's headline figures on its own test images (null figures: n/a)."""
    keys = sorted({k for m in u["clients"].values() for k in m})
    rows = [[c, *(fmt_figure(m.get(k)) for k in keys)] for c, m in u["clients"].items()]
    return ["client", *keys], rows


def spread_rows(u: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The across-client spread of the final model beside the initial model's."""
    initial = u.get("untrained_clients_spread") or {}
    rows = [
        [k, fmt_figure(v), fmt_figure(initial.get(k))]
        for k, v in sorted(u["clients_spread"].items())
    ]
    return ["measure", "final model", "initial model"], rows


def model_line(model: dict[str, Any] | None) -> str:
    """The released model's file and SHA-256, and whether the ledger names that file."""
    if not model or not model.get("checkpoint"):
        problem = (model or {}).get("problem")
        return "no checkpoint" + (f"; PROBLEM: {problem}" if problem else "")
    if not model.get("sha256"):
        return f"{model['checkpoint']}: {model.get('problem') or 'unreadable'}"
    line = f"{model['checkpoint']} (round {model['round']}), SHA-256 {model['sha256']}"
    if model.get("problem"):
        return f"{line}; PROBLEM: {model['problem']}"
    if model.get("matches_ledger"):
        return f"{line}; the file the privacy ledger's rows of that round name"
    return f"{line}; not named by a privacy ledger"


def pretrained_line(pretrained: Any) -> str:
    """The weights a run's backbone started from, with their SHA-256, in one line."""
    if not isinstance(pretrained, dict):
        return "none: random initialisation"
    line = f"{pretrained.get('name')} (sha256 {pretrained.get('sha256')})"
    if pretrained.get("source"):
        line += (
            f", converted from {pretrained['source']} (sha256 {pretrained.get('source_sha256')})"
        )
    return line


def provenance_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Where the run came from: versions, times, hashes, data, the released model, packages."""
    prov = report["provenance"]
    keys = ("version", "commit", "started_at", "resumed_at", "ended_at", "config_sha256")
    rows = [[k, fmt(prov.get(k))] for k in keys]
    rows.append(["data manifest", fmt(prov["data_manifest"])])
    rows.append(["pretrained weights", pretrained_line(prov.get("pretrained"))])
    rows.append(["released model", model_line(report.get("model"))])
    rows += [[f"package {k}", fmt(v)] for k, v in sorted(prov["packages"].items())]
    return ["item", "value"], rows
