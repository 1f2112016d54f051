"""Render ``report.json`` as a self-contained HTML page, Markdown, and (with Chromium) PDF.

The HTML embeds its plots (SVG) and images (PNG) as ``data:`` URLs and loads nothing from the
network; the Markdown refers to the same SVG files written beside it.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
import shutil
import subprocess
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fl_secure.app.report.build import round_up

#: Where Debian's Chromium lives; PDF output needs it.
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def find_chromium() -> str | None:
    """Path of a Chromium binary, or None."""
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


# ------------------------------------------------------------------ plots (SVG, no deps)
def line_plot(
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    width: int = 560,
    height: int = 300,
) -> str:
    """A small SVG line plot of named (x, y) series with axes and ticks."""
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    points = [p for s in series.values() for p in s]
    left, right, top, bottom = 60, 20, 30, 45
    w, h = width - left - right, height - top - bottom
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13">'
        f"{html.escape(title)}</text>",
    ]
    if not points:
        out.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no data</text>')
        return "\n".join([*out, "</svg>"])
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(0.0, min(p[1] for p in points)), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * w

    def sy(y: float) -> float:
        return top + h - (y - y0) / (y1 - y0) * h

    out.append(f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="black"/>')
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="black"/>')
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        xv = x0 + (x1 - x0) * i / 4
        out.append(f'<text x="{left - 6}" y="{sy(yv) + 4:.1f}" text-anchor="end">{yv:.3g}</text>')
        out.append(
            f'<text x="{sx(xv):.1f}" y="{top + h + 16}" text-anchor="middle">{xv:.3g}</text>'
        )
    out.append(
        f'<text x="{left + w / 2}" y="{height - 6}" text-anchor="middle">'
        f"{html.escape(xlabel)}</text>"
    )
    out.append(
        f'<text x="14" y="{top + h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {top + h / 2})">{html.escape(ylabel)}</text>'
    )
    for k, (name, pts) in enumerate(series.items()):
        colour = colours[k % len(colours)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}"/>')
        for x, y in pts:
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>')
        out.append(
            f'<text x="{left + w - 4}" y="{top + 14 + 14 * k}" text-anchor="end" '
            f'fill="{colour}">{html.escape(name)}</text>'
        )
    return "\n".join([*out, "</svg>"])


def finite(value: Any) -> bool:
    """Whether ``value`` is a finite number (not None, NaN, a bool or text)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _points(rows: Sequence[dict[str, Any]], x: str, y: str) -> list[tuple[float, float]]:
    """(x, y) of the rows where both are finite numbers: a null (NaN) figure is no point."""
    return [(float(r[x]), float(r[y])) for r in rows if finite(r.get(x)) and finite(r.get(y))]


def _roc_points(roc: dict[str, Any]) -> list[tuple[float, float]]:
    """(log10 FAR, TAR) of the ROC operating points with a finite TAR and a positive FAR."""
    points = []
    for key, tar in roc.items():
        try:
            far = float(key.removeprefix("roc_tar_at_far_"))
        except ValueError:
            continue
        if finite(tar) and math.isfinite(far) and far > 0:
            points.append((math.log10(far), float(tar)))
    return sorted(points)


def plots(report: dict[str, Any]) -> dict[str, str]:
    """The report's plots as SVG text, by file name (figures that are null are left out)."""
    eps = _points(report["ledger"].get("epsilon_by_round", []), "round", "epsilon")
    per_round = report["utility"]["per_round"]
    utility = {
        f"TAR@FAR={far}": _points(per_round, "round", f"tar_at_far_{far}")
        for far in ("1e-1", "1e-2", "1e-3")
    }
    roc = _roc_points(report["utility"].get("roc", {}))
    return {
        "roc.svg": line_plot(
            {"final model": roc},
            title="Held-out ROC (final model)",
            xlabel="log10 FAR",
            ylabel="TAR",
        ),
        "epsilon.svg": line_plot(
            {"epsilon (ledger)": eps},
            title="Privacy spent per round",
            xlabel="round",
            ylabel="epsilon",
        ),
        "utility.svg": line_plot(
            utility, title="Held-out verification per round", xlabel="round", ylabel="TAR"
        ),
    }


