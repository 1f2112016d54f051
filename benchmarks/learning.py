"""Learning benchmark: the quickstart, federated vs centralized, in one run; prints JSON.

Runs ``fl-secure train`` (embedded: server + 4 client processes over gRPC + mTLS) and
``fl-secure train --centralized`` (same backbone, recipe and passes) on the same config, then
reports held-out TAR@FAR for both, the untrained model's, and the ratio (goal: federated >= 0.8
at FAR=1e-2 and >= 0.9x centralized; untrained < 0.3). A config without held-out identities
(``examples/orl.toml``) is scored by the clients' mean on their own test images.

Both sides run without differential privacy (``privacy.unit=none`` is applied first; the
centralized baseline has no DP), so this measures what federation costs; the price of DP is
measured by ``benchmarks/dp.py --part curve``.

Usage: python benchmarks/learning.py [--config examples/quickstart.toml] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("tar_at_far_1e-1", "tar_at_far_1e-2", "tar_at_far_1e-3", "rank1")


def train(config: Path, overrides: list[str], out: Path, *extra: str) -> dict[str, object]:
    cmd = [sys.executable, "-m", "fl_secure.app.cli", "train", "--config", str(config)]
    cmd += ["--out", str(out), "--json", "--quiet", *extra]
    for o in overrides:
        cmd += ["--set", o]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "quickstart.toml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    args.set = ["privacy.unit=none", *args.set]
    with tempfile.TemporaryDirectory() as tmp:
        fed = train(args.config, args.set, Path(tmp))
        cen = train(args.config, args.set, Path(tmp), "--centralized")
    evaluation, fed_figures, untrained = _figures(fed)
    cen_figures = _figures(cen)[1]
    fed_tar, cen_tar = fed_figures["tar_at_far_1e-2"], cen_figures["tar_at_far_1e-2"]
    result = {
        "config": str(args.config),
        "overrides": args.set,
        "evaluation": evaluation,
        "federated": {**fed_figures, "wall_s": fed.get("wall_s"), "status": fed.get("status")},
        "centralized": {**cen_figures, "wall_s": cen.get("wall_s"), "status": cen.get("status")},
        "untrained": untrained,
        "ratio_tar_at_far_1e-2": (
            round(float(fed_tar) / float(cen_tar), 3)
            if isinstance(fed_tar, float) and isinstance(cen_tar, float) and cen_tar > 0
            else None
        ),
        "goals": {"federated_min": 0.8, "ratio_min": 0.9, "untrained_max": 0.3},
    }
    print(json.dumps(result, indent=2))


def _figures(summary: dict[str, object]) -> tuple[str, dict[str, object], dict[str, object]]:
    """(evaluation, trained figures, untrained figures) of a run's summary.

    The held-out identities' figures; a config without held-out identities (ORL) has the
    clients' mean on their own test images instead (``clients_summary``).
    """
    if summary.get("tar_at_far_1e-2") is not None:
        untrained = summary.get("untrained") or {}
        assert isinstance(untrained, dict)
        return (
            "held-out identities",
            {k: summary.get(k) for k in KEYS},
            {k: untrained.get(k) for k in KEYS},
        )
    clients = summary.get("clients_summary") or {}
    before = summary.get("untrained_clients_summary") or {}
    assert isinstance(clients, dict) and isinstance(before, dict)
    return (
        "mean over clients of their own test images (no held-out identities)",
        {k: clients.get(f"{k}_mean") for k in KEYS},
        {k: before.get(f"{k}_mean") for k in KEYS},
    )


if __name__ == "__main__":
    main()
