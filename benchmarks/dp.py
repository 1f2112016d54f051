"""DP-SGD benchmark: prints one JSON object.

Part ``throughput`` (default): local training of the default ``cnn`` backbone (CosFace head)
on 64x64 synthetic faces (40 identities x 20 images), plain ``train_local`` (batch 32) vs
``train_local_dpsgd`` (Opacus, Poisson sampling with expected batch 32, ChaCha20 noise), the
same number of steps on every side. DP-SGD runs twice: with the default clipping engine
(``book-keeping``, :mod:`privacy.dp.bookkeeping`) and with Opacus' per-example-gradient hooks
(``clipping = "opacus"``). Every measurement runs in a fresh child process
(multiprocessing "spawn", one torch thread), the sides alternating, so each side's peak
memory is its own process's max RSS (``ru_maxrss``) and all sides see the same machine
load. Reports the medians over repeats and the ratios DP-SGD / plain (throughput goal:
>= 0.5). Memory in MiB, two ratios each: whole-process peak (``*_peak_memory_ratio``) and
what training adds over the set-up every side shares (``*_training_memory_ratio``: peak
minus the RSS after imports, data and model).

Part ``curve``: the utility-privacy curve. Embedded runs (server + client processes over gRPC
+ mTLS) of the committed synthetic quickstart and ORL configs without DP and with a budget of
epsilon 1, 4 and 8 (delta 1e-5; noise calibrated to the budget) at the client level
(DP-FedAvg) and the example level (DP-SGD); reports TAR@FAR=1e-2 (held-out identities for
synthetic, the clients' own test images for ORL) and the final epsilon of each run.

Usage: python benchmarks/dp.py [--part throughput] [--repeats 3] [--steps 25]
       python benchmarks/dp.py --part curve [--data synthetic orl] [--units client example]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from fl_secure.models.heads import HeadKind

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

THROUGHPUT_GOAL = 0.5


@dataclass(frozen=True)
class ThroughputSetup:
    """What both sides train on."""

    backbone: str = "cnn"
    head: HeadKind = "cosface"
    image_size: int = 64
    identities: int = 40
    images_per_identity: int = 20
    batch_size: int = 32  # plain batch = DP-SGD expected batch (q * n)
    steps: int = 25  # one epoch of either side at 800 examples
    learning_rate: float = 0.1
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    max_physical_batch_size: int = 64  # DPSGDSettings' default

    @property
    def examples(self) -> int:
        return self.identities * self.images_per_identity

    @property
    def sample_rate(self) -> float:
        return self.batch_size / self.examples


class CountingNoise:
    """A NoiseSource that counts the examples its uniforms include at sample rate ``q``."""

    def __init__(self, inner: Any, q: float) -> None:
        self.inner, self.q, self.sampled = inner, q, 0
        self.secure: bool = inner.secure
        self.description: str = inner.description

    def standard_normal(self, n: int) -> np.ndarray:
        return self.inner.standard_normal(n)  # type: ignore[no-any-return]

    def uniform(self, n: int) -> np.ndarray:
        draws: np.ndarray = self.inner.uniform(n)
        self.sampled += int((draws < self.q).sum())
        return draws


def _max_rss_mib() -> float:
    """This process's peak RSS in MiB (2^20 bytes; ``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_faces(setup: ThroughputSetup, directory: Path) -> None:
    """Render the synthetic faces once and store them as .npy for the child processes."""
    from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces

    faces = generate_synthetic_faces(
        SyntheticFaceConfig(setup.identities, setup.images_per_identity, setup.image_size)
    )
    np.save(directory / "images.npy", faces.images.numpy())
    np.save(directory / "labels.npy", faces.labels.numpy())


#: Sides of the throughput part: plain training, then DP-SGD per clipping engine.
SIDES = {"plain": "", "dpsgd": "book-keeping", "dpsgd-opacus-hooks": "opacus"}


