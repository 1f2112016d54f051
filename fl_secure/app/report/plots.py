"""The report's plots as small SVG line plots (no plotting library).

Epsilon per round (from the ledger), held-out TAR per round and the final held-out ROC. A
figure that is null (a NaN score) is no point of its plot.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fl_secure.app.report.formatting import finite


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
