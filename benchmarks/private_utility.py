"""Private utility benchmark: what DP fine-tuning of a pretrained face model keeps; prints JSON.

One table per run, every row a real ``fl-secure train`` (embedded: the server and 4 client
processes over gRPC + mTLS) of ``examples/lfw-private.toml`` (LFW aligned chips, degraded to
16 px, 40 held-out identities, dlib's face ResNet with its last block and embedding layer
trained):

- ``start``: the pretrained model before any round (round 0 of the non-private run);
- ``non_private``: federated fine-tuning without DP (``privacy.unit = none``);
- ``centralized``: the same recipe on the pooled training images (``--centralized``);
- ``{unit}_eps{E}``: federated fine-tuning under DP-SGD at each site, ``privacy.unit`` =
  ``identity`` (one person, all their images) or ``example`` (one image), target epsilon E
  at delta 1e-5 (noise calibrated to the budget by the PRV accountant).

``recovered`` = (private - start) / (non_private - start) at TAR@FAR=1e-2; the goal is >= 0.8 at
epsilon 8 and >= 0.5 at epsilon 1. It is ``null`` when the non-private run gains nothing.

Usage::

    fl-secure data align --in ../shared/data/lfw_min10_cap20 --out runs/lfw-chips
    python benchmarks/private_utility.py --chips runs/lfw-chips [--epsilons 1 4 8]
        [--units identity example] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("tar_at_far_1e-1", "tar_at_far_1e-2", "rank1")
HEADLINE = "tar_at_far_1e-2"
GOALS = {"8": 0.8, "1": 0.5}


def train(config: Path, overrides: list[str], out: Path, *extra: str) -> dict[str, Any]:
    """One embedded run; its summary with the wall time."""
    cmd = [sys.executable, "-m", "fl_secure.app.cli", "train", "--config", str(config)]
    cmd += ["--out", str(out), "--json", "--quiet", *extra]
    for o in overrides:
        cmd += ["--set", o]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    return summary


def row(summary: dict[str, Any], *, untrained: bool = False) -> dict[str, Any]:
    """The held-out figures of a run (or of its round-0 model), its epsilon and wall time."""
    figures = summary.get("untrained") if untrained else summary
    figures = figures if isinstance(figures, dict) else {}
    result = {k: _round(figures.get(k)) for k in KEYS}
    if not untrained:
        privacy = summary.get("privacy") if isinstance(summary.get("privacy"), dict) else {}
        result["epsilon"] = _round(privacy.get("epsilon") if privacy else None)
        result["status"] = summary.get("status")
        result["wall_s"] = summary.get("wall_s")
    return result


def _round(value: Any) -> Any:
    return round(float(value), 4) if isinstance(value, int | float) else value


def recovered(private: dict[str, Any], start: float, gain: float) -> float | None:
    """Share of the non-private gain a private run keeps at TAR@FAR=1e-2."""
    value = private.get(HEADLINE)
    if not isinstance(value, float) or gain <= 0:
        return None
    return round((value - start) / gain, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "lfw-private.toml")
    parser.add_argument("--chips", type=Path, required=True, help="folder `data align` wrote")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    parser.add_argument("--units", nargs="+", default=["identity", "example"])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, help="keep the run folders here (default: temporary)")
    args = parser.parse_args()
    if not (args.chips / "manifest.json").is_file():
        raise SystemExit(f"{args.chips} has no manifest.json: align the faces first (see --help)")
    base = [f"data.path={args.chips.resolve()}", *args.set]
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        plain = train(args.config, [*base, "privacy.unit=none"], out)
        rows["start"] = row(plain, untrained=True)
        rows["non_private"] = row(plain)
        rows["centralized"] = row(train(args.config, [*base, "privacy.unit=none"], out,
                                        "--centralized"))  # fmt: skip
        for unit in args.units:
            for eps in args.epsilons:
                dp = [f"privacy.unit={unit}", f"privacy.target_epsilon={eps:g}",
                      "privacy.delta=1e-5", "privacy.noise_placement=local"]  # fmt: skip
                rows[f"{unit}_eps{eps:g}"] = row(train(args.config, [*base, *dp], out))
    start = rows["start"][HEADLINE]
    gain = rows["non_private"][HEADLINE] - start
    for name, figures in rows.items():
        if name.split("_eps")[0] in args.units:
            figures["recovered"] = recovered(figures, start, gain)
    result = {
        "config": str(args.config),
        "overrides": base,
        "evaluation": "held-out identities (never at any site), all pairs",
        "rows": rows,
        "non_private_gain": round(gain, 4),
        "goals": {"recovered_min_at_epsilon": GOALS},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
