"""``fl-secure eval``: score a run's checkpoint on its held-out identities or an LFW pairs file.

A centralized run (``fl-secure train --centralized``) is scored with the final backbone it
saved (``backbone.safetensors``). A FedAffect run learns facial expressions, not identities:
it is scored as its server scores it, by expression accuracy on the held-out identities'
images, and LFW pairs (face verification) are refused for it.

With ``--lfw-pairs`` the LFW protocol is followed: cosine scores of the listed pairs, 10-fold
accuracy (threshold tuned on 9 folds) when the file has folds, plus ROC figures over all pairs.
The pairs whose identities no one trained on are scored apart (``disjoint_*``); dropping the
others leaves folds with more genuine than impostor pairs (or the reverse), so instead of
plain accuracy they report their ``num_genuine`` and ``num_impostor`` and the balanced
accuracy (mean of TPR and TNR, threshold tuned on the other folds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from fl_secure.algorithms.fedaffect import build_fedaffect_model
from fl_secure.algorithms.registry import check_config, strategy_class
from fl_secure.app.centralized import pretraining_clients
from fl_secure.checkpoints import Checkpoint, CheckpointStore
from fl_secure.config import Config, load_config
from fl_secure.data.lfw import load_pair_images, read_pairs
from fl_secure.data.plan import degrade_for_run, plan_federation
from fl_secure.errors import CheckpointError, DataError, FlSecureError
from fl_secure.evaluation import (
    VERIFICATION_FARS,
    DegenerateEmbeddings,
    eer,
    kfold_accuracy,
    kfold_balanced_accuracy,
    normalise_rows,
    roc_auc,
    tar_at_far,
)
from fl_secure.models import load_pretrained
from fl_secure.models.trainable import ALL
from fl_secure.runs import RunDir
from fl_secure.training import build_model, embed, evaluate_verification, load_checkpoint_into
from server.bootstrap import make_evaluator

#: The model a centralized run (``fl-secure train --centralized``) saves, in its run directory.
CENTRALIZED_BACKBONE = "backbone.safetensors"


def evaluate_run(
    run_path: Path,
    *,
    round_: int | None = None,
    lfw_pairs: Path | None = None,
    lfw_root: Path | None = None,
    center_crop: int | None = None,
) -> dict[str, Any]:
    """Metrics of the run's backbone at ``round_`` (default: the latest checkpoint).

    A centralized run has no per-round checkpoints: its final ``backbone.safetensors`` is
    scored (``round`` is then its last pass).

    ``center_crop``: the LFW images' centre crop before resizing; default the run's
    ``data.center_crop`` (the crop the model trained on), ``0`` for none. With an LFW pairs
    file the result counts the pairs that involve an identity the run's clients trained on
    and, when there are any, scores the pairs without them too (``disjoint_*``: their
    counts and balanced accuracy in place of plain accuracy); when the sites trained on
    their own data (a standalone server's run) that count is unknown: ``None``, with
    ``pairs_with_training_identities_note`` saying why. A model that started from
    ``model.pretrained`` weights has seen the identities they trained on as well: those of the
    (centralized) run whose ``config.toml`` is beside the weights file, counted too; without
    that file the count is unknown (``None``, with the note).

    A FedAffect run gives the server's figures of the checkpoint instead:
    ``expression_accuracy`` and ``expression_majority`` (always answering the most frequent
    expression).

    Raises:
        CheckpointError: not a run, no checkpoint, or a model whose embeddings are zero or
            not finite (it diverged: no cosine to score).
        DataError: no held-out identities to score (use an LFW pairs file), an image
            missing or unreadable, LFW options (``lfw_root``, ``center_crop``) without
            ``lfw_pairs``, or LFW pairs for a FedAffect run.
    """
    if lfw_pairs is None:  # options of the LFW protocol alone: not silently ignored
        options = {"--lfw-root": lfw_root, "--center-crop": center_crop}
        given = [flag for flag, value in options.items() if value is not None]
        if given:
            raise DataError(
                f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to LFW "
                f"pairs only: add --lfw-pairs FILE, or drop {'it' if len(given) == 1 else 'them'} "
                "to score the run's held-out identities"
            )
    run = RunDir(run_path)
    if not run.config.exists():
        raise CheckpointError(f"{run_path} is not a run directory (no config.toml)")
    config = load_config(run.config)
    check_config(config)
    centralized = run.path / CENTRALIZED_BACKBONE
    is_centralized = centralized.is_file() and not run.checkpoints.exists()
    if strategy_class(config.algorithm.name).evaluates_expressions and not is_centralized:
        if lfw_pairs is not None:
            raise DataError(
                f"{run_path} is a FedAffect run: its model recognises facial expressions, not "
                "identities, so LFW pairs (face verification) say nothing about it; drop "
                "--lfw-pairs to score its expression accuracy on the held-out identities"
            )
        return _expression_scores(run, config, round_)
    # every weight comes from the checkpoint: the run's model.pretrained file is not needed,
    # unless train.trainable froze part of the backbone (the frozen part is not checkpointed)
    partial = config.train.trainable != ALL
    bare = config.model if partial else dataclasses.replace(config.model, pretrained="")
    backbone = build_model(
        bare,
        1,
        config.data.image_size,
        config.run.seed,
        trainable=config.train.trainable,
        head_lr_scale=config.train.head_lr_scale,
    ).backbone
    if is_centralized:  # train --centralized
        if round_ is not None:
            raise CheckpointError(
                f"{run_path} is a centralized run: it keeps only its final backbone "
                f"({CENTRALIZED_BACKBONE}), no per-round checkpoints; drop --round"
            )
        load_pretrained(backbone, centralized)
        source = f"the centralized run's final backbone {centralized}"
        remedy = "train it again with a lower train.lr"
        result: dict[str, Any] = {"run": str(run_path), "round": config.train.rounds,
                                  "model": f"{CENTRALIZED_BACKBONE} (centralized run)"}  # fmt: skip
    else:
        checkpoint = _checkpoint(run, round_)
        source = f"the checkpoint of round {checkpoint.round} in {run.checkpoints}"
        remedy = "an earlier round's checkpoint may score: --round N"
        load_checkpoint_into(backbone, checkpoint.parameters, source=source, prefix="backbone.")
        result = {"run": str(run_path), "round": checkpoint.round}
    if lfw_pairs is None:
        plan = plan_federation(config)
        if len(plan.held_out) == 0:
            raise DataError(
                f"{run_path} holds out no identity (data.held_out_identities = 0): there is "
                "nothing of its own to score; use --lfw-pairs FILE --lfw-root DIR"
            )
        result["data"] = "held-out identities of the run"
        if config.data.degrade:
            result["degrade"] = config.data.degrade
        with _scoring(source, remedy):
            result.update(evaluate_verification(backbone, plan.held_out))
        return result
    if lfw_root is None:
        raise CheckpointError("--lfw-pairs needs --lfw-root (the folder of LFW images)")
    if center_crop is not None and center_crop < 0:
        raise DataError(f"--center-crop {center_crop}: give a side >= 1, or 0 for no crop")
    crop = (config.data.center_crop or None) if center_crop is None else (center_crop or None)
    protocol = read_pairs(lfw_pairs)
    images = load_pair_images(protocol, lfw_root, image_size=config.data.image_size,
                              center_crop=crop)  # fmt: skip
    # the run's target domain (data.degrade) on the pairs' images too, as on its held-out set
    pair_faces = degrade_for_run(images.dataset, config.data, config.data_seed)
    with _scoring(source, remedy):  # unit rows in float64; a zero or non-finite one is refused
        emb = normalise_rows(embed(backbone, pair_faces.images, unit=False))
    scores = np.sum(emb[images.left] * emb[images.right], axis=1)
    same = images.same.astype(bool)
    result["data"] = f"LFW pairs {lfw_pairs.name} ({len(protocol)} pairs)"
    result["center_crop"] = crop
    if config.data.degrade:
        result["degrade"] = config.data.degrade
    result.update(_pair_metrics(scores, same, images.fold if protocol.num_folds > 1 else None))
    pretrained, pretrained_unknown = _pretraining_names(config)
    unknown = _sites_own_data(run) or pretrained_unknown
    if unknown is not None:  # the server's [data] config says nothing of what the sites held
        result["pairs_with_training_identities"] = None
        result["pairs_with_training_identities_note"] = unknown
        return result
    trained = _trained_names(config, centralized=is_centralized)
    if config.model.pretrained:  # its backbone had seen identities before the run began
        trained |= pretrained
        result["pairs_with_training_identities_note"] = (
            "counts the identities the model.pretrained backbone trained on too (its run's "
            f"config.toml, beside {config.model.pretrained})"
        )
    seen = np.array([p.name1 in trained or p.name2 in trained for p in protocol.pairs])
    result["pairs_with_training_identities"] = int(seen.sum())
    if seen.any() and (~seen & same).any() and (~seen & ~same).any():
        # the pairs of identities no client trained on: the figures without that advantage
        # (10-fold accuracy needs two folds of them left; the other figures do not)
        folds = images.fold[~seen] if protocol.num_folds > 1 else None
        if folds is not None and len(np.unique(folds)) < 2:
            folds = None
        disjoint = _pair_metrics(scores[~seen], same[~seen], folds, subset=True)
        result.update({f"disjoint_{k}": v for k, v in disjoint.items()})
    return result


def _checkpoint(run: RunDir, round_: int | None) -> Checkpoint:
    """The checkpoint of ``round_`` (default: the latest).

    Raises:
        CheckpointError: there is none, or it is damaged.
    """
    store = CheckpointStore(run.checkpoints)
    checkpoint = store.load(round_) if round_ is not None else store.latest()
    if checkpoint is None:
        raise CheckpointError(f"{run.path} has no checkpoint yet")
    return checkpoint


def _expression_scores(run: RunDir, config: Config, round_: int | None) -> dict[str, Any]:
    """A FedAffect checkpoint scored as its server scores each round: expression accuracy."""
    checkpoint = _checkpoint(run, round_)
    source = f"the checkpoint of round {checkpoint.round} in {run.checkpoints}"
    model = build_fedaffect_model(
        config.model, config.algorithm, config.data.image_size, config.run.seed
    )
    for part in ("backbone", "head"):  # the shared encoder f and relation module g
        load_checkpoint_into(
            getattr(model, part), checkpoint.parameters, source=source, prefix=f"{part}."
        )
    plan = plan_federation(config)
    if len(plan.held_out) == 0:
        raise DataError(
            f"{run.path} holds out no identity (data.held_out_identities = 0): a FedAffect "
            "run is scored on the held-out identities' expressions, and there are none"
        )
    return {
        "run": str(run.path),
        "round": checkpoint.round,
        "data": "held-out identities of the run: expression recognition (FedAffect)",
        **make_evaluator(config, plan)(checkpoint.parameters),
    }


@contextmanager
def _scoring(model: str, remedy: str) -> Iterator[None]:
    """Score ``model``: embeddings that are zero or not finite raise a CheckpointError.

    Such a model diverged (NaN/Inf or vanishing weights, or outputs beyond float range):
    its pairs have no cosine, and figures computed anyway (zero vectors score 0 with
    everything) would read as a model without skill.
    """
    try:
        yield
    except DegenerateEmbeddings as exc:
        raise CheckpointError(
            f"{model} cannot be scored: {exc}; the model diverged or is degenerate ({remedy})"
        ) from exc


def _pair_metrics(
    scores: np.ndarray, same: np.ndarray, folds: np.ndarray | None, *, subset: bool = False
) -> dict[str, float]:
    """10-fold accuracy (when the file has folds), TAR at each FAR, AUC and EER.

    LFW's folds hold as many genuine as impostor pairs, so plain accuracy is fair on them;
    ``lfw_balanced_accuracy`` (mean of TPR and TNR, threshold tuned on the other folds)
    is given beside it. A ``subset`` of the pairs (those left after dropping some) is no
    longer balanced, and plain accuracy would reward a model that accepts everything: it
    gets its ``num_genuine`` and ``num_impostor`` and the balanced accuracy alone.
    """
    out: dict[str, float] = {}
    if subset:
        out["num_genuine"], out["num_impostor"] = int(same.sum()), int((~same).sum())
    if folds is not None:
        if not subset:
            mean, std = kfold_accuracy(scores, same, folds)
            out["lfw_accuracy_mean"], out["lfw_accuracy_std"] = mean, std
        outside = [same[folds != fold] for fold in np.unique(folds)]
        if all(o.any() and not o.all() for o in outside):  # a threshold to tune for each
            out["lfw_balanced_accuracy"] = kfold_balanced_accuracy(scores, same, folds)
    for name, far in VERIFICATION_FARS.items():
        out[f"tar_at_far_{name}"] = tar_at_far(scores, same, far)
    out["roc_auc"], out["eer"] = roc_auc(scores, same), eer(scores, same)
    return out


def _sites_own_data(run: RunDir) -> str | None:
    """Why the identities the run's clients trained on are unknown, or None when they are known.

    They are known when the clients trained on the config's data plan: an embedded run (its
    server spawned them on it; ``logs/`` holds their logs), a centralized run, or any run whose
    ``summary.json`` records the plan. A standalone server's sites trained on their own data
    (``fl-secure client --data``), which the server never sees: its summary records
    ``client_train_sizes`` as null, and a run without a summary that was not embedded may be one.
    """
    try:
        summary = run.read_summary() if run.summary.exists() else None
    except CheckpointError:  # damaged: it cannot tell
        summary = None
    if summary is not None:
        if "client_train_sizes" in summary and summary["client_train_sizes"] is None:
            return (
                "unknown: the sites trained on their own data (fl-secure server), which the "
                "server never sees, so their overlap with the pairs' identities cannot be counted"
            )
        return None
    if (run.path / "logs").is_dir():  # embedded: the clients were spawned on the plan
        return None
    return (
        "unknown: the run has no summary.json saying whose data its sites trained on (a "
        "standalone server's sites train on their own data, which the server never sees)"
    )


def _pretraining_names(
    config: Config, _seen: frozenset[Path] = frozenset()
) -> tuple[set[str], str | None]:
    """Names of the identities the run's ``model.pretrained`` weights trained on.

    The weights of a centralized run (``backbone.safetensors``) have its ``config.toml``
    beside them, whose data plan names them (and, if that run itself started from
    pretrained weights, theirs too). Weights from anywhere else say nothing of their
    training data. No ``model.pretrained``: no names.

    Returns:
        ``(names, None)``, or ``(set(), why)`` when they are unknown.
    """
    if not config.model.pretrained:
        return set(), None
    weights = Path(config.model.pretrained).resolve()
    beside = weights.parent / "config.toml"
    if weights in _seen:  # runs pretrained from each other in a loop: counted already
        return set(), None
    if not beside.is_file():
        return set(), (
            f"unknown: the model started from model.pretrained = {weights}, with no run's "
            "config.toml beside it to say which identities trained it (a centralized run "
            "keeps one beside its backbone.safetensors), so its overlap with the pairs' "
            "identities cannot be counted"
        )
    try:
        earlier = load_config(beside)
        check_config(earlier)
        names = _trained_names(earlier, centralized=True)
    except (FlSecureError, OSError) as exc:
        return set(), (
            f"unknown: the model started from model.pretrained = {weights}; the identities "
            f"that trained it cannot be read from {beside}: {exc}"
        )
    more, unknown = _pretraining_names(earlier, _seen | {weights})
    return (set(), unknown) if unknown is not None else (names | more, None)


def _trained_names(config: Config, *, centralized: bool = False) -> set[str]:
    """Names of the identities the run trained on (its data plan's).

    A centralized run pooled only some clients' labelled images
    (:func:`fl_secure.app.centralized.pretraining_clients`: the source client of a domain
    partition); a federated run trained on every client's.
    """
    plan = plan_federation(config)
    shares = plan.clients
    if centralized:
        shares = pretraining_clients(config, plan)
    return {
        share.train.identity_names[int(i)] for share in shares for i in share.train.identities()
    }
