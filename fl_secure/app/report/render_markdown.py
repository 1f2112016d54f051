"""Render ``report.json`` as Markdown, whose plots are the SVG files written beside it.

Every value and message is literal text (:func:`md_text`): a report's text can come from a
client, and none of it may become a link, an image or raw HTML.
"""

from __future__ import annotations

import html
import re
import urllib.parse
from collections.abc import Sequence
from typing import Any

from fl_secure.app.report.audit_rows import (
    AUDIT_HEADER,
    audit_rows,
    audit_summary_row,
    grid_captions,
)
from fl_secure.app.report.formatting import fmt
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
    out += ["", "## Run", "", table(["item", "value"], run_rows(report["run"]))]
    if report["run"].get("failed_attempts"):
        out += ["", "### Failed attempts", "", table(*failed_rows(report["run"]))]
    out += [
        "",
        "## Privacy statement",
        "",
        table(
            ["item", "value"],
            privacy_rows(p),
        ),
    ]
    out += ["", "## Privacy ledger", ""]
    if led.get("present"):
        out.append(
            f"Hash chain: **{'verified' if led['verified'] else 'FAILED'}**, "
            f"{t(led['entries'])} entries, head {t(led['head'])}. {t(against_summary(led))}"
        )
        out += ["", "![epsilon versus round](epsilon.svg)"]
        if led["example_level"]:
            out += [
                "",
                table(*example_rows(led)),
            ]
        if led.get("notes"):
            out += ["", "### Ledger notes", ""] + [f"- {t(line)}" for line in note_lines(led)]
    else:
        out.append(t(no_ledger(led)))
    sites = report.get("sites") or {}
    if sites.get("sites"):
        out += ["", "### Each site's own epsilon against the server", "", t(sites_text(sites))]
        out += ["", table(*site_rows(sites))]
    out += [
        "",
        "## Secure aggregation",
        "",
        f"Scheme **{t(sa['scheme'])}**; server sees: {t(fmt(sa['server_sees']))}; "
        f"parameters: {t(fmt(sa['parameters']))}; aborted rounds: "
        f"{t(fmt(sa['aborted_rounds'])) if sa['aborted_rounds'] else 'none'}.",
    ]
    if sa.get("malicious_server"):
        out += ["", f"Against a malicious server: {t(sa['malicious_server'])}."]
    if sa["rounds"]:
        out += ["", table(*secure_rows(sa))]
    out += [
        "",
        "## Threat model and design",
        "",
        f"Exposure **{t(fmt(tm['exposure']))}**: {t(tm['design'])}.",
    ]
    if tm.get("audit"):
        out += ["", table(AUDIT_HEADER, [audit_summary_row(r) for r in tm["audit_summary"]])]
        out += ["", "### Every audit number", ""]
        out += [table(["attack / view", "measure", "value", "chance"], audit_rows(tm["audit"]))]
        out += ["", "(All of them, with the threat model and settings: `audit/results.json`.)"]
        captions = grid_captions(tm["audit"])
        out += [f"\n![{t(captions.get(name, name))}]({urllib.parse.quote(name)})\n\n"
                f"*{t(captions.get(name, name))}*" for name in image_files]  # fmt: skip
    out += [
        "",
        "## Utility",
        "",
        table(*utility_rows(u)),
        "",
        "![held-out TAR per round](utility.svg)",
        "",
        "![final held-out ROC](roc.svg)",
    ]
    if u["clients"]:
        out += ["", "### Per-client scores (own test images) and their spread", ""]
        out += [table(*client_rows(u)), ""]
        out += [table(*spread_rows(u))]
    out += ["", "## Provenance", "", table(*provenance_rows(report)), ""]
    return "\n".join(out)
