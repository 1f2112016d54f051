"""``fl-secure data``: data steps a site runs on its own images before it trains.

``fl-secure data align --in RAW --out CHIPS`` detects each face, finds its 5 landmarks and
writes dlib's aligned chip (the geometry the ``dlib-resnet`` backbone expects), with a
manifest of every input file: aligned, no face found, several faces (which one was taken),
unreadable. Nothing is dropped silently (:mod:`fl_secure.data.align`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fl_secure.app.cli.common import (
    Subparsers,
    add_output_flags,
    number_arg,
    positive_int,
    print_json,
)
from fl_secure.errors import DataError

# Imports that load torch or dlib are inside the functions: `fl-secure --help` stays fast
# (fl_secure.app.cli says why). The choices below are fl_secure.data.dlib_faces.DETECTORS and
# fl_secure.data.align.FALLBACKS; tests/fl_secure/app/cli/test_data.py checks they agree.
DETECTORS = ("hog", "cnn")
FALLBACKS = ("none", "center")


def add_parser(sub: Subparsers) -> None:
    """Add ``data`` and its ``align`` step."""
    data = sub.add_parser("data", help="data steps a site runs on its own images (align)")
    steps = data.add_subparsers(dest="step", required=True)
    p = steps.add_parser(
        "align",
        help="detect, landmark and align faces into 150 px chips, with a manifest",
        description="Walks RAW/<identity>/<image>, detects the face (dlib HOG, or the MMOD CNN "
        "with --detector cnn), finds 5 landmarks and writes dlib's aligned chip to "
        "CHIPS/<identity>/<stem>.png, and CHIPS/manifest.json with one entry per input file "
        "(aligned, several_faces: the largest taken, no_face, fallback_center, unreadable). "
        "Needs pip install 'fl-secure[faces]'. Real faces stay at the site: CHIPS is a local "
        "folder for `fl-secure client --data`. If no image held a detectable face it is an "
        "error (exit 2) naming RAW and the count; the manifest is written all the same.",
    )
    p.add_argument(
        "--in",
        dest="src",
        type=Path,
        required=True,
        metavar="RAW",
        help="folder of identity folders of raw images",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="CHIPS",
        help="folder to write the chips and manifest.json to",
    )
    p.add_argument(
        "--size",
        type=positive_int("--size"),
        default=150,
        help="chip side in pixels (default 150, dlib-resnet's input)",
    )
    p.add_argument(
        "--padding",
        type=number_arg("--padding", lambda x: 0 <= x <= 1, "in [0, 1]"),
        default=0.25,
        help="border around the landmarks, as dlib's get_face_chip (default 0.25)",
    )
    p.add_argument(
        "--detector",
        choices=DETECTORS,
        default="hog",
        help="face detector: hog (fast) or cnn (dlib's MMOD: slower, finds more)",
    )
    p.add_argument(
        "--upsample",
        type=int,
        choices=range(0, 4),
        default=1,
        metavar="{0..3}",
        help="times the image is upsampled before detection (default 1; 0 suits "
        "small frontal faces such as ORL's)",
    )
    p.add_argument(
        "--fallback",
        choices=FALLBACKS,
        default="none",
        help="an image with no face found: none (listed, no chip) or center (a "
        "centre crop, listed as fallback_center)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an earlier alignment's CHIPS folder"
    )
    add_output_flags(p)
    p.set_defaults(func=cmd_align)


def cmd_align(args: argparse.Namespace) -> int:
    """Align a site's identity folders; an error (exit 2) when no image held a face.

    The chips (``--fallback center``'s crops included) and the manifest are written first, so
    the manifest says what became of every file even then.
    """
    from fl_secure.data.align import align_folder

    report = align_folder(
        args.src,
        args.out,
        size=args.size,
        padding=args.padding,
        detector=args.detector,
        upsample=args.upsample,
        fallback=args.fallback,
        overwrite=args.overwrite,
        progress=not (args.json or args.quiet),
    )
    doc = report.to_dict()
    if args.json:
        print_json(
            {key: doc[key] for key in ("totals", "unaligned_identities") if key in doc}
            | {
                "chips": report.chips,
                "out": str(args.out),
                "manifest": str(args.out / "manifest.json"),
            }
        )
    else:
        print(report.summary())
    if (error := report.no_face_error()) is not None:  # the manifest is written all the same
        raise DataError(error)
    return 0
