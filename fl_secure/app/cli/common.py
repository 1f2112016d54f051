"""What every sub-command shares: logging, torch threads, ``--json`` output, argument types.

The command line sits in the application layer (:mod:`fl_secure.app`), above ``server``,
``client`` and ``audits``. Its modules import those layers inside the sub-command functions,
never at the top: ``fl-secure --help`` builds every sub-command's parser, and must not wait
for torch, grpc and tenseal (seconds to import).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable
from typing import Any, TypeAlias

#: What ``add_subparsers`` returns: each sub-command module adds its parser to it.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

#: Run outcomes that exit with 0: every round ran, or the privacy budget stopped it as asked.
SUCCESS = ("completed", "budget_exhausted")


def setup_logging(verbose: int, quiet: bool, default: int = logging.INFO) -> None:
    """Log to stderr at the level ``-v`` / ``--quiet`` ask for (``default`` without either)."""
    level = logging.WARNING if quiet else default if verbose == 0 else logging.DEBUG
    level = logging.INFO if verbose == 1 and default > logging.INFO else level
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=log_format, stream=sys.stderr)
    # opacus.utils.module_utils calls basicConfig when imported, which made ours a no-op and
    # left the root at WARNING: set the level and format on the handler it installed instead
    # of replacing it (force=True would rebind the root to whatever sys.stderr is now)
    root = logging.getLogger()
    root.setLevel(level)
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(log_format))


def torch_threads(n: int) -> None:
    """Pin torch's intra-op threads (default 1).

    On a shared or small machine, OpenMP threads that outnumber the free cores make each
    step many times slower (measured: 45x on 2 busy cores).
    """
    import torch  # heavy: only the sub-commands that train or attack pay for it

    torch.set_num_threads(max(1, n))


def print_json(obj: Any) -> None:
    """One JSON object on one line of stdout (``--json``)."""
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")


def add_output_flags(p: argparse.ArgumentParser) -> None:
    """``--json`` and ``--quiet``, which every leaf sub-command takes."""
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--quiet", action="store_true", help="log warnings only")


def number_arg(flag: str, ok: Callable[[float], bool], allowed: str) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number meeting ``ok`` whose error names ``flag``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {text!r}") from None
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"{flag} must be {allowed}, got {text}")
        return value

    return parse


def positive_int(flag: str) -> Callable[[str], int]:
    """An argparse ``type`` for an integer >= 1 whose error names ``flag``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {text}")
        return value

    return parse
