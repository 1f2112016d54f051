"""Compliance reports: ``fl-secure report --run DIR [--format html,md,json,pdf]``.

:mod:`~fl_secure.app.report.build` collects the report JSON from the run's own records
(summary, metrics, ledger, audit), one module per section; :mod:`~fl_secure.app.report.write`
renders it as a self-contained HTML page (:mod:`~fl_secure.app.report.render_html`), Markdown
(:mod:`~fl_secure.app.report.render_markdown`) and a PDF (:mod:`~fl_secure.app.report.pdf`)
and writes the files. The JSON follows ``schema/report-v1.schema.json``.
"""

from fl_secure.app.report.build import REPORT_VERSION, build_report, load_schema
from fl_secure.app.report.write import FORMATS, write_report

__all__ = ["FORMATS", "REPORT_VERSION", "build_report", "load_schema", "write_report"]