# ------------------------------------------------------------------ shared formatting
def fmt(value: Any) -> str:
    """Numbers to 4 significant digits (NaN or infinite: n/a); everything else as text."""
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "—"}[value]
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else "n/a"
    if isinstance(value, list | dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def fmt_figure(value: Any) -> str:
    """A utility figure: null (the run wrote null for a NaN score) or not finite is n/a."""
    return fmt(value) if finite(value) else "n/a"


def fmt_bound(value: Any) -> str:
    """An upper bound (epsilon, delta) to 4 significant digits, rounded up, never down."""
    if isinstance(value, float):
        return round_up(value, 4)
    return fmt(value)


def fmt_lower(value: Any) -> str:
    """A lower bound (an empirical epsilon) to 4 significant digits, rounded down, never up."""
    if isinstance(value, float) and math.isfinite(value) and value > 0:
        step = 10.0 ** (math.floor(math.log10(value)) - 3)
        return f"{math.floor(value / step + 1e-9) * step:.4g}"
    return fmt(value)


def fmt_measure(key: str, value: Any) -> str:
    """An audit figure: epsilon lower bounds rounded down, epsilons and deltas up."""
    if "epsilon" in key and "lower" in key:
        return fmt_lower(value)
    if "epsilon" in key or "delta" in key:
        return fmt_bound(value)
    return fmt(value)


#: Rows shown with :func:`fmt_bound`: a statement must not round a bound down.
BOUNDS = frozenset({"epsilon", "delta", "target_epsilon"})


PRIVACY_ROWS = (
    ("setting", "Setting"),
    ("privacy_unit", "Privacy unit"),
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
    ("population", "Population N"),
    ("population_of", "N counts"),
    ("delta_below_one_over_population", "delta < 1/N"),
    ("released", "What is released"),
    ("hyperparameter_tuning_accounted", "Hyper-parameter tuning accounted"),
    ("noise_from_csprng", "Noise from a CSPRNG"),
    ("noise_generator", "Noise generator"),
)


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


def _run_rows(run: dict[str, Any]) -> list[list[str]]:
    """The run's facts that it recorded (a row left out when the run did not record it)."""
    return [[label, fmt(run.get(k))] for k, label in RUN_ROWS if run.get(k) is not None]


def _failed_rows(run: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Each failed attempt of a round: what happened next, why, and each client's failure."""
    header = ["round", "attempt", "task", "outcome", "reason", "clients that failed"]
    rows = [
        [fmt(a["round"]), fmt(a["attempt"]), fmt(a["task"]), a["outcome"], a["reason"],
         "; ".join(f"{c}: {why}" for c, why in sorted(a["failed"].items()))]
        for a in run.get("failed_attempts") or []
    ]  # fmt: skip
    return header, rows


AUDIT_HEADER = (
    "party view",
    "direction attacked",
    "inversion top-1 [95% CI]",
    "chance",
    "KNN distance (chance)",
    "SSIM (chance)",
    "templates top-1 [95% CI]",
    "empirical epsilon >=",
    "accountant epsilon",
)


def _audit_summary_row(r: dict[str, Any]) -> list[str]:
    def with_ci(value: Any, ci: Any) -> str:
        return fmt(value) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if isinstance(ci, list) else "")

    def with_chance(value: Any, chance: Any) -> str:
        return fmt(value) + (f" ({fmt(chance)})" if chance is not None else "")

    eps = fmt_lower(r.get("epsilon_lower_bound"))
    if r.get("epsilon_lower_bound_at_audit_cap"):
        eps += " (the audit's cap: a perfect attack; a larger audit could show more)"
    return [
        fmt(r.get("party")),
        fmt(r.get("direction")),
        with_ci(r.get("top1"), r.get("top1_ci95")),
        fmt(r.get("chance")),
        with_chance(r.get("knn_distance"), r.get("chance_knn_distance")),
        with_chance(r.get("ssim"), r.get("chance_ssim")),
        with_ci(r.get("templates_top1"), r.get("templates_top1_ci95")),
        eps,
        fmt_bound(r.get("accountant_epsilon")),
    ]


#: measures compared with a node's "chance" (a by_attack entry's values as well)
_CHANCE_MEASURES = frozenset(
    {"top1", "participant_precision", "exact_inputs", "row_ratios", "span"}
)


#: (key holding a chance level, the measure it is the chance level of); "*": every measure
#: of _CHANCE_MEASURES without a level of its own
_CHANCE_KEYS = (
    ("chance", "*"),
    ("chance_top1", "top1"),
    ("chance_top5", "top5"),
    ("chance_knn_distance", "knn_distance"),
    ("chance_ssim", "ssim"),
    ("chance_psnr_db", "psnr_db"),
)


def _audit_rows(audit: dict[str, Any]) -> list[list[str]]:
    """Flatten the audit's attack results into (attack, view, measure, value, chance) rows."""
    rows: list[list[str]] = []

    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    def walk(prefix: str, node: Any, inherited: dict[str, float]) -> None:
        if isinstance(node, dict):
            # chance level per measure: top-5 has its own; identification-style scores
            # (top1, participant_precision, each attack under by_attack) use "chance"
            levels = dict(inherited)
            for key, measure in _CHANCE_KEYS:
                if number(node.get(key)):
                    levels[measure] = float(node[key])
            for k, v in sorted(node.items()):
                if number(v) and not k.startswith("chance"):
                    level = levels.get(k, levels.get("*") if k in _CHANCE_MEASURES else None)
                    shown = fmt_measure(k, v)
                    rows.append([prefix, k, shown, fmt(level) if level is not None else ""])
                elif isinstance(v, dict | list):
                    inherit = levels if k == "by_attack" else {}
                    walk(f"{prefix}/{k}" if prefix else k, v, inherit)
        elif isinstance(node, list):
            for i, v in enumerate(node[:50]):
                walk(f"{prefix}[{i}]", v, {})

    walk("", audit.get("attacks", audit), {})
    return rows[:400]


def grid_captions(audit: dict[str, Any] | None) -> dict[str, str]:
    """What each audit image grid shows, by file name (from ``audit/results.json``).

    Parties that hold the same view (a global head: the server and every client) share one
    grid, so a caption names every party whose attack wrote it.
    """
    seen: dict[str, tuple[list[str], str, dict[str, Any]]] = {}
    for party, view in sorted(((audit or {}).get("attacks") or {}).get("inversion", {}).items()):
        for direction, entry in sorted(view.items()):
            if isinstance(entry, dict) and isinstance(entry.get("grid"), str):
                seen.setdefault(entry["grid"], ([], direction, entry))[0].append(party)
    return {
        name: (
            f"Model inversion from the view of {' and '.join(parties)}, {direction} "
            f"({entry.get('target_direction', '')}). One target per row: three of its real "
            "images (the judge's, never seen by the attacker), then the reconstruction. "
            f"Judged top-1 {fmt(entry.get('top1'))} against chance "
            f"{fmt(entry.get('chance_top1'))}."
        )
        for name, (parties, direction, entry) in seen.items()
    }


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


def _client_rows(u: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    keys = sorted({k for m in u["clients"].values() for k in m})
    rows = [[c, *(fmt_figure(m.get(k)) for k in keys)] for c, m in u["clients"].items()]
    return ["client", *keys], rows


def _utility_rows(u: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The final model's headline figures beside the initial model's (null figures: n/a)."""
    rows = [[k, fmt_figure(v), fmt_figure(u["untrained"].get(k))] for k, v in u["final"].items()]
    return ["measure", "final", f"round 0: {u['initial_model']}"], rows


def _privacy_rows(p: dict[str, Any]) -> list[list[str]]:
    """The privacy statement's rows; bounds (epsilon, delta) rounded up."""
    return [[label, (fmt_bound if k in BOUNDS else fmt)(p.get(k))] for k, label in PRIVACY_ROWS]


def _example_rows(led: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Each client's example-level epsilon (running total) with its DP-SGD settings."""
    header = ["client", "round", "epsilon", "delta", "noise multiplier z", "sampling rate q",
              "accountant"]  # fmt: skip
    rows = [
        [r["client"], fmt(r["round"]), fmt_bound(r["epsilon"]), fmt_bound(r["delta"]),
         fmt(r.get("noise_multiplier")), fmt(r.get("sample_rate")), fmt(r.get("accountant"))]
        for r in led["example_level"]
    ]  # fmt: skip
    return header, rows


def _site_rows(sites: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
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


def _secure_rows(sa: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
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


def _sites_text(sites: dict[str, Any]) -> str:
    return f"At delta = {fmt_bound(sites['delta'])}: {sites['what']}. Source: {sites['source']}."


def _spread_rows(u: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The across-client spread of the final model beside the initial model's."""
    initial = u.get("untrained_clients_spread") or {}
    rows = [
        [k, fmt_figure(v), fmt_figure(initial.get(k))]
        for k, v in sorted(u["clients_spread"].items())
    ]
    return ["measure", "final model", "initial model"], rows


# ------------------------------------------------------------------ HTML
def render_html(
    report: dict[str, Any], images: dict[str, bytes], svgs: dict[str, str] | None = None
) -> str:
    """A self-contained page: every plot and image inline, no network requests."""
    e = html.escape

    def table(header: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
        head = "".join(f"<th>{e(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
        return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'

    def img(name: str, data: bytes, mime: str, alt: str) -> str:
        b64 = base64.b64encode(data).decode()
        return f'<img alt="{e(alt)}" data-name="{e(name)}" src="data:{mime};base64,{b64}">'

    p, led, sa, tm, u, prov = (
        report[k]
        for k in (
            "privacy",
            "ledger",
            "secure_aggregation",
            "threat_model",
            "utility",
            "provenance",
        )
    )
    svgs = svgs if svgs is not None else plots(report)
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; "
        "img-src data:; style-src 'unsafe-inline'\">",
        f"<title>fl-secure compliance report: {e(report['run']['name'])}</title>",
        "<style>body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #bbb;"
        "padding:3px 8px;text-align:left;vertical-align:top;font-size:13px}th{background:#eee}"
        ".warn{background:#fff3cd;border:1px solid #e0b000;padding:.5em 1em;margin:.3em 0}"
        ".ok{color:#176317}.bad{color:#a00}.num{font-family:monospace}</style></head><body>",
        f"<h1>Compliance report — {e(report['run']['name'])}</h1>",
    ]
    parts.append("<h2>Warnings</h2>")
    if report["warnings"]:
        parts += [
            f'<div class="warn" id="warn-{e(w["code"])}">{e(w["message"])}</div>'
            for w in report["warnings"]
        ]
    else:
        parts.append("<p class='ok'>None.</p>")
    parts.append("<h2>Summary</h2><ul>")
    parts += [f"<li>{e(line)}</li>" for line in report["plain_summary"]]
    parts.append("</ul>")
    parts.append("<h2>Run</h2>")
    parts.append(table(["item", "value"], _run_rows(report["run"])))
    if report["run"].get("failed_attempts"):
        parts.append("<h3>Failed attempts</h3>")
        parts.append(table(*_failed_rows(report["run"])))

    def value(name: str, v: Any) -> str:  # shown rounded, exact in data-value
        shown = fmt_bound(v) if name in BOUNDS else fmt(v)
        return f"<span id='{name}' data-value='{e(json.dumps(v))}'>{e(shown)}</span>"

    parts.append(
        f"<p class='num'>epsilon = {value('epsilon', p['epsilon'])}, delta = "
        f"{value('delta', p['delta'])}, TAR@FAR=1e-2 = "
        f"{value('tar', u['final'].get('tar_at_far_1e-2'))}</p>"
    )
    parts.append("<h2>Privacy statement</h2>")
    parts.append(
        table(
            ["item", "value"],
            _privacy_rows(p),
        )
    )
    parts.append("<h2>Privacy ledger</h2>")
    if led.get("present"):
        status = "verified" if led["verified"] else "FAILED: " + "; ".join(led["problems"])
        cls = "ok" if led["verified"] else "bad"
        parts.append(
            f"<p>Hash chain: <b class='{cls}'>{e(status)}</b>, {led['entries']} "
            f"entries, head <code>{e(str(led['head']))}</code>. {e(_against(led))}</p>"
        )
        parts.append(
            img(
                "epsilon.svg", svgs["epsilon.svg"].encode(), "image/svg+xml", "epsilon versus round"
            )
        )
        if led["example_level"]:
            parts.append("<h3>Example-level epsilon per client</h3>")
            parts.append(table(*_example_rows(led)))
        if led.get("notes"):
            parts.append("<h3>Ledger notes</h3><ul class='notes'>")
            parts += [f"<li>{e(line)}</li>" for line in _note_lines(led)]
            parts.append("</ul>")
    else:
        parts.append(f"<p>{e(_no_ledger(led))}</p>")
    sites = report.get("sites") or {}
    if sites.get("sites"):
        parts.append("<h3>Each site's own epsilon against the server</h3>")
        parts.append(f"<p>{e(_sites_text(sites))}</p>")
        parts.append(table(*_site_rows(sites)))
    parts.append("<h2>Secure aggregation</h2>")
    parts.append(
        f"<p>Scheme: <b>{e(sa['scheme'])}</b>. Server sees: {e(fmt(sa['server_sees']))}."
        f" Parameters: <code>{e(fmt(sa['parameters']))}</code>. Aborted rounds: "
        f"{e(fmt(sa['aborted_rounds']) if sa['aborted_rounds'] else 'none')}.</p>"
    )
    if sa["rounds"]:
        parts.append(table(*_secure_rows(sa)))
    parts.append("<h2>Threat model and design</h2>")
    parts.append(
        f"<p>Exposure: <b>{e(fmt(tm['exposure']))}</b> — {e(tm['design'])}. "
        f"Server sees: {e(fmt(tm['server_sees']))}.</p>"
    )
    if tm.get("audit"):
        parts.append("<h3>Attack audit (audit/results.json)</h3>")
        parts.append(table(AUDIT_HEADER, [_audit_summary_row(r) for r in tm["audit_summary"]]))
        parts.append("<details><summary>Every audit number</summary>")
        parts.append(
            table(["attack / view", "measure", "value", "chance"], _audit_rows(tm["audit"]))
        )
        parts.append("</details>")
        captions = grid_captions(tm["audit"])
        for name, data in sorted(images.items()):
            caption = captions.get(name, name)
            parts.append(
                f"<figure>{img(name, data, 'image/png', caption)}"
                f"<figcaption>{e(caption)} <code>{e(name)}</code></figcaption></figure>"
            )
    else:
        parts.append("<p>Not audited: run <code>fl-secure audit --run DIR</code>.</p>")
    parts.append("<h2>Utility</h2>")
    parts.append(f"<p>{e(fmt(u['evaluation']))}</p>")
    parts.append(table(*_utility_rows(u)))
    parts.append(
        img("utility.svg", svgs["utility.svg"].encode(), "image/svg+xml", "held-out TAR per round")
    )
    if u.get("roc"):
        parts.append(
            img("roc.svg", svgs["roc.svg"].encode(), "image/svg+xml", "final held-out ROC")
        )
    if u["clients"]:
        parts.append("<h3>Per-client scores (own test images) and their spread</h3>")
        parts.append(table(*_client_rows(u)))
        parts.append(table(*_spread_rows(u)))
    parts.append("<h2>Provenance</h2>")
    rows = [
        [k, fmt(prov.get(k))]
        for k in ("version", "commit", "started_at", "resumed_at", "ended_at", "config_sha256")
    ]
    rows.append(["data manifest", fmt(prov["data_manifest"])])
    rows.append(["released model", model_line(report.get("model"))])
    rows += [[f"package {k}", fmt(v)] for k, v in sorted(prov["packages"].items())]
    parts.append(table(["item", "value"], rows))
    parts.append(
        f"<p>Report format {e(report['report_version'])}; every number comes from the "
        "run's summary.json, metrics.jsonl, ledger.sqlite or audit/results.json.</p>"
    )
    parts.append("</body></html>")
    return "\n".join(parts)


# ------------------------------------------------------------------ Markdown
#: Markdown's inline syntax: code, emphasis, links and images, tables, strikethrough, escapes.
#: An underscore inside a word (``tar_at_far``) is no emphasis and is left as it is.
_MD_SPECIAL = re.compile(r"[\\`*\[\]|~]|(?<![^\W_])_|_(?![^\W_])")
#: What would start a block (heading, list, quote) at the start of a line.
_MD_BLOCK_START = re.compile(r"^(\s*(?:\d{1,9})?)([#+=.)-])(?=[\s#=-]|$)")


def md_text(value: Any) -> str:
    """``value`` as literal Markdown text on one line: nothing in it is markup.

    Text in a report can come from a client (a refused upload's tensor name reaches the stop
    reason); no link, image (a remote pixel), raw HTML or table cell may be made of it.
    HTML's ``& < >`` become entities, Markdown's metacharacters are backslash-escaped, and
    line breaks become spaces.
    """
    text = " ".join(str(value).splitlines())
    text = html.escape(text, quote=False)
    text = _MD_SPECIAL.sub(lambda m: "\\" + m.group(0), text)
    return _MD_BLOCK_START.sub(lambda m: m.group(1) + "\\" + m.group(2), text)


def render_markdown(report: dict[str, Any], image_files: Sequence[str]) -> str:
    """The same content as Markdown (plots as the SVG files beside it).

    Every value and message goes through :func:`md_text`; only the report's own structure
    (headings, tables, emphasis, the plot and grid files' links) is markup.
    """
    p, led, sa, tm, u = (
        report[k] for k in ("privacy", "ledger", "secure_aggregation", "threat_model", "utility")
    )
    t = md_text

    def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
        lines = ["| " + " | ".join(t(h) for h in header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(t(c) for c in row) + " |" for row in rows]
        return "\n".join(lines)

    out = [f"# Compliance report — {t(report['run']['name'])}", "", "## Warnings", ""]
    out += [f"- **{t(w['code'])}**: {t(w['message'])}" for w in report["warnings"]] or ["None."]
    out += ["", "## Summary", ""] + [f"- {t(line)}" for line in report["plain_summary"]]
    out += ["", "## Run", "", table(["item", "value"], _run_rows(report["run"]))]
    if report["run"].get("failed_attempts"):
        out += ["", "### Failed attempts", "", table(*_failed_rows(report["run"]))]
    out += [
        "",
        "## Privacy statement",
        "",
        table(
            ["item", "value"],
            _privacy_rows(p),
        ),
    ]
    out += ["", "## Privacy ledger", ""]
    if led.get("present"):
        out.append(
            f"Hash chain: **{'verified' if led['verified'] else 'FAILED'}**, "
            f"{t(led['entries'])} entries, head {t(led['head'])}. {t(_against(led))}"
        )
        out += ["", "![epsilon versus round](epsilon.svg)"]
        if led["example_level"]:
            out += [
                "",
                table(*_example_rows(led)),
            ]
        if led.get("notes"):
            out += ["", "### Ledger notes", ""] + [f"- {t(line)}" for line in _note_lines(led)]
    else:
        out.append(t(_no_ledger(led)))
    sites = report.get("sites") or {}
    if sites.get("sites"):
        out += ["", "### Each site's own epsilon against the server", "", t(_sites_text(sites))]
        out += ["", table(*_site_rows(sites))]
    out += [
        "",
        "## Secure aggregation",
        "",
        f"Scheme **{t(sa['scheme'])}**; server sees: {t(fmt(sa['server_sees']))}; "
        f"parameters: {t(fmt(sa['parameters']))}; aborted rounds: "
        f"{t(fmt(sa['aborted_rounds'])) if sa['aborted_rounds'] else 'none'}.",
    ]
    if sa["rounds"]:
        out += ["", table(*_secure_rows(sa))]
    out += [
        "",
        "## Threat model and design",
        "",
        f"Exposure **{t(fmt(tm['exposure']))}**: {t(tm['design'])}.",
    ]
    if tm.get("audit"):
        out += ["", table(AUDIT_HEADER, [_audit_summary_row(r) for r in tm["audit_summary"]])]
        out += ["", "### Every audit number", ""]
        out += [table(["attack / view", "measure", "value", "chance"], _audit_rows(tm["audit"]))]
        out += ["", "(All of them, with the threat model and settings: `audit/results.json`.)"]
        captions = grid_captions(tm["audit"])
        out += [f"\n![{t(captions.get(name, name))}]({urllib.parse.quote(name)})\n\n"
                f"*{t(captions.get(name, name))}*" for name in image_files]  # fmt: skip
    out += [
        "",
        "## Utility",
        "",
        table(*_utility_rows(u)),
        "",
        "![held-out TAR per round](utility.svg)",
        "",
        "![final held-out ROC](roc.svg)",
    ]
    if u["clients"]:
        out += ["", "### Per-client scores (own test images) and their spread", ""]
        out += [table(*_client_rows(u)), ""]
        out += [table(*_spread_rows(u))]
    prov = report["provenance"]
    out += [
        "",
        "## Provenance",
        "",
        table(
            ["item", "value"],
            [
                [k, fmt(prov.get(k))]
                for k in (
                    "version",
                    "commit",
                    "started_at",
                    "resumed_at",
                    "ended_at",
                    "config_sha256",
                )
            ]
            + [["data manifest", fmt(prov["data_manifest"])]]
            + [["released model", model_line(report.get("model"))]]
            + [[f"package {k}", fmt(v)] for k, v in sorted(prov["packages"].items())],
        ),
        "",
    ]
    return "\n".join(out)


def print_pdf(html_path: Path, pdf_path: Path, chromium: str) -> None:
    """Headless Chromium's print-to-PDF of the HTML file (no network).

    Chromium prints inside a private temporary folder; the PDF then replaces ``pdf_path``
    atomically with the report's other files' mode (0600: it may embed audit images), so a
    failed print leaves an earlier report.pdf as it was.

    Raises:
        FlSecureError: Chromium failed, timed out or printed no PDF (its last words are in
            the message).
    """
    from fl_secure.runs import atomic_write_bytes

    atomic_write_bytes(Path(pdf_path), _printed(Path(html_path), chromium))


def pdf_of(page: str, chromium: str) -> bytes:
    """The PDF of an HTML page (the page is self-contained: where it is printed from is moot).

    Raises:
        FlSecureError: As :func:`print_pdf`.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "report.html"
        path.write_text(page, encoding="utf-8")
        return _printed(path, chromium)


def _printed(html_path: Path, chromium: str) -> bytes:
    """What Chromium prints of ``html_path``, in a private temporary folder."""
    import tempfile

    from fl_secure.errors import FlSecureError

    with tempfile.TemporaryDirectory() as work:
        printed = Path(work) / "report.pdf"
        try:
            subprocess.run(  # noqa: S603 - fixed binary and arguments
                [
                    chromium,
                    *CHROMIUM_FLAGS,
                    f"--user-data-dir={Path(work) / 'profile'}",
                    "--no-pdf-header-footer",
                    f"--print-to-pdf={printed}",
                    Path(html_path).resolve().as_uri(),  # as_uri() needs an absolute path
                ],
                check=True,
                capture_output=True,
                timeout=120,
            )
        except subprocess.CalledProcessError as exc:
            said = exc.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
            raise FlSecureError(
                f"{chromium} could not print the report to PDF (exit {exc.returncode}): "
                + (" / ".join(said) or "no message")
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise FlSecureError(
                f"{chromium} did not print the report to PDF within {exc.timeout:.0f} s"
            ) from exc
        data = printed.read_bytes() if printed.is_file() else b""
    if not data.startswith(b"%PDF-"):
        raise FlSecureError(f"{chromium} exited without writing a PDF")
    return data


def _note_lines(led: dict[str, Any]) -> list[str]:
    """The ledger's notes (a discarded sum the server saw, a budget stop), one per line."""
    return [f"Round {fmt(n.get('round'))}: {fmt(n.get('message'))}" for n in led["notes"]]


def _no_ledger(led: dict[str, Any]) -> str:
    if led.get("recorded_entries"):
        return (
            f"No ledger: ledger.sqlite is MISSING, though the run recorded "
            f"{led['recorded_entries']} entries."
        )
    if led.get("summary_states_spending"):
        return "No ledger: ledger.sqlite is MISSING, though summary.json states privacy spent."
    return "No ledger: this run spent no privacy budget."


def _against(led: dict[str, Any]) -> str:
    if not led.get("checked_against_summary"):
        return "No head recorded in summary.json: entries dropped from the end go unseen."
    after = led.get("entries_after_summary") or 0
    return "Checked against the entry count and head summary.json recorded" + (
        f" ({after} entries appended since)." if after else "."
    )
