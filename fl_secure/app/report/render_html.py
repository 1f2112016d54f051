"""Render ``report.json`` as a self-contained HTML page.

The page embeds its plots (SVG) and images (PNG) as ``data:`` URLs, and its Content Security
Policy lets it load nothing from the network.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from typing import Any

from fl_secure.app.report.audit_rows import (
    AUDIT_HEADER,
    audit_rows,
    audit_summary_row,
    grid_captions,
)
from fl_secure.app.report.formatting import BOUNDS, fmt, fmt_bound
from fl_secure.app.report.plots import plots
from fl_secure.app.report.rows import (
    against_summary,
    client_rows,
    example_rows,
    failed_rows,
    no_ledger,
    note_lines,
    privacy_rows,
    provenance_rows,
    run_rows,
    secure_rows,
    site_rows,
    sites_text,
    spread_rows,
    utility_rows,
)


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

    p, led, sa, tm, u = (
        report[k] for k in ("privacy", "ledger", "secure_aggregation", "threat_model", "utility")
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
    parts.append(table(["item", "value"], run_rows(report["run"])))
    if report["run"].get("failed_attempts"):
        parts.append("<h3>Failed attempts</h3>")
        parts.append(table(*failed_rows(report["run"])))

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
            privacy_rows(p),
        )
    )
    parts.append("<h2>Privacy ledger</h2>")
    if led.get("present"):
        status = "verified" if led["verified"] else "FAILED: " + "; ".join(led["problems"])
        cls = "ok" if led["verified"] else "bad"
        parts.append(
            f"<p>Hash chain: <b class='{cls}'>{e(status)}</b>, {led['entries']} "
            f"entries, head <code>{e(str(led['head']))}</code>. {e(against_summary(led))}</p>"
        )
        parts.append(
            img(
                "epsilon.svg", svgs["epsilon.svg"].encode(), "image/svg+xml", "epsilon versus round"
            )
        )
        if led["example_level"]:
            parts.append("<h3>Example-level epsilon per client</h3>")
            parts.append(table(*example_rows(led)))
        if led.get("notes"):
            parts.append("<h3>Ledger notes</h3><ul class='notes'>")
            parts += [f"<li>{e(line)}</li>" for line in note_lines(led)]
            parts.append("</ul>")
    else:
        parts.append(f"<p>{e(no_ledger(led))}</p>")
    sites = report.get("sites") or {}
    if sites.get("sites"):
        parts.append("<h3>Each site's own epsilon against the server</h3>")
        parts.append(f"<p>{e(sites_text(sites))}</p>")
        parts.append(table(*site_rows(sites)))
    parts.append("<h2>Secure aggregation</h2>")
    parts.append(
        f"<p>Scheme: <b>{e(sa['scheme'])}</b>. Server sees: {e(fmt(sa['server_sees']))}."
        f" Parameters: <code>{e(fmt(sa['parameters']))}</code>. Aborted rounds: "
        f"{e(fmt(sa['aborted_rounds']) if sa['aborted_rounds'] else 'none')}.</p>"
    )
    if sa.get("malicious_server"):
        parts.append(f"<p>Against a malicious server: {e(sa['malicious_server'])}.</p>")
    if sa["rounds"]:
        parts.append(table(*secure_rows(sa)))
    parts.append("<h2>Threat model and design</h2>")
    parts.append(
        f"<p>Exposure: <b>{e(fmt(tm['exposure']))}</b> — {e(tm['design'])}. "
        f"Server sees: {e(fmt(tm['server_sees']))}.</p>"
    )
    if tm.get("audit"):
        parts.append("<h3>Attack audit (audit/results.json)</h3>")
        parts.append(table(AUDIT_HEADER, [audit_summary_row(r) for r in tm["audit_summary"]]))
        parts.append("<details><summary>Every audit number</summary>")
        parts.append(
            table(["attack / view", "measure", "value", "chance"], audit_rows(tm["audit"]))
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
    parts.append(table(*utility_rows(u)))
    parts.append(
        img("utility.svg", svgs["utility.svg"].encode(), "image/svg+xml", "held-out TAR per round")
    )
    if u.get("roc"):
        parts.append(
            img("roc.svg", svgs["roc.svg"].encode(), "image/svg+xml", "final held-out ROC")
        )
    if u["clients"]:
        parts.append("<h3>Per-client scores (own test images) and their spread</h3>")
        parts.append(table(*client_rows(u)))
        parts.append(table(*spread_rows(u)))
    parts.append("<h2>Provenance</h2>")
    parts.append(table(*provenance_rows(report)))
    parts.append(
        f"<p>Report format {e(report['report_version'])}; every number comes from the "
        "run's summary.json, metrics.jsonl, ledger.sqlite or audit/results.json.</p>"
    )
    parts.append("</body></html>")
    return "\n".join(parts)
