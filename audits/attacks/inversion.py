"""Model inversion of the targets from one party's view, judged by an independent evaluator.

The attacker reconstructs each target from the view's class embedding of it (global head row;
FedGC: the server's copy of the owner's head row), or, where the view holds none, from the
best surrogates -- the mean embedding of public faces and a random direction -- with
DeepInversion and a PCA face prior from public faces (:mod:`audits.inversion`). The judge's
evaluator, trained on the targets' own training images, scores the reconstructions
(:mod:`audits.judge`).

Public faces (the attacker's prior and surrogate): by default the run's held-out identities'
images, which no client trains on; ``--public`` folders replace them (e.g. LFW for a run on
ORL).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from audits.grids import save_grid
from audits.inversion import (
    FacePrior,
    InversionConfig,
    invert,
    mean_embedding_target,
    random_direction_target,
)
from audits.judge import Evaluator, EvaluatorConfig, judge, train_evaluator
from audits.observations import RunContext, View
from audits.targets import Targets
from fl_secure.data.folders import load_identity_folders
from fl_secure.errors import ConfigError

_EVALUATORS: dict[str, Evaluator] = {}

MAX_PRIOR_FACES = 1000
"""Public faces the PCA prior is fitted on at most (a seeded random subset of more): its 64
components need no more, and the SVD of N 150-px faces holds 2 x N x 67,500 doubles (1 GB
for N = 1000)."""


def cached_evaluator(images: torch.Tensor, labels: torch.Tensor, cfg: EvaluatorConfig) -> Evaluator:
    """:func:`train_evaluator`, memoised in this process by the data and settings."""
    digest = hashlib.sha256(images.numpy().tobytes())
    digest.update(labels.numpy().tobytes())
    digest.update(repr(cfg).encode())
    key = digest.hexdigest()
    if key not in _EVALUATORS:
        _EVALUATORS[key] = train_evaluator(images, labels, config=cfg)
    return _EVALUATORS[key]


def public_faces(
    run: RunContext,
    public_dir: Path | None,
    center_crop: int,
    *,
    max_faces: int = MAX_PRIOR_FACES,
    seed: int = 0,
) -> tuple[torch.Tensor, str]:
    """The attacker's public faces (at most ``max_faces``) and a sentence saying what they are.

    Args:
        run: the audited run (its held-out identities stand in when ``public_dir`` is None).
        public_dir: identity folders of public faces (``--public``), or None.
        center_crop: centre crop of the public faces before resizing; 0: none.
        max_faces: more faces than this are cut to a random subset of this many (``seed``),
            and the sentence says so.
        seed: draws that subset.

    Raises:
        ConfigError: fewer than 2 faces, in the ``--public`` folders or among the run's
            held-out identities (which then needs ``--public``).
    """
    size = run.config.data.image_size
    if public_dir is not None:
        data = load_identity_folders(public_dir, image_size=size, center_crop=center_crop or None)
        if len(data) < 2:  # the prior is a PCA of the faces: one face spans no direction
            raise ConfigError(
                f"--public {public_dir} holds {len(data)} face image(s): the "
                "attacker's prior (a PCA face space) needs at least 2"
            )
        return _at_most(data.images, max_faces, seed, (
            f"{len(data)} public face images of {data.num_identities} identities from "
            f"{public_dir.name} (identity folders given with --public), none of them "
            "a participant"
        ))  # fmt: skip
    held = run.plan.held_out
    if len(held) < 2:
        raise ConfigError("the run has no held-out identities: give public faces with --public")
    return _at_most(held.images, max_faces, seed, (
        f"{len(held)} images of the run's {len(held.identities())} held-out identities, which "
        "no client trains on (a stand-in for public faces of the same population)"
    ))  # fmt: skip


def _at_most(images: torch.Tensor, limit: int, seed: int, text: str) -> tuple[torch.Tensor, str]:
    """``images`` cut to a seeded random ``limit`` of them, with ``text`` saying so."""
    if len(images) <= limit:
        return images, text
    keep = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))[:limit]
    side = images.shape[-1]
    return images[keep.sort().values], (
        f"{text}; a random {limit} of them ({side}-px faces: the prior's PCA is limited to "
        f"{limit} faces to bound its memory and time on a CPU)"
    )


def attacker_prior(
    public_text: str, components: int, from_real_faces: bool, backbone: torch.nn.Module
) -> dict[str, Any]:
    """``results.json``'s ``attacker_prior``: the public faces and the prior fitted on them."""
    return {
        "public_faces": public_text,
        "from_real_faces": from_real_faces,  # --public folders: grids only with --include-images
        "prior": f"PCA face space of the public faces ({components} components), "
        "Gaussian penalty on the whitened coefficients; BatchNorm statistics where the "
        f"backbone has BatchNorm (this backbone: {_norm_text(backbone)})",
    }


def _has_bn(module: torch.nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in module.modules())


def _norm_text(backbone: torch.nn.Module) -> str:
    """Whether the prior can use BatchNorm statistics, and what normalises the backbone if not."""
    if _has_bn(backbone):
        return "yes"
    if any(isinstance(m, torch.nn.GroupNorm) for m in backbone.modules()):
        return "no, GroupNorm"
    return "no: no BatchNorm layer holds running statistics (e.g. norms folded into affine layers)"


def _grid(out: Path, name: str, tg: Targets, recon: torch.Tensor, allowed: bool) -> str | None:
    if not allowed:
        return None
    real = [tg.private.images[tg.private.labels == i][:3] for i in range(len(tg.identities))]
    save_grid(out / name, real, [r.unsqueeze(0) for r in recon])
    return name


def inversion_attack(
    run: RunContext,
    view: View,
    tg: Targets,
    evaluator: Evaluator,
    prior: FacePrior,
    public: torch.Tensor,
    cfg: InversionConfig,
    out: Path,
    grids: bool,
    on_step: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Invert every target from the view's head rows (or surrogates) and judge the faces.

    Args:
        run: the audited run.
        view: the party's view (:func:`audits.observations.observations`).
        tg: the targets and the judge's images of them.
        evaluator: the judge (:func:`cached_evaluator` on the targets' training images).
        prior: the attacker's face prior, fitted on ``public``.
        public: the attacker's public faces.
        cfg: the inversion's settings (its seed also draws the random surrogate).
        out: the audit folder, where grids are written.
        grids: whether to write a PNG grid of each direction's reconstructions.
        on_step: called after each optimisation step with where the attack stands
            (``"inversion, server, head_row 120/200"``), for a progress bar.

    Returns:
        Each direction's judged scores, and the name of the best (by top-1).
    """
    backbone = run.model.backbone
    size = run.config.data.image_size
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
        gen = torch.Generator().manual_seed(cfg.seed)
        directions["surrogate_random"] = (
            random_direction_target(dim, len(tg.identities), generator=gen),
            "surrogate: a random unit direction per target (the view holds no row)",
        )
    results: dict[str, Any] = {}
    for name, (direction, text) in directions.items():
        started = time.perf_counter()

        def step(done: int, name: str = name) -> None:
            if on_step is not None:
                on_step(f"inversion, {view.party}, {name} {done}/{cfg.steps}")

        attack = invert(
            backbone, direction, image_size=size, config=cfg, face_prior=prior, on_step=step
        )
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
            "iterations_per_second": cfg.steps
            * cfg.restarts
            * len(tg.identities)
            / max(seconds, 1e-9),
            **({"grid": grid} if grid else {}),
        }
    best = max(results, key=lambda k: results[k]["top1"])
    return {"attacked_view": view.holder, "best": best, **results}
