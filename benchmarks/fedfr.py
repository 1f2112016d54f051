"""FedFR paper Tables 4-5 at small scale on synthetic faces: clustering F-score and ablation.

Domains: the synthetic generator's source domain (``domain=None``) and its ``"shifted"``
camera domain (:mod:`fl_secure.data.synthetic`); identities are disjoint across every role:

* source client: ``--source-ids`` labelled source-domain identities;
* ``--target-clients`` target clients of ``--target-ids`` shifted-domain identities each, whose
  labels are never used for training (only to score the clustering);
* evaluation: ``--eval-ids`` held-out shifted-domain identities (the target, "African" in the
  paper) and as many held-out source-domain identities (the paper's "Caucasian").

Stages, all with the repo's code (``train_local``, :class:`FedFR`, :class:`LocalTrainer`):

* **P** (Algorithm 1 lines 1-2): the source client trains backbone + margin head on its labels
  with ``train_local`` for ``--pretrain-steps`` batches.
* **Table 4** (a): pairwise F-score (:func:`pairwise_f_score`) of each target client's
  clustering of its P features: C-FINCH (recursive, distance ``d``), FINCH's first partition
  (``d = inf``, one level), k-means with the true number of identities and with half / twice
  that (scikit-learn, 10 restarts). ``d`` is chosen on the *source* domain only: the value of
  ``--d-grid`` with the best C-FINCH F-score on the source client's own training features
  from a separately pre-trained model on half of its identities, scored on the other half
  (labelled data the source client has); the target-domain F-score at every ``d`` of the
  grid is reported beside it, not used.
* **Table 5** (b), TAR@FAR on the held-out target identities:

  - **P**: the pre-trained backbone.
  - **P+C**: P fine-tuned on the target data with the C-FINCH pseudo labels (the paper's
    "fine-tuning the pre-trained model on the target domain data with pseudo labels"): the
    target clients' pseudo-labelled sets pooled (each client's clusters are its own classes),
    a fresh head, ``train_local`` for ``rounds * local_steps`` batches.
  - **P+C+FL**: :class:`FedFR` with ``dcl_lambda = 0`` over one :class:`LocalTrainer` per client
    (the source client keeps its pre-training head; each target client pseudo-labels with
    C-FINCH on the first model it receives, P, inside the strategy), ``--rounds`` rounds of
    ``--local-steps`` iterations, example-weighted backbone mean (FedPav), as the coordinator.
  - **P+C+FL+DCL**: the same with ``dcl_lambda`` = each value of ``--lambdas``.

Prints one JSON object (``--out`` also writes it). 2 cores, torch pinned to 1 thread::

    python benchmarks/fedfr.py [--seeds 0 1 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.cluster import KMeans

from client.trainer import LocalTrainer
from fl_secure.aggregation import StreamingMean
from fl_secure.algorithms.cfinch import c_finch, pairwise_f_score
from fl_secure.algorithms.fedfr import FedFR, resized_head
from fl_secure.config import ModelConfig
from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces
from fl_secure.data.types import FaceDataset
from fl_secure.messages import LocalTraining, TensorSpec
from fl_secure.training import (
    FaceModel,
    LocalData,
    build_model,
    embed,
    evaluate_verification,
    get_tensors,
    set_tensors,
    train_local,
)

METRICS = ("tar_at_far_1e-1", "tar_at_far_1e-2", "tar_at_far_1e-3", "roc_auc", "rank1")


def ids_subset(data: FaceDataset, lo: int, hi: int) -> FaceDataset:
    """The images of identities ``lo .. hi - 1``."""
    labels = data.labels.numpy()
    return data.subset(np.flatnonzero((labels >= lo) & (labels < hi)))


def labelled(data: FaceDataset) -> LocalData:
    """Labels remapped to ``0 .. k-1`` (a private head over the set's identities)."""
    own = np.unique(data.labels.numpy())
    targets = torch.from_numpy(np.searchsorted(own, data.labels.numpy()).astype(np.int64))
    return LocalData(train=data, test=data, train_targets=targets, class_mask=None)


def scores(model: FaceModel, data: FaceDataset) -> dict[str, float]:
    """The verification figures of :func:`evaluate_verification` (rounded)."""
    found = evaluate_verification(model.backbone, data)
    return {k: round(found[k], 4) for k in METRICS}


def kmeans(features: np.ndarray, k: int, seed: int) -> np.ndarray:
    """k-means labels of the features (at least 1, at most n clusters)."""
    k = int(min(max(k, 1), len(features)))
    fitted = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(features)
    return np.asarray(fitted.labels_)


def pretrain(cfg: ModelConfig, data: FaceDataset, args: argparse.Namespace, seed: int) -> FaceModel:
    """Algorithm 1 lines 1-2: supervised training on the labelled source data."""
    local = labelled(data)
    model = build_model(cfg, data.identities().size, args.image_size, seed)
    steps = LocalTraining(
        local_steps=args.pretrain_steps,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        optimizer="adam",
        weight_decay=0.0,
    )
    train_local(model, local, steps, generator=torch.Generator().manual_seed(seed))
    return model


def choose_threshold(
    cfg: ModelConfig, source: FaceDataset, args: argparse.Namespace, seed: int
) -> tuple[float, dict[str, float]]:
    """``d`` from the source domain alone: best C-FINCH F-score on unseen source identities."""
    ids = source.identities()
    half = ids[len(ids) // 2]
    fit, check = (
        ids_subset(source, int(ids[0]), int(half)),
        source.subset(np.flatnonzero(source.labels.numpy() >= half)),
    )
    model = pretrain(cfg, fit, args, seed + 1000)
    features = embed(model.backbone, check.images)
    truth = check.labels.numpy()
    found = {f"{d:g}": round(pairwise_f_score(truth, c_finch(features, d)), 4) for d in args.d_grid}
    best = max(args.d_grid, key=lambda d: found[f"{d:g}"])
    return float(best), found


def clustering_table(
    model: FaceModel, targets: list[FaceDataset], d: float, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """Table 4: mean pairwise F-score over the target clients, per algorithm."""
    rows: dict[str, list[float]] = {}
    clusters: dict[str, list[int]] = {}
    sweep: dict[str, list[float]] = {f"{x:g}": [] for x in args.d_grid}
    for data in targets:
        features = embed(model.backbone, data.images)
        truth = data.labels.numpy()
        k = len(np.unique(truth))
        found = {
            f"C-FINCH (d={d:g})": c_finch(features, d),
            "FINCH (first partition)": c_finch(features, math.inf, recursive=False),
            "k-means (true k)": kmeans(features, k, seed),
            "k-means (k/2)": kmeans(features, k // 2, seed),
            "k-means (2k)": kmeans(features, 2 * k, seed),
        }
        for name, labels in found.items():
            rows.setdefault(name, []).append(pairwise_f_score(truth, labels))
            clusters.setdefault(name, []).append(len(np.unique(labels)))
        clusters.setdefault("true identities", []).append(k)
        for x in args.d_grid:
            sweep[f"{x:g}"].append(pairwise_f_score(truth, c_finch(features, x)))
    return {
        "f_score": {k: round(float(np.mean(v)), 4) for k, v in rows.items()},
        "clusters_per_client": clusters,
        "c_finch_f_score_by_d_target_not_used": {
            k: round(float(np.mean(v)), 4) for k, v in sweep.items()
        },
    }


def fine_tune(
    model: FaceModel, targets: list[FaceDataset], d: float, args: argparse.Namespace, seed: int
) -> FaceModel:
    """P+C: P fine-tuned on the pooled pseudo-labelled target data (no FL, no source)."""
    images, labels, offset = [], [], 0
    for data in targets:
        found = c_finch(embed(model.backbone, data.images), d)
        images.append(data.images)
        labels.append(torch.from_numpy(found + offset))
        offset += int(found.max()) + 1
    pooled = FaceDataset(
        images=torch.cat(images),
        labels=torch.cat(labels),
        identity_names=tuple(f"pseudo-{i}" for i in range(offset)),
    )
    tuned = copy.deepcopy(model)
    tuned.head = resized_head(model.head, offset, seed)
    steps = LocalTraining(
        local_steps=args.rounds * args.local_steps,
        batch_size=args.batch_size,
        learning_rate=args.fl_lr,
        optimizer="adam",
        weight_decay=0.0,
    )
    train_local(tuned, labelled(pooled), steps, generator=torch.Generator().manual_seed(seed))
    return tuned


def federated(
    model: FaceModel,
    source: FaceDataset,
    targets: list[FaceDataset],
    d: float,
    lam: float,
    args: argparse.Namespace,
    seed: int,
) -> tuple[FaceModel, dict[str, Any]]:
    """P+C+FL(+DCL): FedFR rounds over one LocalTrainer per client, FedPav mean."""
    trainers = []
    for k, data in enumerate([source, *targets]):
        strategy = FedFR(dcl_lambda=lam, cfinch_threshold=d)
        local = strategy.local_data(data, data, data.identities())
        client = copy.deepcopy(model)  # the source keeps its pre-training head
        trainers.append(LocalTrainer(strategy, client, local, seed=seed * 100 + k))
    first = trainers[0]
    params = get_tensors(model, first.shared_names)  # theta^s: the pre-trained backbone
    specs = [TensorSpec.of(k, v) for k, v in params.items()]
    task = LocalTraining(
        local_steps=args.local_steps,
        batch_size=args.batch_size,
        learning_rate=args.fl_lr,
        optimizer="adam",
        weight_decay=0.0,
    )
    dcl: list[float] = []
    for number in range(1, args.rounds + 1):
        mean = StreamingMean(specs)
        for trainer in trainers:
            update, examples, metrics = trainer.train(params, task)
            mean.add(update, float(examples))
            if "dcl" in metrics:
                dcl.append(metrics["dcl"])
        params = first.strategy.server_update(params, mean.mean(), number)
    result = copy.deepcopy(model)
    set_tensors(result, params)
    pseudo = [t.strategy.pseudo for t in trainers[1:]]  # type: ignore[attr-defined]
    info = {
        "pseudo_identities": [p.train.num_identities if p else 0 for p in pseudo],
        "mean_dcl_term": round(float(np.mean(dcl)), 6) if dcl else 0.0,
    }
    return result, info


def run_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One seed: data, P, Table 4, Table 5."""
    torch.manual_seed(seed)
    cfg = ModelConfig(backbone=args.backbone, embedding_size=args.embedding_size)
    s, t, e, k = args.source_ids, args.target_ids, args.eval_ids, args.target_clients
    total = s + k * t + e
    make = {
        domain: generate_synthetic_faces(
            SyntheticFaceConfig(
                num_identities=total + e,
                images_per_identity=args.images_per_identity,
                image_size=args.image_size,
                seed=seed,
                domain=domain,
            )
        )
        for domain in (None, "shifted")
    }
    source = ids_subset(make[None], 0, s)
    targets = [ids_subset(make["shifted"], s + i * t, s + (i + 1) * t) for i in range(k)]
    eval_target = ids_subset(make["shifted"], s + k * t, total)
    eval_source = ids_subset(make[None], total, total + e)
    started = time.time()
    d, d_source = choose_threshold(cfg, source, args, seed)
    model = pretrain(cfg, source, args, seed)
    table4 = clustering_table(model, targets, d, args, seed)
    table4["d"] = d
    table4["c_finch_f_score_by_d_source_half"] = d_source
    rows: dict[str, Any] = {"P": model}
    rows["P+C"] = fine_tune(model, targets, d, args, seed)
    info: dict[str, Any] = {}
    rows["P+C+FL"], info["P+C+FL"] = federated(model, source, targets, d, 0.0, args, seed)
    for lam in args.lambdas:
        name = f"P+C+FL+DCL (lambda={lam:g})"
        rows[name], info[name] = federated(model, source, targets, d, lam, args, seed)
    table5 = {
        name: {"target": scores(m, eval_target), "source": scores(m, eval_source)}
        for name, m in rows.items()
    }
    return {
        "seed": seed,
        "table4": table4,
        "table5": table5,
        "fl": info,
        "sizes": {
            "source_images": len(source),
            "target_images_per_client": [len(x) for x in targets],
            "eval_target_images": len(eval_target),
            "eval_source_images": len(eval_source),
        },
        "seconds": round(time.time() - started, 1),
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and std over the seeds."""
    table4 = {
        name: [r["table4"]["f_score"][name] for r in runs] for name in runs[0]["table4"]["f_score"]
    }
    out4 = {
        name: {"mean": round(float(np.mean(v)), 4), "std": round(float(np.std(v)), 4)}
        for name, v in table4.items()
    }
    out5: dict[str, Any] = {}
    for name in runs[0]["table5"]:
        out5[name] = {}
        for dom in ("target", "source"):
            out5[name][dom] = {
                m: {
                    "mean": round(float(np.mean([r["table5"][name][dom][m] for r in runs])), 4),
                    "std": round(float(np.std([r["table5"][name][dom][m] for r in runs])), 4),
                }
                for m in METRICS
            }
    return {"table4_f_score": out4, "table5": out5}


def main() -> None:
    """Parse arguments, run every seed, print (and write) the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--source-ids", type=int, default=80)
    parser.add_argument("--target-clients", type=int, default=2)
    parser.add_argument("--target-ids", type=int, default=15)
    parser.add_argument("--eval-ids", type=int, default=30)
    parser.add_argument("--images-per-identity", type=int, default=10)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--backbone", default="cnn-small")
    parser.add_argument("--embedding-size", type=int, default=128)
    parser.add_argument("--pretrain-steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--fl-lr", type=float, default=5e-4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--lambdas", type=float, nargs="+", default=[0.01, 0.1, 1.0])
    parser.add_argument("--d-grid", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.405, 0.5, 0.6])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    runs = [run_seed(args, seed) for seed in args.seeds]
    result = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "summary": summary(runs),
        "runs": runs,
        "seconds": round(time.time() - started, 1),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