def measure_training(side: str, setup: ThroughputSetup, directory: Path) -> dict[str, Any]:
    """In a fresh process: load data, build the model, train ``setup.steps`` steps; time, RSS."""
    import torch

    torch.set_num_threads(1)
    from fl_secure.config import ModelConfig
    from fl_secure.data.types import FaceDataset
    from fl_secure.messages import LocalTraining
    from fl_secure.training import LocalData, build_model, train_local
    from privacy.dp.dpsgd import DPSGDSettings, train_local_dpsgd
    from privacy.dp.noise import SecureGaussian

    labels = torch.from_numpy(np.load(directory / "labels.npy"))
    names = tuple(f"synthetic-{k:06d}" for k in range(setup.identities))
    faces = FaceDataset(torch.from_numpy(np.load(directory / "images.npy")), labels, names)
    data = LocalData(train=faces, test=faces, train_targets=faces.labels, class_mask=None)
    cfg = ModelConfig(backbone=setup.backbone, head=setup.head)
    model = build_model(cfg, setup.identities, setup.image_size, seed=0)
    training = LocalTraining(
        local_steps=setup.steps, batch_size=setup.batch_size, learning_rate=setup.learning_rate
    )
    settings = DPSGDSettings(
        setup.noise_multiplier,
        setup.max_grad_norm,
        setup.sample_rate,
        setup.max_physical_batch_size,
        clipping=SIDES[side] or "auto",
    )
    noise = CountingNoise(SecureGaussian(), setup.sample_rate)
    setup_rss = _max_rss_mib()
    start = time.perf_counter()
    if side == "plain":
        train_local(model, data, training, generator=torch.Generator().manual_seed(0))
        examples = setup.steps * setup.batch_size
    else:
        train_local_dpsgd(model, data, training, settings, noise=noise)
        examples = noise.sampled
    seconds = time.perf_counter() - start
    return {
        "side": side,
        "seconds": round(seconds, 3),
        "examples": examples,
        "examples_per_s": round(examples / seconds, 1),
        "setup_rss_mib": round(setup_rss, 1),
        "peak_rss_mib": round(_max_rss_mib(), 1),
        "noise": noise.description,
    }


def _in_child(fn: Callable[..., Any], *args: Any) -> Any:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: throughput and peak memory of plain vs DP-SGD local training."""
    setup = ThroughputSetup(steps=args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        _in_child(make_faces, setup, Path(tmp))
        runs = [
            _in_child(measure_training, side, setup, Path(tmp))
            for _ in range(args.repeats)
            for side in SIDES
        ]

    def median(side: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs if r["side"] == side))

    plain_rate, dp_rate = median("plain", "examples_per_s"), median("dpsgd", "examples_per_s")
    plain_rss, dp_rss = median("plain", "peak_rss_mib"), median("dpsgd", "peak_rss_mib")
    setup_rss = median("plain", "setup_rss_mib")

    def training_ratio(side_rss: float) -> float:
        """What training adds over the set-up (imports, data, model: the same on each side)."""
        return round((side_rss - setup_rss) / (plain_rss - setup_rss), 3)

    ratio = dp_rate / plain_rate
    hooks_rate = median("dpsgd-opacus-hooks", "examples_per_s")
    hooks_rss = median("dpsgd-opacus-hooks", "peak_rss_mib")
    return {
        "setup": {
            **asdict(setup),
            "examples": setup.examples,
            "sample_rate": setup.sample_rate,
            "noise": runs[1]["noise"],
            "repeats": args.repeats,
        },
        "plain_examples_per_s": plain_rate,
        "dpsgd_examples_per_s": dp_rate,
        "dpsgd_throughput_ratio": round(ratio, 3),
        "goal": THROUGHPUT_GOAL,
        "meets_goal": ratio >= THROUGHPUT_GOAL,
        "clipping": SIDES["dpsgd"],
        "opacus_hooks_examples_per_s": hooks_rate,
        "opacus_hooks_throughput_ratio": round(hooks_rate / plain_rate, 3),
        "opacus_hooks_peak_memory_ratio": round(hooks_rss / plain_rss, 3),
        "opacus_hooks_peak_rss_mib": hooks_rss,
        "opacus_hooks_training_memory_ratio": training_ratio(hooks_rss),
        "plain_peak_rss_mib": plain_rss,
        "dpsgd_peak_rss_mib": dp_rss,
        "dpsgd_peak_memory_ratio": round(dp_rss / plain_rss, 3),
        "setup_rss_mib": setup_rss,  # data loaded and model built, before training
        "dpsgd_training_memory_ratio": training_ratio(dp_rss),
        "runs": runs,
        "machine": {"cpus": os.cpu_count(), "torch_threads": 1},
    }


# Parts by name. The utility-privacy curve (TAR@FAR=1e-2 at epsilon 1, 4, 8 and without DP)
# is a later part: add its function above and register it here.
CURVE_EPSILONS = (1.0, 4.0, 8.0)
CURVE_CONFIGS = {
    "synthetic": ROOT / "examples" / "quickstart.toml",
    "orl": ROOT / "examples" / "orl.toml",
}
_CURVE_KEYS = ("tar_at_far_1e-2", "rank1", "epsilon", "status", "rounds_completed", "wall_s")


def _train(config: Path, overrides: list[str], out: Path) -> dict[str, Any]:
    """One embedded run (server + client processes over gRPC + mTLS); its summary.json."""
    import subprocess

    cmd = [sys.executable, "-m", "fl_secure.app.cli", "train", "--config", str(config)]
    cmd += ["--out", str(out), "--json", "--quiet"]
    for o in overrides:
        cmd += ["--set", o]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)  # noqa: S603
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    return summary


def _figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The held-out figures, or the clients' mean on their own test images (ORL)."""
    out = {k: summary.get(k) for k in _CURVE_KEYS}
    if out["tar_at_far_1e-2"] is None:  # no held-out identities: the clients' own tests
        cs = summary.get("clients_summary", {})
        out["tar_at_far_1e-2"] = cs.get("tar_at_far_1e-2_mean")
        out["rank1"] = cs.get("rank1_mean")
        out["initial_tar_at_far_1e-2"] = (summary.get("untrained_clients_summary") or {}).get(
            "tar_at_far_1e-2_mean"
        )
        out["evaluation"] = "mean over clients of their own test images"
    else:
        out["initial_tar_at_far_1e-2"] = (summary.get("untrained") or {}).get("tar_at_far_1e-2")
        out["evaluation"] = "held-out identities"
    # the model the run started from: untrained, or model.pretrained's backbone
    out["initial_model"] = summary.get("initial_model")
    return out


