"""Person-level DP across 1,000+ single-identity devices, from a pretrained start (JSON out).

1. Pretrain ``cnn-small`` centrally on *public* synthetic identities (the generator's source
   domain; identity numbers no device has), CosFace s = 30, m = 0.4. Cached in ``--work``.
2. Plan the devices with ``partition.kind = "person"`` (``examples/person_dp.toml``): each
   device one identity of the generator's *shifted* domain (another camera), its images split
   7 / 3 into train and test; ``data.held_out_identities`` identities of no device are the
   held-out evaluation.
3. The server's public class representations ``R`` come from other public identities taken
   with the devices' camera (the shifted domain; measured: ``R`` of the pretraining domain
   gives the devices no useful negatives and the non-private run no gain).
4. From the same pretrained start, train the embedding layer with
   :mod:`fl_secure.app.person_dp` (Poisson cohorts, clipped updates, central Gaussian noise
   from the CSPRNG) without DP and at each target epsilon, delta = 1 / N. The noise
   multiplier of each target is calibrated so that the *stated* epsilon meets it: as for
   every Poisson-sampled run of the project, without amplification by sampling (rate 1;
   ``privacy.dp.amplification``); the amplified figure is stated beside it. Each row
   is run ``--repeats`` times (the cohorts and the noise differ): mean, std and every run.

Prints one JSON object: held-out TAR@FAR=1e-2 / 1e-3 of the frozen trunk's own features, of a
random embedding layer, of the start, the pooled (centralized)
reference, the non-private run, each epsilon and a control (the epsilon-8 noise with the
devices' updates ~0: what noise alone does), the fraction of the non-private (and of the
pooled) gain each private run keeps (``(private - start) / (non-private - start)``), the
epsilon stated and the amplified one, and the per-round signal-to-noise of the released mean.

    python benchmarks/person_dp.py                       # 1,000 devices, eps 1, 4, 8
    python benchmarks/person_dp.py --epsilons 8 --rounds 10   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fl_secure.app.person_dp import (  # noqa: E402
    EmbeddingLayer,
    PersonDPSettings,
    held_out_tar,
    run_person_dp,
    spent_epsilon,
)
from fl_secure.config import load_config  # noqa: E402
from fl_secure.data.plan import plan_federation  # noqa: E402
from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces  # noqa: E402
from fl_secure.evaluation.verification import verification_metrics  # noqa: E402
from fl_secure.models.factory import get_backbone, load_pretrained, save_weights  # noqa: E402
from privacy.dp.amplification import accounted_sample_rate  # noqa: E402
from privacy.dp.calibration import calibrate_noise  # noqa: E402
from privacy.dp.noise import SecureGaussian  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_FIRST_IDENTITY = 1_000_000  # far from every device's identity number
PUBLIC_TARGET_FIRST_IDENTITY = 2_000_000  # the public identities of the devices' camera


def _backbone(config_size: int, embedding: int) -> torch.nn.Module:
    return get_backbone("cnn-small", embedding_size=embedding, image_size=config_size)


def pretrain(args: argparse.Namespace, public: torch.Tensor, labels: torch.Tensor) -> Path:
    """Train the whole backbone centrally on the public identities; cache its weights."""
    path = Path(args.work) / f"public-{args.public_identities}x{args.public_images}.safetensors"
    if path.exists():
        return path
    torch.manual_seed(0)
    model = _backbone(args.image_size, args.embedding)
    classes = torch.nn.Parameter(torch.randn(int(labels.max()) + 1, args.embedding) * 0.01)
    opt = torch.optim.Adam([*model.parameters(), classes], lr=2e-3)
    for _ in range(args.pretrain_epochs):
        for batch in torch.randperm(len(labels)).split(128):
            emb = F.normalize(model(public[batch]), dim=1)
            cos = emb @ F.normalize(classes, dim=1).T
            cos = cos - 0.4 * F.one_hot(labels[batch], cos.shape[1])
            loss = F.cross_entropy(30.0 * cos, labels[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_weights(model, path)
    return path


def features(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Frozen-trunk features, in chunks."""
    with torch.no_grad():
        return torch.cat([model.trunk_features(c) for c in images.split(512)])


