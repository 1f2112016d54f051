"""The report's HTML page printed to PDF by headless Chromium (no network, a private profile)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from fl_secure.errors import FlSecureError
from fl_secure.runs import atomic_write_bytes

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


def print_pdf(html_path: Path, pdf_path: Path, chromium: str) -> None:
    """Headless Chromium's print-to-PDF of the HTML file (no network).

    Chromium prints inside a private temporary folder; the PDF then replaces ``pdf_path``
    atomically with the report's other files' mode (0600: it may embed audit images), so a
    failed print leaves an earlier report.pdf as it was.

    Raises:
        FlSecureError: Chromium failed, timed out or printed no PDF (its last words are in
            the message).
    """
    atomic_write_bytes(Path(pdf_path), _printed(Path(html_path), chromium))


def pdf_of(page: str, chromium: str) -> bytes:
    """The PDF of an HTML page (the page is self-contained: where it is printed from is moot).

    Raises:
        FlSecureError: As :func:`print_pdf`.
    """
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "report.html"
        path.write_text(page, encoding="utf-8")
        return _printed(path, chromium)


def _printed(html_path: Path, chromium: str) -> bytes:
    """What Chromium prints of ``html_path``, in a private temporary folder."""
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