def curve(args: argparse.Namespace) -> dict[str, Any]:
    """Utility-privacy curve: TAR@FAR=1e-2 at epsilon 1, 4, 8 (delta 1e-5) and without DP."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for data in args.data:
            config = CURVE_CONFIGS[data]
            row: dict[str, Any] = {"config": str(config.relative_to(ROOT))}
            no_dp = [*args.set, "privacy.unit=none"]  # the quickstart itself is private
            row["no_dp"] = _figures(_train(config, no_dp, Path(tmp)))
            for unit in args.units:
                for eps in CURVE_EPSILONS:
                    overrides = [
                        *args.set,
                        f"privacy.unit={unit}",
                        f"privacy.target_epsilon={eps}",
                        # DP-SGD noises on each client; the config's client-level placement
                        # (the quickstart's is distributed) does not apply to it
                        *(["privacy.noise_placement=local"] if unit == "example" else []),
                    ]
                    row[f"{unit}_eps_{eps:g}"] = _figures(_train(config, overrides, Path(tmp)))
                    print(
                        f"{data} {unit} eps {eps:g}: {row[f'{unit}_eps_{eps:g}']}",
                        file=sys.stderr,
                        flush=True,
                    )
            results[data] = row
    return {"delta": 1e-5, "overrides": args.set, "curves": results}


PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "throughput": throughput,
    "curve": curve,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Prints one JSON object with the part's measurements.",
    )
    parser.add_argument(
        "--part",
        choices=sorted(PARTS),
        default="throughput",
        help="which measurement to run (default: throughput: plain vs DP-SGD local "
        "training, examples/s and peak RSS)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="child processes per side (default: 3)"
    )
    parser.add_argument(
        "--steps", type=int, default=25, help="training steps per measurement (default: 25)"
    )
    parser.add_argument(
        "--data",
        nargs="+",
        choices=sorted(CURVE_CONFIGS),
        default=["synthetic", "orl"],
        help="curve: which committed configs to run (default: synthetic orl)",
    )
    parser.add_argument(
        "--units",
        nargs="+",
        choices=["client", "example"],
        default=["client", "example"],
        help="curve: privacy units to sweep (default: client example)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="curve: config override applied to every run (repeatable)",
    )
    args = parser.parse_args()
    print(json.dumps({"part": args.part, **PARTS[args.part](args)}, indent=2))


if __name__ == "__main__":
    main()