def centralized(
    start: EmbeddingLayer,
    device_features: torch.Tensor,
    held_features: torch.Tensor,
    held_labels: torch.Tensor,
    epochs: int,
) -> dict[str, object]:
    """The pooled reference: the embedding layer trained on every device's images in one place.

    CosFace over the devices' identities as classes (s = 30, m = 0.4), Adam 1e-3, batches of
    256: what the devices' data can give the layer without federation or DP.
    """
    t0 = time.monotonic()
    count, per, _ = device_features.shape
    pooled = device_features.reshape(count * per, -1)
    labels = torch.arange(count).repeat_interleave(per)
    weight = start.weight.clone().requires_grad_(True)
    bias = start.bias.clone().requires_grad_(True)
    with torch.no_grad():
        centres = F.normalize(start.embed(device_features).mean(dim=1), dim=1)
    classes = centres.clone().requires_grad_(True)
    opt = torch.optim.Adam([weight, bias, classes], lr=1e-3)
    for _ in range(epochs):
        for batch in torch.randperm(len(labels)).split(256):
            emb = F.normalize(pooled[batch] @ weight.T + bias, dim=1)
            cos = emb @ F.normalize(classes, dim=1).T - 0.4 * F.one_hot(labels[batch], count)
            loss = F.cross_entropy(30.0 * cos, labels[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
    layer = EmbeddingLayer(weight.detach(), bias.detach())
    row: dict[str, object] = dict(held_out_tar(layer, held_features, held_labels))
    row["epochs"] = epochs
    row["seconds"] = round(time.monotonic() - t0, 1)
    return row


def main() -> None:
    """Run the comparison and print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "person_dp.toml"))
    parser.add_argument("--work", default=str(ROOT / "runs" / "person-dp"))
    parser.add_argument("--public-identities", type=int, default=500)
    parser.add_argument("--public-images", type=int, default=10)
    parser.add_argument("--pretrain-epochs", type=int, default=6)
    parser.add_argument(
        "--representation-identities",
        type=int,
        default=500,
        help="public identities of the devices' camera whose means are the negatives R",
    )
    parser.add_argument(
        "--representation-domain",
        default="shifted",
        choices=("shifted", "source"),
        help="the camera of R's public identities: the devices' (shifted) or the pretraining's",
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs per row (mean, std)")
    parser.add_argument("--pooled-epochs", type=int, default=20)
    parser.add_argument("--embedding", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sample-rate", type=float, default=0.2)
    parser.add_argument("--clip-norm", type=float, default=0.5)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--local-lr", type=float, default=0.5)
    parser.add_argument("--server-lr", type=float, default=3.0)
    parser.add_argument("--epsilons", default="1,4,8")
    parser.add_argument("--accountant", default="pld", choices=("rdp", "pld", "prv"))
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    started = time.monotonic()

    config = load_config(args.config)
    args.image_size = config.data.image_size
    # the devices: the shifted domain (another camera than the public data's)
    sites = generate_synthetic_faces(
        SyntheticFaceConfig(
            num_identities=config.data.num_identities,
            images_per_identity=config.data.images_per_identity,
            image_size=config.data.image_size,
            seed=config.data_seed,
            domain="shifted",
        )
    )
    plan = plan_federation(config, sites)
    public = generate_synthetic_faces(
        SyntheticFaceConfig(
            num_identities=args.public_identities,
            images_per_identity=args.public_images,
            image_size=config.data.image_size,
            seed=config.data_seed,
            first_identity=PUBLIC_FIRST_IDENTITY,
        )
    )
    # the server's public class representations: other public identities, devices' camera
    representatives = generate_synthetic_faces(
        SyntheticFaceConfig(
            num_identities=args.representation_identities,
            images_per_identity=args.public_images,
            image_size=config.data.image_size,
            seed=config.data_seed,
            first_identity=PUBLIC_TARGET_FIRST_IDENTITY,
            domain="shifted" if args.representation_domain == "shifted" else None,
        )
    )
    weights = pretrain(args, public.images, public.labels)
    model = _backbone(args.image_size, args.embedding)
    load_pretrained(model, weights)
    model.eval()
    start = EmbeddingLayer(
        model.embedding.weight.detach().clone(), model.embedding.bias.detach().clone()
    )
    device_features = torch.stack([features(model, c.train.images) for c in plan.clients])
    public_features = features(model, representatives.images)
    held_features = features(model, plan.held_out.images)
    held_labels = plan.held_out.labels
    population = len(plan.clients)
    delta = 1.0 / population
    base = PersonDPSettings(
        rounds=args.rounds,
        sample_rate=args.sample_rate,
        clip_norm=args.clip_norm,
        local_steps=args.local_steps,
        local_lr=args.local_lr,
        server_lr=args.server_lr,
    )
    source = SecureGaussian()
    prepared = time.monotonic() - started

    def run(settings: PersonDPSettings) -> dict[str, object]:
        t0 = time.monotonic()
        tars: list[dict[str, float]] = []
        snr: list[float] = []
        cohorts: list[float] = []
        for _ in range(args.repeats):
            layer, records = run_person_dp(
                start, device_features, public_features, representatives.labels, settings, source
            )
            tars.append(held_out_tar(layer, held_features, held_labels))
            snr += [r.signal_norm / r.noise_norm for r in records if r.noise_norm > 0]
            cohorts += [r.cohort for r in records]
        row: dict[str, object] = {}
        for key in tars[0]:
            values = [t[key] for t in tars]
            row[key] = round(float(np.mean(values)), 4)
            row[f"{key}_std"] = round(float(np.std(values)), 4)
            row[f"{key}_runs"] = [round(v, 4) for v in values]
        row["mean_cohort"] = round(float(np.mean(cohorts)), 1)
        row["signal_to_noise_per_round"] = round(float(np.mean(snr)), 3) if snr else None
        row["seconds"] = round(time.monotonic() - t0, 1)
        return row

    projection = torch.Generator().manual_seed(0)
    random_layer = EmbeddingLayer(
        torch.randn(start.weight.shape, generator=projection), start.bias * 0
    )
    raw = verification_metrics(held_features.numpy(), held_labels.numpy())
    rows: dict[str, dict[str, object]] = {
        # references: the frozen trunk's own features, and a random (seeded) embedding layer
        "trunk_features": {k: raw[k] for k in ("tar_at_far_1e-2", "tar_at_far_1e-3")},
        "random_embedding_layer": held_out_tar(random_layer, held_features, held_labels),
        "pretrained_start": held_out_tar(start, held_features, held_labels),
        "centralized_pooled": centralized(
            start, device_features, held_features, held_labels, args.pooled_epochs
        ),
        "non_private": run(base),
    }
    # the stated epsilon is the project's (privacy.dp.amplification): Poisson cohorts are
    # accounted at rate 1 (their membership is published and redrawn), the figure amplified
    # by the drawn rate is stated beside it and trusts the server's secret, honest draw
    accounted = accounted_sample_rate("poisson", base.sample_rate)
    noises: dict[float, float] = {}
    for eps in [float(e) for e in args.epsilons.split(",") if e]:
        z = calibrate_noise(
            target_epsilon=eps,
            sample_rate=accounted,
            steps=base.rounds,
            delta=delta,
            accountant=args.accountant,
            tolerance=0.02,
        )
        noises[eps] = z
        settings = replace(base, noise_multiplier=z)
        row = run(settings)
        row["noise_multiplier"] = z
        row["epsilon"] = spent_epsilon(
            replace(settings, sample_rate=accounted), delta, args.accountant
        )
        row["epsilon_amplified"] = spent_epsilon(settings, delta, args.accountant)
        rows[f"epsilon_{eps:g}"] = row
    if noises:  # the control: the largest-epsilon noise with the devices' updates ~0
        z = noises[max(noises)]
        row = run(replace(base, noise_multiplier=z, local_lr=1e-12))
        row["noise_multiplier"] = z
        rows[f"control_noise_only_epsilon_{max(noises):g}"] = row
    first = rows["pretrained_start"]
    for reference in ("non_private", "centralized_pooled"):
        best = rows[reference]
        for name, row in rows.items():
            if name.startswith(("epsilon_", "control_")):
                for far in ("1e-2", "1e-3"):
                    key = f"tar_at_far_{far}"
                    gain = float(best[key]) - float(first[key])  # type: ignore[arg-type]
                    mine = float(row[key]) - float(first[key])  # type: ignore[arg-type]
                    kept = round(mine / gain, 3) if gain > 0 else None
                    row[
                        f"gain_kept_{far}" + ("" if reference == "non_private" else "_of_pooled")
                    ] = kept
    print(
        json.dumps(
            {
                "devices": population,
                "identities_per_device": 1,
                "train_images_per_device": int(device_features.shape[1]),
                "held_out_identities": int(len(held_labels.unique())),
                "public_identities": args.public_identities,
                "public_representation_identities": args.representation_identities,
                "representation_domain": args.representation_domain,
                "repeats": args.repeats,
                "trained_parameters": int(start.flat().numel()),
                "delta": delta,
                "accountant": args.accountant,
                "settings": base.__dict__,
                "rows": rows,
                "prepare_seconds": round(prepared, 1),
                "total_seconds": round(time.monotonic() - started, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
