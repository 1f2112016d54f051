"""``fl-secure audit``: attack a run's views and write ``RUN/audit/results.json`` and PNG grids.

For a run directory this module

1. builds each party's view (:mod:`audits.observations`),
2. picks ``N`` target identities among the training identities of the clients other than the
   curious one, and trains the judge's evaluator on the targets' own training images (the
   attacker never sees them; :mod:`audits.judge`),
3. **inversion**: reconstructs each target from the view's class embedding of it (global head
   row; FedGC: the server's copy of the owner's head row), or, where the view holds none,
   from the best surrogates -- the mean embedding of public faces and a random direction --
   with DeepInversion and a PCA face prior from public faces (:mod:`audits.inversion`),
4. **templates**: identifies the exposed head rows against embeddings of the targets' images,
5. **leakage**: recovers the inputs of the backbone's fully connected embedding layer from a
   rebuilt single-client update (no secure aggregation) and from the secure sum
   (:mod:`audits.leakage`),
6. **canary**: the empirical epsilon of the run's client-level mechanism
   (:mod:`audits.mechanism`), beside the accountant's epsilon.

Public faces (the attacker's prior and surrogate): by default the run's held-out identities'
images, which no client trains on; ``public_dir`` replaces them (e.g. LFW for a run on ORL).
Only the inversion attack uses them: an audit without it loads none, and so runs on a run
without held-out identities.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from audits.canary import clopper_pearson_interval
from audits.grids import save_grid
from audits.inversion import (
    FacePrior,
    InversionConfig,
    fit_face_prior,
    invert,
    mean_embedding_target,
    random_direction_target,
)
from audits.judge import Evaluator, EvaluatorConfig, judge, train_evaluator
from audits.leakage import (
    RecoveredInputs,
    identify,
    identify_head_templates,
    participant_precision,
    recover_fc_inputs,
    span_membership,
)
from audits.mechanism import (
    MAX_AUTO_TRIALS,
    MIN_AUDIT_TRIALS,
    audit_mechanism,
    audit_size,
    mechanism_of_run,
)
from audits.observations import (
    RunContext,
    View,
    check_auditable,
    choose_targets,
    load_run,
    observations,
    threat_model,
)
from fl_secure.config import load_config
from fl_secure.data.types import FaceDataset
from fl_secure.errors import CheckpointError, ConfigError
from fl_secure.runs import RunDir, atomic_write_json
from fl_secure.training import FaceModel, set_tensors
from privacy.dp.client_level import add_gaussian, client_noise_std
from privacy.dp.noise import SeededGaussian

ATTACKS = ("inversion", "templates", "leakage", "canary")


@dataclass(frozen=True)
class AuditSettings:
    """What to run and how hard."""

    attacks: tuple[str, ...] = ATTACKS
    targets: int = 10
    steps: int = 200  # Adam steps of each inversion
    restarts: int = 4
    prior_components: int = 64
    evaluator_epochs: int = 30
    include_images: bool = False  # grids of real (non-synthetic) faces
    public_dir: Path | None = None  # identity folders of public faces (default: held-out)
    public_center_crop: int = 0  # centre crop of the public faces before resizing (LFW: 150)
    canaries: int | None = None  # None: sized to test the run's claim (mechanism.audit_size)
    trials: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        """Reject unknown attacks and sizes that cannot run."""
        allowed = ", ".join(ATTACKS)
        if not self.attacks:
            raise ConfigError(f"--attack names no attack; allowed: {allowed}")
        unknown = sorted(set(self.attacks) - set(ATTACKS))
        if unknown:
            raise ConfigError(f"unknown attack {', '.join(unknown)}; allowed: {allowed}")
        for name, value, low in (
            ("--targets", self.targets, 2),
            ("--steps", self.steps, 1),
            ("restarts", self.restarts, 1),
            ("--canary-trials (canaries)", self.canaries, 1),
            ("--canary-trials", self.trials, 2),
            ("--seed", self.seed, 0),
        ):
            if value is not None and value < low:
                raise ConfigError(f"{name} = {value}: need {name} >= {low}")


@dataclass(frozen=True)
class Targets:
    """The target identities and the auditor's images of them (never the attacker's)."""

    identities: list[int]
    private: FaceDataset  # the targets' training images, labels = target index 0..N-1
    gallery: FaceDataset  # the targets' test images (template gallery), labels = index


def _remap(data: FaceDataset, identities: list[int]) -> FaceDataset:
    index = {t: i for i, t in enumerate(identities)}
    keep = np.flatnonzero(np.isin(data.labels.numpy(), identities))
    part = data.subset(keep)
    labels = torch.tensor([index[int(v)] for v in part.labels], dtype=torch.int64)
    return FaceDataset(part.images, labels, tuple(str(t) for t in identities), source=part.source)


def target_data(run: RunContext, identities: list[int]) -> Targets:
    """The targets' training images (judge) and test images (gallery), labels re-indexed.

    Raises:
        ValueError: ``identities`` names an identity twice: its images would all carry the
            label of one of its indices, and the other would be a target without images.
    """
    repeated = sorted({t for t in identities if identities.count(t) > 1})
    if repeated:
        raise ValueError(
            f"target identities {repeated} are named more than once in {identities}: each "
            "target must be a distinct identity"
        )
    train = [c.train for c in run.plan.clients]
    test = [c.test for c in run.plan.clients]

    def union(parts: Sequence[FaceDataset]) -> FaceDataset:
        chosen = [_remap(p, identities) for p in parts]
        chosen = [c for c in chosen if len(c)]
        return FaceDataset(
            torch.cat([c.images for c in chosen]),
            torch.cat([c.labels for c in chosen]),
            tuple(str(t) for t in identities),
        )

    private = union(train)
    gallery_parts = [p for p in (_remap(t, identities) for t in test) if len(p)]
    gallery = union(test) if gallery_parts else private
    return Targets(identities=identities, private=private, gallery=gallery)


_EVALUATORS: dict[str, Evaluator] = {}


def cached_evaluator(images: torch.Tensor, labels: torch.Tensor, cfg: EvaluatorConfig) -> Evaluator:
    """:func:`train_evaluator`, memoised in this process by the data and settings."""
    digest = hashlib.sha256(images.numpy().tobytes())
    digest.update(labels.numpy().tobytes())
    digest.update(repr(cfg).encode())
    key = digest.hexdigest()
    if key not in _EVALUATORS:
        _EVALUATORS[key] = train_evaluator(images, labels, config=cfg)
    return _EVALUATORS[key]


def public_faces(run: RunContext, settings: AuditSettings) -> tuple[torch.Tensor, str]:
    """The attacker's public faces and a sentence saying what they are.

    Raises:
        ConfigError: fewer than 2 faces, in the ``--public`` folders or among the run's
            held-out identities (which then needs ``--public``).
    """
    size = run.config.data.image_size
    if settings.public_dir is not None:
        from fl_secure.data.folders import load_identity_folders

        data = load_identity_folders(
            settings.public_dir, image_size=size, center_crop=settings.public_center_crop or None
        )
        if len(data) < 2:  # the prior is a PCA of the faces: one face spans no direction
            raise ConfigError(
                f"--public {settings.public_dir} holds {len(data)} face image(s): the "
                "attacker's prior (a PCA face space) needs at least 2"
            )
        return data.images, (
            f"{len(data)} public face images of {data.num_identities} identities from "
            f"{settings.public_dir.name} (identity folders given with --public), none of them "
            "a participant"
        )
    held = run.plan.held_out
    if len(held) < 2:
        raise ConfigError("the run has no held-out identities: give public faces with --public")
    return held.images, (
        f"{len(held)} images of the run's {len(held.identities())} held-out identities, which "
        "no client trains on (a stand-in for public faces of the same population)"
    )


def _embed(backbone: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        backbone.eval()
        return torch.cat([backbone(images[i : i + 256]) for i in range(0, len(images), 256)])


def _grid(out: Path, name: str, tg: Targets, recon: torch.Tensor, allowed: bool) -> str | None:
    if not allowed:
        return None
    real = [tg.private.images[tg.private.labels == i][:3] for i in range(len(tg.identities))]
    save_grid(out / name, real, [r.unsqueeze(0) for r in recon])
    return name


def _inversion(
    run: RunContext,
    view: View,
    tg: Targets,
    evaluator: Evaluator,
    prior: FacePrior,
    public: torch.Tensor,
    settings: AuditSettings,
    out: Path,
    grids: bool,
) -> dict[str, Any]:
    backbone = run.model.backbone
    size = run.config.data.image_size
    cfg = InversionConfig(steps=settings.steps, restarts=settings.restarts, prior="subspace",
                          seed=settings.seed)  # fmt: skip
    labels = torch.arange(len(tg.identities))
    dim = run.config.model.embedding_size
    directions: dict[str, tuple[torch.Tensor, str]] = {}
    if view.head_rows:
        rows = torch.stack([view.head_rows[t] for t in tg.identities])
        directions["head_row"] = (rows, view.head_source)
    else:
        mean = mean_embedding_target(backbone, public).expand(len(tg.identities), -1)
        directions["surrogate_public_mean"] = (
            mean,
            "surrogate: unit mean embedding of the public faces (the view holds no row)",
        )
        gen = torch.Generator().manual_seed(settings.seed)
        directions["surrogate_random"] = (
            random_direction_target(dim, len(tg.identities), generator=gen),
            "surrogate: a random unit direction per target (the view holds no row)",
        )
    results: dict[str, Any] = {}
    for name, (direction, text) in directions.items():
        started = time.perf_counter()
        attack = invert(backbone, direction, image_size=size, config=cfg, face_prior=prior)
        seconds = time.perf_counter() - started
        scored = judge(evaluator, attack.images, labels, tg.private.images, tg.private.labels)
        grid = _grid(out, f"inversion-{view.inversion_key}-{name}.png", tg, attack.images, grids)
        results[name] = {
            "target_direction": text,
            **scored.summary(),
            "chance": scored.chance_top1,
            "top1_over_chance": scored.top1 / scored.chance_top1,
            "mean_cosine_to_direction": float(attack.cosine.mean()),
            "seconds": round(seconds, 2),
            "iterations_per_second": settings.steps
            * settings.restarts
            * len(tg.identities)
            / max(seconds, 1e-9),
            **({"grid": grid} if grid else {}),
        }
    best = max(results, key=lambda k: results[k]["top1"])
    return {"attacked_view": view.holder, "best": best, **results}


def _templates(run: RunContext, view: View, tg: Targets) -> dict[str, Any]:
    if not view.head_rows:
        return {"applicable": False, "why": view.head_source}
    rows = torch.stack([view.head_rows[t] for t in tg.identities])
    gallery = _embed(run.model.backbone, tg.gallery.images)
    found, top1 = identify_head_templates(rows, torch.arange(len(tg.identities)), gallery,
                                          tg.gallery.labels)  # fmt: skip
    n = len(tg.identities)
    return {
        "applicable": True,
        "gallery": f"{len(tg.gallery)} test images of the targets (view's backbone)",
        "top1": top1,
        "top1_ci95": list(clopper_pearson_interval(round(top1 * n), n)),
        "top5": found.accuracy(torch.arange(n), k=5),
        "chance": 1.0 / n,
    }


def _penultimate(backbone: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    layer = backbone.embedding
    assert isinstance(layer, torch.nn.Linear)
    seen: list[torch.Tensor] = []
    hook = layer.register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
    try:
        _embed(backbone, images)
    finally:
        hook.remove()
    return torch.cat(seen)


def _client_model(run: RunContext, k: int) -> tuple[FaceModel, str]:
    """Client ``k``'s model at the final checkpoint, and where its head came from."""
    from fl_secure.training import build_model

    share = run.plan.clients[k]
    classes = run.strategy.num_head_classes(
        len(run.plan.train_identities), np.unique(share.train.labels.numpy())
    )
    cfg = run.config
    model = build_model(cfg.model, classes, cfg.data.image_size, cfg.run.seed)
    set_tensors(model, run.checkpoint.parameters)
    if run.strategy.shares_head:
        return model, "the global head"
    heads = run.checkpoint.client_tensors.get(run.client_ids[k])
    if heads:
        set_tensors(model, type(run.checkpoint.parameters)(heads.items()))
        return model, "the server's copy of the client's head"
    private = run.path / "clients" / run.client_ids[k] / "private.safetensors"
    if private.exists():
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(private)), strict=False)
        return model, "the client's private head (clients/<id>/private.safetensors)"
    return model, "a freshly initialised head (the client's private head is not in the run dir)"


