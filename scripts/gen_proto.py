"""Regenerate the committed protobuf/gRPC code from proto/ (``--check``: fail on drift).

Generated files: ``fl_secure/v1/*_pb2.py``, ``*_pb2_grpc.py`` and ``*.pyi`` stubs.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
OUT_PACKAGE = Path("fl_secure") / "v1"


def generate(out_root: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) into ``out_root``; return the generated files."""
    from grpc_tools import protoc  # imported here: a dev-only dependency

    # protoc finds the mypy plugins (mypy-protobuf) next to this interpreter.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    protos = sorted(PROTO_ROOT.glob("fl_secure/v1/*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in (out_root / OUT_PACKAGE).iterdir() if p.name != "__init__.py")


def main() -> int:
    """Regenerate, or with --check compare against the committed files."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code drifts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        target = ROOT / OUT_PACKAGE
        if args.check:
            committed = {p.name for p in target.iterdir() if p.name != "__init__.py"}
            committed -= {"__pycache__"}
            fresh = {p.name for p in files}
            drift = sorted(committed ^ fresh)
            drift += [
                p.name
                for p in files
                if p.name in committed and not filecmp.cmp(p, target / p.name, shallow=False)
            ]
            if drift:
                print("protobuf code drifted; run `make proto`:", ", ".join(drift))
                return 1
            print(f"protobuf code up to date ({len(files)} files)")
            return 0
        for p in files:
            shutil.copyfile(p, target / p.name)
            print("wrote", target / p.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
