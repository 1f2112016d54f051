"""Benchmark of the attack audit: inversion speed, and the time to audit the quickstart run.

Prints one JSON object:

* ``inversion``: DeepInversion iterations per second on the quickstart model (``cnn``, 64x64
  images, 512-d embeddings), one iteration = one Adam step of one image, with the batch the
  audit uses (``targets x restarts`` images per step);
* ``quickstart_audit``: wall time of ``fl-secure audit`` (every attack, default settings) on a
  quickstart run. The quickstart takes about 3 minutes to train for its 20 rounds; by default
  this trains a shortened run (``--rounds 2``, real path: gRPC + mTLS, client-level DP,
  SecAgg) in a temporary folder and says so. ``--run DIR`` audits an existing run instead
  (the audit writes ``DIR/audit/``).

Each figure has its baseline from the same run: inversion steps per second against plain
forward/backward passes of the same batch through the same backbone
(``ratio_to_forward_backward``), and the audit's wall time against the training it audits
(``audit_to_train_ratio``; null with ``--run``, whose training was not timed here).
``--table RUN ...`` is not a measurement: it prints the README's Markdown table of audited
runs.

Run on 2 cores with torch pinned to 1 thread (the project's default)::

    python benchmarks/audit.py [--rounds 2] [--run DIR] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def inversion_speed(steps: int, targets: int = 10, restarts: int = 4) -> dict[str, Any]:
    """Iterations per second of :func:`audits.inversion.invert` on the quickstart backbone."""
    from audits.inversion import InversionConfig, fit_face_prior, invert, random_direction_target
    from fl_secure.data import SyntheticFaceConfig, generate_synthetic_faces
    from fl_secure.models import get_backbone

    torch.manual_seed(0)
    backbone = get_backbone("cnn", embedding_size=512, image_size=64)
    public = generate_synthetic_faces(
        SyntheticFaceConfig(num_identities=20, images_per_identity=4, image_size=64, seed=5)
    )
    prior = fit_face_prior(public.images, components=64)
    directions = random_direction_target(512, targets, generator=torch.Generator().manual_seed(0))
    cfg = InversionConfig(steps=steps, restarts=restarts, prior="subspace")
    started = time.perf_counter()
    invert(backbone, directions, image_size=64, config=cfg, face_prior=prior)
    seconds = time.perf_counter() - started
    # the baseline, in the same run: plain forward/backward passes of a batch of the same
    # size through the same backbone (what any inversion step must at least do)
    batch = torch.rand(targets * restarts, 3, 64, 64, requires_grad=True)
    backbone.eval()
    base_steps = max(5, steps // 10)
    started = time.perf_counter()
    for _ in range(base_steps):
        backbone(batch).sum().backward()
        batch.grad = None
    base_rate = base_steps / (time.perf_counter() - started)
    return {
        "model": "cnn (quickstart), 64x64, 512-d embedding, PCA face prior (64 components)",
        "batch_images": targets * restarts,
        "steps": steps,
        "seconds": round(seconds, 2),
        "steps_per_second": steps / seconds,
        "image_iterations_per_second": steps * targets * restarts / seconds,
        "baseline_forward_backward_per_second": base_rate,
        "ratio_to_forward_backward": round(steps / seconds / base_rate, 3),
    }


def train_quickstart(out: Path, rounds: int) -> Path:
    """A shortened quickstart run on the real path; returns its run directory."""
    done = subprocess.run(  # noqa: S603 - fixed arguments
        [sys.executable, "-m", "fl_secure.app.cli", "train", "--config",
         str(ROOT / "examples" / "quickstart.toml"), "--set", f"train.rounds={rounds}",
         "--out", str(out), "--json", "--quiet"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"quickstart training failed:\n{done.stderr[-3000:]}")
    return Path(json.loads(done.stdout.strip().splitlines()[-1])["run_dir"])


def main() -> None:
    """Run the benchmark and print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="audit this run instead of training one")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the quickstart run")
    parser.add_argument("--steps", type=int, default=200, help="inversion steps (audit default)")
    parser.add_argument(
        "--table", type=Path, nargs="+", metavar="RUN",
        help="only print the README table of these audited runs (RUN/audit/results.json)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    from audits.results import markdown_table
    from audits.run_audit import AuditSettings, audit_run

    if args.table:
        audited = [json.loads((r / "audit" / "results.json").read_text()) for r in args.table]
        print(markdown_table(audited), end="")
        return

    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "inversion": inversion_speed(args.steps),
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="audit-bench-") as tmp:
        if args.run is not None:
            run_dir, trained = args.run, "existing run (--run)"
            train_seconds = None
        else:
            started = time.perf_counter()
            run_dir = train_quickstart(Path(tmp), args.rounds)
            train_seconds = round(time.perf_counter() - started, 1)
            trained = (
                f"examples/quickstart.toml shortened to train.rounds={args.rounds} (of 20), "
                "trained here on the real path (gRPC + mTLS, client-level DP, SecAgg)"
            )
        started = time.perf_counter()
        audit = audit_run(run_dir, AuditSettings(steps=args.steps))
        seconds = time.perf_counter() - started
        result["quickstart_audit"] = {
            "run": trained,
            "train_seconds": train_seconds,
            "audit_seconds": round(seconds, 1),
            # the audit against the training it audits, both timed in this run
            "audit_to_train_ratio": (round(seconds / train_seconds, 3) if train_seconds else None),
            "attacks": sorted(audit["attacks"]),
            "settings": audit["settings"],
            "inversion_top1_server": audit["attacks"]["inversion"]["server"][
                audit["attacks"]["inversion"]["server"]["best"]
            ]["top1"],
            "chance_top1": 1.0 / audit["targets"]["count"],
            "empirical_epsilon_lower_bound": audit["attacks"]["canary"]["epsilon_lower_bound"],
            "accountant_epsilon": audit["attacks"]["canary"]["accountant_epsilon"],
        }
    print(json.dumps(result, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