def _fc_update(
    run: RunContext, k: int, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float, str]:
    """One local gradient step of client ``k`` on the given training images.

    Returns the embedding layer's weight and bias update, the norm of the whole shared update,
    and where the client's head came from.
    """
    model, head_source = _client_model(run, k)
    share = run.plan.clients[k]
    local = run.strategy.local_data(share.train, share.test, run.plan.train_identities)
    model.train()
    images, labels = local.train.images[indices], local.train_targets[indices]
    loss = F.cross_entropy(model(images, labels, local.class_mask), labels)
    model.zero_grad(set_to_none=True)
    torch.autograd.backward(loss)
    lr = run.config.train.lr
    shared = set(run.strategy.shared_names(model))
    total = 0.0
    for name, p in model.named_parameters():
        if name in shared and p.grad is not None:
            total += float((lr * p.grad).double().pow(2).sum())
    layer = model.backbone.embedding
    assert isinstance(layer, torch.nn.Linear)
    assert layer.weight.grad is not None and layer.bias.grad is not None
    return -lr * layer.weight.grad, -lr * layer.bias.grad, math.sqrt(total), head_source


def _privatise(
    run: RunContext, dw: torch.Tensor, db: torch.Tensor, norm: float, party: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The client's clipping (and noise share, local/distributed placement) of client-level DP.

    Clipping scales the whole update, so the FC rows are scaled by the same factor; noise is
    independent per coordinate, so the FC rows get exactly their share.
    """
    p = run.config.privacy
    if run.privacy_unit != "client":
        return dw, db
    privacy = run.summary.get("privacy") or {}
    z, c = float(privacy.get("noise_multiplier", p.noise_multiplier)), p.clip_norm
    factor = min(1.0, c / norm) if norm > 0 else 1.0
    dw, db = dw * factor, db * factor
    std = client_noise_std(p.noise_placement, z, c, run.config.server.min_clients)
    if std > 0:
        source = SeededGaussian(int(hashlib.sha256(party.encode()).hexdigest()[:8], 16))
        noisy = add_gaussian({"w": dw.numpy(), "b": db.numpy()}, std, source)
        dw, db = torch.from_numpy(noisy["w"]), torch.from_numpy(noisy["b"])
    return dw, db


def _numerical_rank(weight: torch.Tensor) -> int:
    """Rank of a float32 update: singular values above float32 rounding of the largest."""
    tol = torch.finfo(torch.float32).eps * max(weight.shape)
    return int(torch.linalg.matrix_rank(weight.double(), rtol=tol).item())


def _name_participants(
    dw: torch.Tensor,
    rec: RecoveredInputs,
    inputs: torch.Tensor,
    participants: torch.Tensor,
    gallery: torch.Tensor,
    gallery_labels: torch.Tensor,
) -> dict[str, float]:
    """Precision of the identities named from an update by each attack, and from its inputs.

    Row ratios (``rec``, the update's :func:`recover_fc_inputs`: its 64 largest-bias rows),
    the span of the update's row space (:func:`span_membership`, told the number of inputs),
    and the exact inputs (the reference an attack that lost nothing would reach).
    """
    rows = identify(rec.vectors[:64], gallery, gallery_labels)
    span = span_membership(dw, gallery, gallery_labels, rank=inputs.shape[0])
    exact = identify(inputs, gallery, gallery_labels)
    return {
        "row_ratios": participant_precision(rows, participants),
        "span": participant_precision(span, participants),
        "exact_inputs": participant_precision(exact, participants),
    }


def _naming_entry(named: dict[str, float]) -> dict[str, Any]:
    """The better attack's precision, each attack's, and the exact-input reference."""
    return {
        "participant_precision": max(named["row_ratios"], named["span"]),
        "by_attack": {"row_ratios": named["row_ratios"], "span": named["span"]},
        "exact_inputs": named["exact_inputs"],
    }


def _leakage(run: RunContext, view: View, settings: AuditSettings) -> dict[str, Any]:
    if view.updates == "none":
        return {"applicable": False, "why": "this party receives no client's update"}
    if run.privacy_unit == "example":
        return {
            "applicable": False,
            "why": "example-level DP (DP-SGD): a rebuilt update would carry none of the run's "
            "per-example clipping and noise, so it would measure another mechanism",
        }
    backbone = run.model.backbone
    test = [c.test for c in run.plan.clients]
    gallery_images = torch.cat([t.images for t in test])
    gallery_labels = torch.cat([t.labels for t in test])
    gallery = _penultimate(backbone, gallery_images)
    identities = int(torch.unique(gallery_labels).numel())
    batch = min(run.config.train.batch_size, *(len(c.train) for c in run.plan.clients))
    gen = torch.Generator().manual_seed(settings.seed)
    out: dict[str, Any] = {
        "applicable": True,
        "layer": "backbone.embedding (fully connected, with bias): inputs = penultimate features",
        "rebuilt_update": "one local gradient step of each client on its own training images "
        "from the final global model (FedSGD-like; the run's real updates, several local steps "
        "with its optimiser, mix inputs further and are not recorded)",
        "gallery": f"penultimate features of the clients' test images ({identities} identities)",
        "privacy": "client-level DP: each update clipped (and noised for local/distributed "
        "placement) as the run's clients do"
        if run.privacy_unit == "client"
        else "none",
    }
    updates, singles = [], []
    single_ids: list[torch.Tensor] = []
    single_truth: list[torch.Tensor] = []
    batch_ids: list[torch.Tensor] = []
    batch_truth: list[torch.Tensor] = []
    single_hits, single_err = [], []
    batch_scores: list[dict[str, float]] = []
    batch_chance: list[float] = []
    for k in range(len(run.plan.clients)):
        n = len(run.plan.clients[k].train)
        order = torch.randperm(n, generator=gen)
        one = order[:1]
        dw, db, norm, _ = _fc_update(run, k, one)
        dw, db = _privatise(run, dw, db, norm, f"client-{k}-1")
        singles.append((dw, db))
        single_ids.append(run.plan.clients[k].train.labels[one])
        single_truth.append(_penultimate(backbone, run.plan.clients[k].train.images[one]))
        if view.updates == "each client's update":
            rec = recover_fc_inputs(dw, db)
            truth = single_truth[-1]
            if len(rec.vectors):
                cos = F.normalize(rec.vectors, dim=1) @ F.normalize(truth, dim=1).T
                single_err.append(max(0.0, float(1 - cos.max())))
                found = identify(rec.vectors[:1], gallery, gallery_labels)
                single_hits.append(found.accuracy(run.plan.clients[k].train.labels[one]))
        idx = order[:batch]
        dw, db, norm, head_source = _fc_update(run, k, idx)
        dw, db = _privatise(run, dw, db, norm, f"client-{k}-b")
        updates.append((dw, db))
        batch_ids.append(run.plan.clients[k].train.labels[idx])
        batch_truth.append(_penultimate(backbone, run.plan.clients[k].train.images[idx]))
        if view.updates == "each client's update":
            participants = torch.unique(run.plan.clients[k].train.labels[idx])
            rec = recover_fc_inputs(dw, db)
            batch_scores.append(
                _name_participants(dw, rec, batch_truth[-1], participants, gallery, gallery_labels)
            )
            batch_chance.append(len(participants) / identities)
    out["client_head"] = head_source
    if view.updates == "each client's update":
        hits = int(sum(single_hits))
        out["single_client_one_image"] = {
            "top1": float(np.mean(single_hits)) if single_hits else 0.0,
            "top1_ci95": list(clopper_pearson_interval(hits, len(single_hits)))
            if single_hits
            else None,
            "chance": 1.0 / identities,
            "mean_one_minus_cosine_to_truth": float(np.mean(single_err)) if single_err else None,
            "clients": len(single_hits),
        }
        mean = {k: float(np.mean([b[k] for b in batch_scores])) for k in batch_scores[0]}
        out[f"single_client_batch_{batch}"] = {
            **_naming_entry(mean),
            "chance": float(np.mean(batch_chance)),
            "clients": len(batch_scores),
        }
    for name, parts, ids, truths in (
        ("secure_sum_one_image_each", singles, single_ids, single_truth),
        (f"secure_sum_batch_{batch}", updates, batch_ids, batch_truth),
    ):
        total_w = torch.stack([u[0] for u in parts]).sum(0)
        total_b = torch.stack([u[1] for u in parts]).sum(0)
        everyone = torch.unique(torch.cat(ids))
        inputs = torch.cat(truths)
        rec = recover_fc_inputs(total_w, total_b)
        named = _name_participants(total_w, rec, inputs, everyone, gallery, gallery_labels)
        out[name] = {
            **_naming_entry(named),
            "chance": int(everyone.numel()) / identities,
            "clients": len(parts),
            "participants": int(everyone.numel()),
            "images": int(inputs.shape[0]),
            "rank": _numerical_rank(total_w),
        }
        if int(everyone.numel()) == identities:
            out[name]["uninformative"] = (
                "every gallery identity took part: naming participants cannot differ from "
                "chance (1.0), so this entry measures nothing"
            )
        if parts is singles and len(rec.vectors):  # exact recovery of any one input?
            closest = F.normalize(rec.vectors, dim=1) @ F.normalize(inputs, dim=1).T
            out[name]["max_cosine_to_a_single_input"] = float(closest.max())
    out["secure_sum_note"] = (
        "sum of every client's rebuilt update (what the server sees under secure "
        "aggregation); the attacker names as many identities as took part, by the better of "
        "two attacks: row ratios (dW[i] / db[i]) and the span (the sum's row space is the "
        "span of its inputs; the attacker is told how many images went in); exact_inputs is "
        "what naming from the inputs themselves scores (an attack on the sum that reaches it "
        "lost nothing to the summation); rank is the sum's numerical rank; "
        "max_cosine_to_a_single_input is the closest a row-ratio vector of the sum comes to "
        "one participant's input (near 1: a row dominated by one input gives it away); "
        "chance = participants / gallery identities"
    )
    return out


def audit_run(
    run_dir: Path,
    settings: AuditSettings | None = None,
    *,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Attack every view of the run; write ``audit/results.json`` (and grids); return it.

    The audit holds the run (:meth:`RunDir.held`) from loading it to writing its results: a
    server still training it would move the checkpoint under the attack, and two audits
    would write one ``audit/`` folder.

    Raises:
        CheckpointError: another process (a training server, another audit) holds the run.
    """
    started = time.perf_counter()
    run_dir = Path(run_dir)
    # The refusals that need no lock come first: no lock file in a folder that is no run
    if not (run_dir / "config.toml").is_file():
        raise CheckpointError(f"{run_dir} is not a run directory (no config.toml)")
    check_auditable(load_config(run_dir / "config.toml").algorithm.name)
    with RunDir(run_dir).held():
        return _audit_held(load_run(run_dir), settings or AuditSettings(), started, progress, log)


def _audit_held(
    run: RunContext,
    cfg: AuditSettings,
    started: float,
    progress: bool,
    log: Callable[[str], None] | None,
) -> dict[str, Any]:
    """:func:`audit_run` once this process holds the run directory."""
    out = run.path / "audit"
    out.mkdir(parents=True, exist_ok=True)
    # a prior fitted on --public faces (identity folders: real faces) shapes every
    # reconstruction, so its grids are real-face material even for a synthetic run
    real_prior = cfg.public_dir is not None
    synthetic = run.config.data.source == "synthetic" and not real_prior
    grids = synthetic or cfg.include_images
    identities = choose_targets(run, cfg.targets)
    tg = target_data(run, identities)
    views = observations(run, identities)
    wants = set(cfg.attacks)
    stages = (
        (["evaluator"] if wants & {"inversion"} else [])
        + [
            f"{a}:{v.party}"
            for a in ("inversion", "templates", "leakage")
            if a in wants
            for v in views
        ]
        + (["canary"] if "canary" in wants else [])
    )
    bar = tqdm(total=len(stages), desc="audit", disable=not progress, unit="stage")
    attacks: dict[str, Any] = {}
    # only inversion uses public faces (its prior and surrogate): the other attacks run on a
    # run without held-out identities and without --public
    attacker_prior: dict[str, Any] = {
        "public_faces": None,
        "from_real_faces": False,
        "prior": "none: only the inversion attack uses public faces, and it was not run",
    }
    prior_components = None
    evaluator = None
    if "inversion" in wants:
        public, public_text = public_faces(run, cfg)
        prior = fit_face_prior(public, components=cfg.prior_components)
        prior_components = prior.basis.shape[0]
        attacker_prior = {
            "public_faces": public_text,
            "from_real_faces": real_prior,  # --public folders: grids only with --include-images
            "prior": f"PCA face space of the public faces ({prior_components} components), "
            "Gaussian penalty on the whitened coefficients; BatchNorm statistics where the "
            "backbone has BatchNorm (this backbone: "
            f"{'yes' if _has_bn(run.model.backbone) else 'no, GroupNorm'})",
        }
        bar.set_postfix_str("training the judge's evaluator")
        evaluator = cached_evaluator(
            tg.private.images, tg.private.labels, EvaluatorConfig(epochs=cfg.evaluator_epochs)
        )
        bar.update()
        done: dict[str, dict[str, Any]] = {}
        attacks["inversion"] = {}
        for view in views:
            bar.set_postfix_str(f"inversion, {view.party}")
            if view.inversion_key not in done:
                done[view.inversion_key] = _inversion(
                    run, view, tg, evaluator, prior, public, cfg, out, grids
                )
                result = done[view.inversion_key]
            else:
                result = {**done[view.inversion_key], "same_as_view_of": "server"}
            attacks["inversion"][view.party] = {**result, "attacked_view": view.holder}
            bar.update()
    if "templates" in wants:
        attacks["templates"] = {}
        for view in views:
            attacks["templates"][view.party] = _templates(run, view, tg)
            bar.update()
    if "leakage" in wants:
        attacks["leakage"] = {}
        for view in views:
            bar.set_postfix_str(f"leakage, {view.party}")
            attacks["leakage"][view.party] = _leakage(run, view, cfg)
            bar.update()
    if "canary" in wants:
        bar.set_postfix_str("canary audit")
        mech = mechanism_of_run(
            run.summary,
            num_clients=len(run.plan.clients),
            min_clients=run.config.server.min_clients,
            rounds=run.config.train.rounds,
            source=str(run.path / "summary.json"),
        )
        size = audit_size(mech)
        attacks["canary"] = {
            **audit_mechanism(
                mech, canaries=cfg.canaries or size, trials=cfg.trials or size, seed=cfg.seed
            ),
            "size_chosen": "--canary-trials"
            if cfg.trials is not None
            else "to test the accountant's epsilon (at least "
            f"{MIN_AUDIT_TRIALS}, at most {MAX_AUTO_TRIALS})",
        }
        bar.update()
    bar.close()
    results: dict[str, Any] = {
        "run": str(run.path),
        "algorithm": run.strategy.name,
        "exposure": run.exposure,
        "data_source": run.config.data.source,
        "checkpoint_round": run.checkpoint.round,
        "secure_aggregation": run.secure_aggregation,
        "privacy_unit": run.privacy_unit,
        "epsilon": run.summary.get("epsilon"),
        "delta": run.summary.get("delta"),
        "threat_model": threat_model(run),
        "views": [v.to_dict() for v in views],
        "targets": {
            "count": len(identities),
            "requested": cfg.targets,  # fewer when fewer identities are outside client 0
            "identities": identities,
            "chosen": "training identities of the clients other than the curious client, "
            "round-robin over the clients",
            "private_images": len(tg.private),
            "gallery_images": len(tg.gallery),
        },
        "attacker_prior": attacker_prior,
        "judge": {
            "evaluator": "cnn-small + CosFace, trained only on the targets' own training images "
            f"({len(tg.private)}), which the attacker never sees; chance = 1 / targets for "
            "top-1 (95% Clopper-Pearson interval beside it); for KNN distance, SSIM and PSNR, "
            "chance = the same measure against every other target's nearest private image",
        },
        "settings": {
            "steps": cfg.steps,
            "restarts": cfg.restarts,
            "prior_components": prior_components,  # null: no inversion, no prior
            "evaluator_epochs": cfg.evaluator_epochs,
            "seed": cfg.seed,
        },
        "attacks": attacks,
        "images": "grids written" if grids else "no grids: real faces (use --include-images)",
        "duration_s": round(time.perf_counter() - started, 1),
    }
    # what the audit concluded, as it concluded it (a reader of results.json alone sees it;
    # the report recomputes them from the numbers and says so if they differ)
    results["findings"] = findings(results)
    atomic_write_json(out / "results.json", results)
    if log is not None:
        log(f"wrote {out / 'results.json'}")
    # Grids of an earlier audit that this one did not write (another --attack subset or
    # --targets) would sit beside results that do not describe them: remove them.
    written = {entry["grid"] for entry in _inversion_entries(results) if "grid" in entry}
    for stale in sorted(out.glob("inversion-*.png")):
        if stale.name not in written:
            stale.unlink()
            if log is not None:
                log(f"removed {stale} (an earlier audit's grid)")
    return results


def _inversion_entries(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every per-direction entry of the inversion attack (each may name its grid)."""
    return [
        entry
        for view in results["attacks"].get("inversion", {}).values()
        for entry in view.values()
        if isinstance(entry, dict)
    ]


def _has_bn(module: torch.nn.Module) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    return any(isinstance(m, _BatchNorm) for m in module.modules())


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (party view) for README tables: top-1 vs chance, KNN, SSIM, epsilon."""
    rows = []
    inversion = results["attacks"].get("inversion", {})
    canary = results["attacks"].get("canary", {})
    templates = results["attacks"].get("templates", {})
    order = sorted(inversion, key=lambda p: (p != "server", p))
    for party in order:
        res = inversion[party]
        best = res[res["best"]]
        rows.append({
            "algorithm": results["algorithm"],
            "exposure": results["exposure"],
            "privacy": results["privacy_unit"],
            "party": party,
            "direction": res["best"],
            "top1": best["top1"],
            "top1_ci95": best.get("top1_ci95"),
            "chance": best["chance_top1"],
            "knn_distance": best["knn_distance"],
            "chance_knn_distance": best.get("chance_knn_distance"),
            "ssim": best["ssim"],
            "chance_ssim": best.get("chance_ssim"),
            "templates_top1": templates.get(party, {}).get("top1"),
            "templates_top1_ci95": templates.get(party, {}).get("top1_ci95"),
            "epsilon_lower_bound": canary.get("epsilon_lower_bound"),
            "epsilon_lower_bound_at_audit_cap": canary.get("at_audit_cap"),
            "accountant_epsilon": canary.get("accountant_epsilon"),
        })  # fmt: skip
    return rows


def _is_finding(f: dict[str, Any]) -> bool:
    return isinstance(f.get("code"), str) and isinstance(f.get("message"), str)


def check_results(results: Any, source: str = "audit/results.json") -> None:
    """Refuse audit results that :func:`table_rows` and :func:`findings` cannot read.

    The report reads ``audit/results.json`` after it has sat in a run folder, where it may
    have been edited or damaged; this names the first field that is missing or of the wrong
    type instead of failing somewhere inside the report.

    Raises:
        CheckpointError: naming ``source`` and the field.
    """

    def fail(where: str, what: str) -> None:
        raise CheckpointError(f"{source} is damaged: {where} {what}")

    def node(parent: Any, key: str, where: str) -> dict[str, Any]:
        value = parent.get(key) if isinstance(parent, dict) else None
        if not isinstance(value, dict):
            fail(f"{where}.{key}" if where else key, "is missing or not an object")
        return value  # type: ignore[return-value]

    def number(parent: dict[str, Any], key: str, where: str, *, optional: bool = False) -> None:
        value = parent.get(key)
        if value is None and optional:
            return
        if key not in parent:
            fail(f"{where}.{key}", "is missing (expected a number)")
        if isinstance(value, bool) or not isinstance(value, int | float):
            fail(f"{where}.{key}", f"is {value!r}, not a number")

    def interval(parent: dict[str, Any], key: str, where: str) -> None:
        value = parent.get(key)
        ok = value is None or (
            isinstance(value, list)
            and len(value) == 2
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        )
        if not ok:
            fail(f"{where}.{key}", f"is {value!r}, not a [low, high] interval")

    stated = results.get("findings") if isinstance(results, dict) else None
    if stated is not None and not (
        isinstance(stated, list) and all(isinstance(f, dict) and _is_finding(f) for f in stated)
    ):
        fail("findings", "is not a list of {code, message} objects")
    attacks = node(results, "attacks", "")
    sections = {
        name: node(attacks, name, "attacks") if name in attacks else {}
        for name in ("inversion", "templates", "leakage")
    }
    for party in sections["inversion"]:
        view = node(attacks["inversion"], party, "attacks.inversion")
        at = f"attacks.inversion.{party}"
        best = view.get("best")
        if not isinstance(best, str):
            fail(f"{at}.best", "is missing (expected the name of the best direction)")
        entry = node(view, str(best), at)
        for key in ("top1", "chance_top1", "knn_distance", "ssim"):
            number(entry, key, f"{at}.{best}")
        for key in ("chance_knn_distance", "chance_ssim"):
            number(entry, key, f"{at}.{best}", optional=True)
        interval(entry, "top1_ci95", f"{at}.{best}")
        for direction, each in view.items():
            grid = each.get("grid") if isinstance(each, dict) else None
            if grid is not None and (
                not isinstance(grid, str) or Path(grid).name != grid or not grid.endswith(".png")
            ):  # the report embeds the file: it must be a PNG in the audit folder itself
                fail(f"{at}.{direction}.grid", f"is {grid!r}, not a PNG file name")
    for party in sections["templates"]:
        res = node(attacks["templates"], party, "attacks.templates")
        if res.get("applicable"):
            where = f"attacks.templates.{party}"
            number(res, "top1", where)
            number(res, "chance", where)
            interval(res, "top1_ci95", where)
    for party in sections["leakage"]:
        res = node(attacks["leakage"], party, "attacks.leakage")
        one = res.get("single_client_one_image") if res.get("applicable") else None
        if one is not None:
            where = f"attacks.leakage.{party}.single_client_one_image"
            one = node(res, "single_client_one_image", f"attacks.leakage.{party}")
            for key in ("top1", "chance", "clients"):
                number(one, key, where)
            interval(one, "top1_ci95", where)
    if attacks.get("canary") is not None:
        canary = node(attacks, "canary", "attacks")
        number(canary, "epsilon_lower_bound", "attacks.canary")
        number(canary, "accountant_epsilon", "attacks.canary", optional=True)
        if canary.get("exceeds_accountant"):
            number(canary, "accountant_epsilon", "attacks.canary")


def findings(results: dict[str, Any]) -> list[dict[str, str]]:
    """What a reader of the audit must not miss, as report warnings (``code``, ``message``).

    An attack is flagged when the lower end of its 95% Clopper-Pearson interval lies above
    chance: the attacker identified faces from that view, and it is not luck at that
    confidence. An empirical epsilon above the accountant's upper bound is flagged too: one
    of them is wrong, so the stated guarantee cannot be relied on.
    """
    found: dict[str, list[str]] = {}
    attacks = results.get("attacks", {})

    def above_chance(ci: Sequence[float] | None, chance: float) -> bool:
        return ci is not None and ci[0] > chance

    for row in table_rows(results):
        if above_chance(row["top1_ci95"], row["chance"]):
            found.setdefault("audit-inversion-identifies", []).append(
                f"{row['party']} view ({row['direction']}): top-1 {row['top1']:.2f}"
                f"{_interval(row['top1_ci95'])} vs chance {row['chance']:.2f}"
            )
    for party, res in sorted(attacks.get("templates", {}).items()):
        if res.get("applicable") and above_chance(res.get("top1_ci95"), res["chance"]):
            found.setdefault("audit-templates-identify", []).append(
                f"{party} view: top-1 {res['top1']:.2f}{_interval(res['top1_ci95'])} vs chance "
                f"{res['chance']:.2f}"
            )
    for party, res in sorted(attacks.get("leakage", {}).items()):
        one = res.get("single_client_one_image") if res.get("applicable") else None
        if one and one.get("clients"):
            n = int(one["clients"])  # results written before the interval was recorded:
            ci = one.get("top1_ci95") or clopper_pearson_interval(round(one["top1"] * n), n)
            if above_chance(ci, one["chance"]):
                found.setdefault("audit-update-leaks", []).append(
                    f"{party} view: top-1 {one['top1']:.2f}{_interval(ci)} vs chance "
                    f"{one['chance']:.3f}"
                )
    canary = attacks.get("canary") or {}
    if canary.get("exceeds_accountant"):
        found["audit-exceeds-accountant"] = [
            f"empirical epsilon >= {canary['epsilon_lower_bound']:.3f} against the "
            f"accountant's {canary['accountant_epsilon']:.3f}"
        ]
    if canary.get("can_test_accountant") is False:
        found["audit-cannot-test-accountant"] = [
            f"no outcome of this audit can show more than "
            f"{canary['largest_bound_this_audit_can_show']:.3f}, below the accountant's "
            f"{canary['accountant_epsilon']:.3f}; {_trials_that_test(canary)}"
        ]
    lead = {
        "audit-inversion-identifies": "Model inversion produced faces that the independent "
        "judge identified above chance (95% interval)",
        "audit-templates-identify": "The class embeddings in the shared head identify their "
        "identities above chance (95% interval)",
        "audit-update-leaks": "One client's update gave away the face features of its input, "
        "identified above chance (95% interval)",
        "audit-exceeds-accountant": "The empirical epsilon lower bound exceeds the "
        "accountant's upper bound: the accounting or the mechanism as implemented is wrong "
        "(or, at 5% odds, the audit erred), and the stated guarantee cannot be relied on",
        "audit-cannot-test-accountant": "The canary audit could not test the "
        "accountant's epsilon: even a mechanism with no noise would not have been flagged",
    }
    return [
        {"code": code, "message": f"{lead[code]}: " + "; ".join(items) + "."}
        for code, items in found.items()
    ]


def _trials_that_test(canary: dict[str, Any]) -> str:
    """How large a canary audit would test the accountant's epsilon, as the finding says it."""
    needed = canary.get("trials_to_test_accountant")
    if needed is not None:
        return f"--canary-trials {needed} can"
    if not math.isfinite(canary["accountant_epsilon"]):
        return "no audit can: an infinite epsilon bounds nothing"
    beyond = canary.get("trials_to_test_accountant_more_than")
    return f"no audit of up to {beyond:,} trials can" if beyond else "no practical audit can"


def summary_lines(results: dict[str, Any]) -> list[str]:
    """What ``fl-secure audit`` prints: each attack that ran, per party, beside chance."""
    attacks = results["attacks"]
    lines = []
    for row in table_rows(results):
        lines.append(
            f"{row['party']:>15}: inversion top-1 {row['top1']:.2f}{_interval(row['top1_ci95'])} "
            f"(chance {row['chance']:.2f}, {row['direction']}), KNN distance "
            f"{row['knn_distance']:.3f}{_versus(row['chance_knn_distance'])}, SSIM "
            f"{row['ssim']:.3f}{_versus(row['chance_ssim'])}"
        )

    def servers_first(item: tuple[str, Any]) -> tuple[bool, str]:
        return item[0] != "server", item[0]

    for party, res in sorted(attacks.get("templates", {}).items(), key=servers_first):
        if res["applicable"]:
            lines.append(
                f"{party:>15}: head templates identified, top-1 {res['top1']:.2f}"
                f"{_interval(res.get('top1_ci95'))} (chance {res['chance']:.2f})"
            )
        else:
            lines.append(f"{party:>15}: head templates: {res['why']}")
    for party, res in sorted(attacks.get("leakage", {}).items(), key=servers_first):
        if not res.get("applicable"):
            lines.append(f"{party:>15}: update leakage: {res.get('why', 'not applicable')}")
            continue
        one = res.get("single_client_one_image")
        if one:
            lines.append(
                f"{party:>15}: one client's update -> its input recovered (1 - cosine "
                f"{one['mean_one_minus_cosine_to_truth']:.1e}), identified top-1 "
                f"{one['top1']:.2f}{_interval(one.get('top1_ci95'))} (chance {one['chance']:.3f})"
            )
        total = res["secure_sum_one_image_each"]
        lines.append(
            f"{party:>15}: sum of {total['clients']} one-image updates (rank {total['rank']}) -> "
            f"participants named {total['participant_precision']:.2f} (span "
            f"{total['by_attack']['span']:.2f}, row ratios {total['by_attack']['row_ratios']:.2f};"
            f" from the exact inputs {total['exact_inputs']:.2f}; chance {total['chance']:.2f})"
        )
    canary = attacks.get("canary")
    if canary:
        acc = canary["accountant_epsilon"]
        capped = (
            ", the most this audit's size can show: the attack never erred, so a larger audit "
            "could show more"
            if canary.get("at_audit_cap")
            else ""
        )
        lines.append(
            f"empirical epsilon >= {canary['epsilon_lower_bound']:.3f} (95% confidence{capped}; "
            "at most "
            f"{canary['one_run']['max_epsilon_lower_bound']:.2f} one-run, "
            f"{canary['clopper_pearson']['max_epsilon_lower_bound']:.2f} over trials); "
            f"accountant: {'no DP' if acc is None else f'{acc:.3f}'}"
        )
    lines += [f"finding [{f['code']}]: {f['message']}" for f in findings(results)]
    return lines


def _interval(ci: Sequence[float] | None) -> str:
    """`` [low, high]`` of a 95% interval, or nothing for results written before it existed."""
    return "" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]"


def _versus(chance: float | None) -> str:
    """`` (chance x)`` for KNN distance and SSIM, or nothing for older results."""
    return "" if chance is None else f" (chance {chance:.3f})"


def markdown_table(all_results: Sequence[dict[str, Any]]) -> str:
    """README table: design x party view x inversion/templates/leakage, empirical epsilon."""
    lines = [
        "| design | DP | party view | direction attacked | inversion top-1 [95% CI] (chance) | "
        "KNN dist. (chance) | SSIM (chance) | templates top-1 | "
        "FC-update leakage top-1 (chance) | "
        "empirical eps >= (accountant) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for results in all_results:
        canary = results["attacks"].get("canary", {})
        acc = canary.get("accountant_epsilon")
        cap = " (audit cap)" if canary.get("at_audit_cap") else ""
        if canary.get("can_test_accountant") is False:  # no outcome could have passed it
            cap += f", cannot test: at most {canary['largest_bound_this_audit_can_show']:.2f}"
        eps = (
            f"{canary['epsilon_lower_bound']:.2f}{cap} ({'none' if acc is None else f'{acc:.2f}'})"
            if canary
            else "-"
        )
        privacy = (
            "none"
            if results["privacy_unit"] == "none"
            else (f"{results['privacy_unit']}, eps {results['epsilon']:.2f}")
        )
        for row in table_rows(results):
            party = row["party"]
            templates = row["templates_top1"]
            leak = results["attacks"].get("leakage", {}).get(party, {})
            if leak.get("single_client_one_image"):
                one = leak["single_client_one_image"]
                leaked = f"{one['top1']:.2f} ({one['chance']:.2f})"
            elif leak.get("applicable"):
                summed = leak["secure_sum_one_image_each"]
                leaked = f"sum only: {summed['participant_precision']:.2f} ({summed['chance']:.2f})"
            else:
                leaked = "no update seen"
            lines.append(
                f"| {results['algorithm']} ({results['exposure']}) | {privacy} | {party} | "
                f"{row['direction']} | {row['top1']:.2f}{_interval(row['top1_ci95'])} "
                f"({row['chance']:.2f}) | {row['knn_distance']:.3f}"
                f"{_versus(row['chance_knn_distance'])} | {row['ssim']:.3f}"
                f"{_versus(row['chance_ssim'])} | "
                f"{'-' if templates is None else f'{templates:.2f}'} | {leaked} | {eps} |"
            )
    return "\n".join(lines) + "\n"
