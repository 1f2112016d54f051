"""The ``fl-secure`` console script: one parser of every sub-command, and :func:`main`.

Each sub-command family has its module (:mod:`~fl_secure.app.cli.train`, ``simulate``,
``server``, ``client``, ``certs``, ``data``, ``privacy``, ``report``, ``evaluate``, ``audit``,
``experiment``) that adds its parser and runs it; :func:`main` sets up logging and turns
errors into exit codes.
"""

from __future__ import annotations

import argparse
import logging
import sys

from fl_secure import __version__
from fl_secure.app.cli import (
    audit,
    certs,
    client,
    data,
    evaluate,
    experiment,
    privacy,
    report,
    server,
    simulate,
    train,
)
from fl_secure.app.cli.common import setup_logging
from fl_secure.errors import FlSecureError


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    parser = argparse.ArgumentParser(
        prog="fl-secure",
        description="Privacy-focused, secure federated training of face-recognition models.",
    )
    parser.add_argument("--version", action="version", version=f"fl-secure {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0,
        help="more logging, and the traceback of an error; before the command: fl-secure -v "
        "train ...",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    families = (train, simulate, server, client, certs, data, privacy, report, evaluate, audit,
                experiment)  # fmt: skip
    for family in families:
        family.add_parser(sub)  # in this order in --help
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fl-secure`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # train and simulate show a progress display; their per-round log lines come with -v
    default = logging.WARNING if args.command in ("train", "privacy", "simulate") else logging.INFO
    setup_logging(args.verbose, getattr(args, "quiet", False), default)
    try:
        code: int = args.func(args)
    except FlSecureError as exc:
        print(f"fl-secure: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path that is a file, not writable, on a missing mount, ...
        if args.verbose:
            raise
        where = f": {exc.filename}" if exc.filename else ""
        print(  # -v belongs before the command: the sub-commands do not take it
            f"fl-secure: error: {exc.strerror or exc}{where} (`fl-secure -v {args.command} "
            "...` shows the traceback)",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("fl-secure: interrupted", file=sys.stderr)
        return 130
    return code
