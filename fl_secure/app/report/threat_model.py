"""The report's threat-model section: the design's exposure and, when audited, the audit.

The audit's own results (``audit/results.json``) are carried whole, with one row per party
view beside chance (:func:`audits.results.table_rows`).
"""

from __future__ import annotations

from typing import Any

from audits.results import table_rows


def threat_model_section(summary: dict[str, Any], audit: dict[str, Any] | None) -> dict[str, Any]:
    """The design's exposure, what the server sees, and the audit's results when there are any."""
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
        out["audit_summary"] = table_rows(audit)  # one row per party view, beside chance
        out["audit"] = audit
    return out
