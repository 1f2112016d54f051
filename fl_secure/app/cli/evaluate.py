"""``fl-secure eval``: a run's model scored on its held-out identities or LFW pairs."""

from __future__ import annotations

import argparse
from pathlib import Path

from fl_secure.app.cli.common import Subparsers, add_output_flags, print_json

# Imports that load torch, grpc or tenseal are inside the functions: `fl-secure --help` stays
# fast (fl_secure.app.cli.common says why).


def add_parser(sub: Subparsers) -> None:
    """Add ``eval``."""
    p = sub.add_parser("eval", help="evaluate a run's model on held-out identities or LFW pairs")
    p.add_argument("--run", type=Path, required=True, help="run directory")
    p.add_argument("--round", type=int, help="checkpoint round (default: latest)")
    p.add_argument("--lfw-pairs", type=Path, help="pairs file (pairs.txt or pairsDevTest.txt)")
    p.add_argument("--lfw-root", type=Path, help="LFW image root for --lfw-pairs")
    p.add_argument(
        "--center-crop",
        type=int,
        help="centre crop of the LFW images before resizing (default: the run's "
        "data.center_crop, the crop it trained on; 0: none)",
    )
    add_output_flags(p)
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a checkpoint of a run on the run's held-out identities or an LFW pairs file."""
    from fl_secure.app.evaluate import evaluate_run

    result = evaluate_run(
        args.run,
        round_=args.round,
        lfw_pairs=args.lfw_pairs,
        lfw_root=args.lfw_root,
        center_crop=args.center_crop,
    )
    if args.json:
        print_json(result)
    else:
        for key, value in result.items():
            if value is None:  # null: a crop that is none; an overlap the server cannot count
                value = "none" if key == "center_crop" else "unknown"
            print(f"{key:>20}: {value}")
    return 0
