"""Face features recovered from rebuilt client updates and from their secure sum.

The backbone's embedding layer is fully connected, so each row of its weight update divided
by the matching bias update is that layer's input -- a face's penultimate features -- when
one image produced it (Phong et al. 2018; Geiping et al. 2020; :mod:`audits.leakage`); a
layer without bias (dlib's) gives the input up to scale in every row of its weight update.
The audit rebuilds each client's update as one local gradient step from the final global
model, with the client-level DP clipping and noise the run's clients apply, and attacks it
alone (a party that sees each client's update) and summed over the clients (what the server
sees under secure aggregation): which identities took part, named from the sum's row ratios
or from its span.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from audits.attacks.features import penultimate
from audits.canary import clopper_pearson_interval
from audits.leakage import (
    RecoveredInputs,
    identify,
    participant_precision,
    recover_fc_inputs,
    recover_fc_inputs_without_bias,
    span_membership,
)
from audits.observations import RunContext, View
from fl_secure.training import FaceModel, build_run_model, set_tensors
from privacy.dp.client_level import add_gaussian, client_noise_std
from privacy.dp.noise import SeededGaussian


def _client_model(run: RunContext, k: int) -> tuple[FaceModel, str]:
    """Client ``k``'s model at the final checkpoint, and where its head came from."""
    share = run.plan.clients[k]
    classes = run.strategy.num_head_classes(
        len(run.plan.train_identities), np.unique(share.train.labels.numpy())
    )
    cfg = run.config
    model = build_run_model(cfg, classes)
    set_tensors(model, run.checkpoint.parameters)
    if run.strategy.shares_head:
        return model, "the global head"
    heads = run.checkpoint.client_tensors.get(run.client_ids[k])
    if heads:
        set_tensors(model, type(run.checkpoint.parameters)(heads.items()))
        return model, "the server's copy of the client's head"
    private = run.path / "clients" / run.client_ids[k] / "private.safetensors"
    if private.exists():
        model.load_state_dict(load_file(str(private)), strict=False)
        return model, "the client's private head (clients/<id>/private.safetensors)"
    return model, "a freshly initialised head (the client's private head is not in the run dir)"


def _fc_update(
    run: RunContext, k: int, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, float, str]:
    """One local gradient step of client ``k`` on the given training images.

    Returns the embedding layer's weight and bias update (None: a layer without bias, such
    as dlib's), the norm of the whole shared update, and where the client's head came from.
    The step runs from pixels through the whole backbone (a frozen trunk takes no step).
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
    if layer.weight.grad is None:
        raise ValueError(
            "the backbone's embedding layer took no gradient: train.trainable froze it, so "
            "the clients' updates do not contain it and the leakage attack has nothing to read"
        )
    bias = None if layer.bias is None or layer.bias.grad is None else -lr * layer.bias.grad
    return -lr * layer.weight.grad, bias, math.sqrt(total), head_source


def _privatise(
    run: RunContext, dw: torch.Tensor, db: torch.Tensor | None, norm: float, party: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    dw = dw * factor
    db = None if db is None else db * factor
    std = client_noise_std(p.noise_placement, z, c, run.config.server.min_clients)
    if std > 0:
        source = SeededGaussian(int(hashlib.sha256(party.encode()).hexdigest()[:8], 16))
        parts = {"w": dw.numpy(), **({} if db is None else {"b": db.numpy()})}
        noisy = add_gaussian(parts, std, source)
        dw = torch.from_numpy(noisy["w"])
        db = None if db is None else torch.from_numpy(noisy["b"])
    return dw, db


def _recover(dw: torch.Tensor, db: torch.Tensor | None) -> RecoveredInputs:
    """Row ratios ``dW[i] / db[i]``; for a layer without bias, the sign-fixed rows of ``dW``."""
    return recover_fc_inputs_without_bias(dw) if db is None else recover_fc_inputs(dw, db)


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


def leakage_attack(run: RunContext, view: View, *, seed: int) -> dict[str, Any]:
    """What the view's client updates (or their sum) give away of the clients' faces.

    Args:
        run: the audited run.
        view: the party's view: each client's update, only their sum, or none.
        seed: which training images each client's rebuilt update is made of.

    Returns:
        ``applicable`` False and why (no update seen; example-level DP), or per update
        attacked: how exactly the inputs were recovered and identified, and how well the
        participants are named from the sum, each beside chance.
    """
    if view.updates == "none":
        return {"applicable": False, "why": "this party receives no client's update"}
    if run.privacy_unit in ("example", "identity"):
        return {
            "applicable": False,
            "why": f"{run.privacy_unit}-level DP (DP-SGD): a rebuilt update would carry none of "
            f"the run's per-{run.privacy_unit} clipping and noise, so it would measure another "
            "mechanism",
        }
    backbone = run.model.backbone
    test = [c.test for c in run.plan.clients]
    gallery_images = torch.cat([t.images for t in test])
    gallery_labels = torch.cat([t.labels for t in test])
    gallery = penultimate(backbone, gallery_images)
    identities = int(torch.unique(gallery_labels).numel())
    batch = min(run.config.train.batch_size, *(len(c.train) for c in run.plan.clients))
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {
        "applicable": True,
        "layer": "backbone.embedding (fully connected, with bias): inputs = penultimate features"
        if getattr(backbone.embedding, "bias", None) is not None
        else "backbone.embedding (fully connected, no bias): inputs = penultimate features, "
        "recovered up to scale from the rows of dW (sign: the pooled features are >= 0)",
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
        single_truth.append(penultimate(backbone, run.plan.clients[k].train.images[one]))
        if view.updates == "each client's update":
            rec = _recover(dw, db)
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
        batch_truth.append(penultimate(backbone, run.plan.clients[k].train.images[idx]))
        if view.updates == "each client's update":
            participants = torch.unique(run.plan.clients[k].train.labels[idx])
            rec = _recover(dw, db)
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
        biases = [u[1] for u in parts if u[1] is not None]
        total_b = torch.stack(biases).sum(0) if biases else None
        everyone = torch.unique(torch.cat(ids))
        inputs = torch.cat(truths)
        rec = _recover(total_w, total_b)
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
