"""Write a run's report files: ``report.json``, ``.md``, ``.html`` and ``.pdf``, plots, grids.

Every file is rendered before any is written, and each is replaced atomically; the files an
earlier report wrote into the folder and this one did not are removed (and only those).
"""

from __future__ import annotations

import json
import logging
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fl_secure.app.report.audit_rows import grid_captions
from fl_secure.app.report.build import build_report, json_text
from fl_secure.app.report.pdf import find_chromium, pdf_of
from fl_secure.app.report.plots import plots
from fl_secure.app.report.render_html import render_html
from fl_secure.app.report.render_markdown import render_markdown
from fl_secure.errors import ConfigError
from fl_secure.runs import atomic_write_bytes

#: The package's logger: the report's log lines name ``fl_secure.app.report``.
log = logging.getLogger(__package__)


FORMATS = ("html", "md", "json", "pdf")


def write_report(
    run_dir: Path,
    formats: Sequence[str] = ("html", "md", "json"),
    *,
    include_images: bool = False,
    out: Path | None = None,
) -> dict[str, Path]:
    """Write the report of ``run_dir`` into ``out`` (default ``run_dir/report``).

    Audit image grids are embedded only when the run used synthetic faces, unless
    ``include_images`` (real faces must not leave the site by accident).
    """
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ConfigError(f"unknown report format {', '.join(unknown)}; use {', '.join(FORMATS)}")
    if not formats:
        raise ConfigError(f"no report format given; use one or more of {', '.join(FORMATS)}")
    chromium = find_chromium() if "pdf" in formats else None
    if "pdf" in formats and chromium is None:
        raise ConfigError("PDF output needs Chromium (Debian: apt-get install chromium)")
    report = build_report(run_dir)
    out = out or Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    images = _audit_images(Path(run_dir), report, include_images)
    # Every file is rendered before any is written: a report that fails to render leaves
    # the folder's previous report whole, never part old and part new.
    svgs = plots(report)
    files: dict[str, bytes] = {}
    if "json" in formats:
        files["report.json"] = json_text(report).encode()
    files |= {name: svg.encode() for name, svg in svgs.items()}
    files |= images
    if "md" in formats:
        files["report.md"] = render_markdown(report, sorted(images)).encode()
    if "html" in formats or "pdf" in formats:
        page = render_html(report, images, svgs)
        files["report.html"] = page.encode()
        if chromium is not None:
            files["report.pdf"] = pdf_of(page, chromium)
    for name, data in files.items():
        atomic_write_bytes(out / name, data)
    previous = _previous_files(out)
    if previous is None:  # no record: nothing here is provably an earlier report's
        names = (f"report.{f}" for f in FORMATS)
        kept = [name for name in names if name not in files and (out / name).is_file()]
        if kept:
            log.warning(
                "%s has no %s: %s left as they are (not provably written by fl-secure)",
                out,
                WRITTEN,
                ", ".join(kept),
            )
    for name in sorted((previous or set()) - set(files)):  # stale: an old PDF, a rerun's grid
        (out / name).unlink(missing_ok=True)
    atomic_write_bytes(out / WRITTEN, (json.dumps(sorted(files), indent=1) + "\n").encode())
    return {f: out / f"report.{f}" for f in FORMATS if f"report.{f}" in files}


def write_json(report: dict[str, Any], path: Path) -> None:
    """Write ``report.json`` (atomically)."""
    atomic_write_bytes(path, json_text(report).encode())


#: The files the last report wrote into its folder (what the next one replaces or removes).
WRITTEN = "report-files.json"


def _previous_files(out: Path) -> set[str] | None:
    """The files the previous report wrote into ``out`` (other files are never touched).

    Once the new report is written, those it did not write again are removed: no stale file
    (an old PDF, a grid of an audit since rerun) may sit beside a new report. Without the
    record (a folder of the user's, or a report written before the record existed) it is
    None: nothing is removed, since a ``report.md`` there may be the user's own.
    """
    record = out / WRITTEN
    if not record.is_file():
        return None
    try:
        loaded = json.loads(record.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        loaded = []
    names = [n for n in loaded if isinstance(n, str)] if isinstance(loaded, list) else []
    return {n for n in names if Path(n).name == n and not n.startswith(".") and n != WRITTEN}


def _audit_images(run_dir: Path, report: dict[str, Any], include: bool) -> dict[str, bytes]:
    audit_dir = run_dir / "audit"
    if not report["threat_model"].get("audited") or not audit_dir.is_dir():
        return {}
    prior = (report["threat_model"].get("audit") or {}).get("attacker_prior") or {}
    synthetic = _data_source(run_dir) == "synthetic" and not prior.get("from_real_faces")
    if not synthetic and not include:
        log.info("audit images of real faces left out of the report (--include-images)")
        return {}
    # only the grids audit/results.json names: a stray PNG in the folder is not this audit's
    named = sorted(grid_captions(report["threat_model"].get("audit")))
    missing = [name for name in named if not (audit_dir / name).is_file()]
    if missing:
        log.warning("audit grids named in results.json are missing: %s", ", ".join(missing))
    return {name: (audit_dir / name).read_bytes() for name in named if name not in missing}


def _data_source(run_dir: Path) -> str:
    config = tomllib.loads((run_dir / "config.toml").read_text(encoding="utf-8"))
    return str(config.get("data", {}).get("source", "synthetic"))
