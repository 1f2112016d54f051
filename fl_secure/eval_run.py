"""``fl-secure eval``: score a run's checkpoint on its held-out identities or an LFW pairs file.

With ``--lfw-pairs`` the LFW protocol is followed: cosine scores of the listed pairs, 10-fold
accuracy (threshold tuned on 9 folds) when the file has folds, plus ROC figures over all pairs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fl_secure.checkpoints import CheckpointStore
from fl_secure.config import load_config
from fl_secure.data.lfw import load_pair_images, read_pairs
from fl_secure.data.plan import plan_federation
from fl_secure.errors import CheckpointError
from fl_secure.evaluation import VERIFICATION_FARS, eer, kfold_accuracy, roc_auc, tar_at_far
from fl_secure.runs import RunDir
from fl_secure.training import build_model, embed, evaluate_verification, load_checkpoint_into


def evaluate_run(
    run_path: Path,
    *,
    round_: int | None = None,
    lfw_pairs: Path | None = None,
    lfw_root: Path | None = None,
    center_crop: int | None = None,
) -> dict[str, Any]:
    """Metrics of the run's backbone at ``round_`` (default: the latest checkpoint)."""
    run = RunDir(run_path)
    if not run.config.exists():
        raise CheckpointError(f"{run_path} is not a run directory (no config.toml)")
    config = load_config(run.config)
    store = CheckpointStore(run.checkpoints)
    checkpoint = store.load(round_) if round_ is not None else store.latest()
    if checkpoint is None:
        raise CheckpointError(f"{run_path} has no checkpoint yet")
    backbone = build_model(config.model, 1, config.data.image_size, config.run.seed).backbone
    load_checkpoint_into(
        backbone,
        checkpoint.parameters,
        source=f"the checkpoint of round {checkpoint.round} in {run.checkpoints}",
        prefix="backbone.",
    )
    result: dict[str, Any] = {"run": str(run_path), "round": checkpoint.round}
    if lfw_pairs is None:
        plan = plan_federation(config)
        result["data"] = "held-out identities of the run"
        result.update(evaluate_verification(backbone, plan.held_out))
        return result
    if lfw_root is None:
        raise CheckpointError("--lfw-pairs needs --lfw-root (the folder of LFW images)")
    protocol = read_pairs(lfw_pairs)
    images = load_pair_images(
        protocol, lfw_root, image_size=config.data.image_size, center_crop=center_crop
    )
    emb = embed(backbone, images.dataset.images)
    scores = np.sum(emb[images.left] * emb[images.right], axis=1)
    same = images.same.astype(bool)
    result["data"] = f"LFW pairs {lfw_pairs.name} ({len(protocol)} pairs)"
    if protocol.num_folds > 1:
        mean, std = kfold_accuracy(scores, same, images.fold)
        result["lfw_accuracy_mean"], result["lfw_accuracy_std"] = mean, std
    for name, far in VERIFICATION_FARS.items():
        result[f"tar_at_far_{name}"] = tar_at_far(scores, same, far)
    result["roc_auc"], result["eer"] = roc_auc(scores, same), eer(scores, same)
    return result
