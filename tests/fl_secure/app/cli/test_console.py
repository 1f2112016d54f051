"""`fl-secure --help` is fast: building every sub-command's parser imports no heavy library.

The sub-commands import torch, grpc, tenseal and opacus (seconds) only when they run; the
parsers' choices that live in those layers are kept in the CLI and tied here to their source.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fl_secure import __version__
from fl_secure.app.cli import privacy as privacy_cli
from privacy.dp.accountants.accountant import SAMPLINGS
from privacy.dp.accountants.registry import ACCOUNTANTS, DEFAULT_CLIENT_LEVEL

ROOT = Path(__file__).resolve().parents[4]
HEAVY = ("torch", "grpc", "tenseal", "opacus", "dp_accounting", "cryptography", "ray")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_help_imports_no_heavy_library() -> None:
    # Execute: the import log of `python -m fl_secure.app.cli --help`
    done = _cli("-X", "importtime", "-m", "fl_secure.app.cli", "--help")
    # Assert: the help went out, and no module of a heavy library was imported for it
    assert done.returncode == 0 and done.stdout.startswith("usage: fl-secure")
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    heavy = sorted({m for m in imported if m.split(".")[0] in HEAVY})
    assert heavy == [], f"fl-secure --help imported {heavy[:5]}"


def test_python_dash_m_runs_the_command() -> None:
    done = _cli("-m", "fl_secure.app.cli", "--version")
    assert done.returncode == 0 and done.stdout == f"fl-secure {__version__}\n"


def test_the_privacy_parser_choices_are_the_accountants_registry() -> None:
    assert privacy_cli.ACCOUNTANT_NAMES == tuple(sorted(ACCOUNTANTS))
    assert privacy_cli.DEFAULT_CLIENT_LEVEL == DEFAULT_CLIENT_LEVEL
    assert privacy_cli.SAMPLINGS == SAMPLINGS
