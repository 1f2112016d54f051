"""Centralized baseline: one model trained on the union of the clients' training images.

Its backbone is saved as ``backbone.safetensors`` in the run directory, so a centralized run
on public faces (a large synthetic set, or LFW) is also how a model is *pretrained* before
federated fine-tuning (``model.pretrained = ".../backbone.safetensors"``). With
``partition.kind = "domain"`` it is FedFR's source pre-training (FedFR Algorithm 1 lines 1-2):
only the labelled source client's images train ``f_s``; the target clients' labels are never
read, and the FedFR run that starts from ``f_s`` pseudo-labels them with it.

The reference the federated run is compared with ("at least 0.9x centralized training with the
same backbone and passes"): same backbone, head kind, optimiser settings and number of passes
over the data (rounds x local epochs), evaluated on the same held-out identities. With
``train.local_steps`` a federated round trains that many batches on *each* client, so a
centralized pass trains ``local_steps`` x (number of pooled clients) batches of the same size.

A pass whose model diverges (parameters or held-out embeddings not finite) aborts the run as
a diverged federated round does: ``metrics.jsonl`` ends with a ``"kind": "aborted"`` record,
``summary.json`` has ``status = "aborted"`` and the reason, and no backbone is saved.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from fl_secure.config import Config, config_to_toml
from fl_secure.data.plan import ClientShare, FederatedData, plan_federation
from fl_secure.data.types import FaceDataset
from fl_secure.errors import RoundAborted
from fl_secure.evaluation import DegenerateEmbeddings, per_client_summary
from fl_secure.models import save_weights
from fl_secure.runs import RunDir, atomic_write_bytes, new_run_dir
from fl_secure.training import (
    HEADLINE,
    LocalData,
    build_run_model,
    evaluate_local,
    evaluate_verification,
    held_out_features,
    local_training,
    make_optimizer,
    parameter_groups,
    round_learning_rate,
    train_local,
    with_trunk_features,
)


def _union(parts: list[FaceDataset]) -> FaceDataset:
    first = parts[0]
    return FaceDataset(
        images=torch.cat([p.images for p in parts]),
        labels=torch.cat([p.labels for p in parts]),
        identity_names=first.identity_names,
        attributes={k: np.concatenate([p.attributes[k] for p in parts]) for k in first.attributes},
        source=first.source,
    )


def train_centralized_model(
    config: Config,
    plan: FederatedData,
    *,
    progress: bool = False,
    on_pass: Callable[[int, dict[str, float]], None] | None = None,
) -> tuple[torch.nn.Module, list[dict[str, float]]]:
    """Train on the pooled client data; return the backbone and per-pass held-out metrics.

    ``on_pass(number, metrics)`` is called after each pass (1-based) with its held-out
    metrics.

    Raises:
        RoundAborted: a pass left parameters that are not finite, or held-out embeddings
            that are zero or not finite (training diverged).
    """
    torch.manual_seed(config.run.seed)
    labelled = pretraining_clients(config, plan)
    train = _union([c.train for c in labelled])
    test = _union([c.test for c in labelled])
    ids = np.unique(train.labels.numpy())
    model = build_run_model(config, len(ids))
    targets = torch.from_numpy(np.searchsorted(ids, train.labels.numpy()).astype(np.int64))
    data = LocalData(train=train, test=test, train_targets=targets, class_mask=None)
    data = with_trunk_features(model.backbone, data)  # train.trainable froze the trunk
    held_out = held_out_features(model.backbone, plan.held_out)
    training = local_training(config.train)
    if training.local_steps:  # a federated round: local_steps batches on every client
        training = dataclasses.replace(training, local_steps=training.local_steps * len(labelled))
    generator = torch.Generator().manual_seed(config.run.seed)
    history: list[dict[str, float]] = []
    optimizer = make_optimizer(parameter_groups(model, training), training)
    t = config.train
    for r in tqdm(range(1, t.rounds + 1), desc="rounds", disable=None if progress else True):
        lr = round_learning_rate(t.lr, r, t.rounds, t.lr_schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        # the same number of passes over the data as a federated round
        train_local(model, data, training, generator=generator, optimizer=optimizer)
        bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
        if bad:
            raise RoundAborted(
                f"pass {r}: the model has non-finite values in {bad[:5]}"
                f"{' ...' if len(bad) > 5 else ''} (training diverged: lower train.lr)"
            )
        with _diverged(f"pass {r}: the model's held-out embeddings"):
            metrics = evaluate_verification(model.backbone, held_out) if len(held_out) else {}
        history.append(metrics)
        if on_pass is not None:
            on_pass(r, metrics)
    return model.backbone, history


@contextmanager
def _diverged(what: str, remedy: str = "training diverged: lower train.lr") -> Iterator[None]:
    """Score a model: embeddings that are zero or not finite abort the run (RoundAborted)."""
    try:
        yield
    except DegenerateEmbeddings as exc:
        raise RoundAborted(f"{what}: {exc} ({remedy})") from exc


def pretraining_clients(config: Config, plan: FederatedData) -> list[ClientShare]:
    """Whose labelled images a centralized run pools.

    Every client's; for a FedFR domain federation the source client's alone (its targets have
    no labels to use).
    """
    return list(plan.clients[:1]) if config.partition.kind == "domain" else list(plan.clients)


def per_client_scores(
    backbone: torch.nn.Module, plan: FederatedData
) -> dict[str, dict[str, float]]:
    """Each client's test images scored by ``backbone``, as a federated client would."""
    scores = {}
    for k, share in enumerate(plan.clients):
        local = LocalData(
            train=share.train,
            test=share.test,
            train_targets=torch.zeros(len(share.train), dtype=torch.int64),
            class_mask=None,
        )
        scores[f"client-{k}"] = evaluate_local(backbone, local)
    return scores


def run_centralized(
    config: Config, *, out: Path | None = None, progress: bool = True
) -> dict[str, Any]:
    """Train the centralized baseline into a run directory; return its summary.

    Raises:
        RoundAborted: training diverged (see :func:`train_centralized_model`), or the
            initial model's embeddings are degenerate; the run directory records the run as
            aborted (``summary.json``, ``metrics.jsonl``) first.
    """
    started = time.time()
    plan = plan_federation(config)  # a bad data.path is named before a run directory exists
    run = RunDir(new_run_dir(out or Path("runs"), f"{config.run.name}-centralized"))
    atomic_write_bytes(run.config, config_to_toml(config).encode())
    history: list[dict[str, float]] = []
    untrained: dict[str, float] = {}
    untrained_clients: dict[str, dict[str, float]] = {}
    scored_untrained = False

    def on_pass(number: int, metrics: dict[str, float]) -> None:
        history.append(metrics)
        run.append_metrics({"round": number, "held_out": metrics})

    try:
        fresh = build_run_model(config, 1).backbone
        with _diverged("the initial model's embeddings", "check model.*; no pass ran"):
            untrained = evaluate_verification(fresh, plan.held_out) if len(plan.held_out) else {}
            untrained_clients = per_client_scores(fresh, plan)
        run.append_metrics({"round": 0, "held_out": untrained, "clients": untrained_clients})
        scored_untrained = True
        backbone, _ = train_centralized_model(config, plan, progress=progress, on_pass=on_pass)
        with _diverged("the final model on the clients' test images"):
            clients = per_client_scores(backbone, plan)
    except RoundAborted as exc:  # as a diverged federated run: recorded, then reported
        number = len(history) + 1 if scored_untrained else 0
        run.append_metrics({"kind": "aborted", "round": number, "reason": str(exc)})
        last = history[-1] if history else {}
        run.write_summary({
            "status": "aborted",
            "reason": str(exc),
            "algorithm": "centralized",
            "rounds_completed": len(history),
            "rounds_planned": config.train.rounds,
            **{k: last[k] for k in HEADLINE if k in last},
            "held_out": last,
            "untrained": untrained,
            "untrained_clients_summary": (
                per_client_summary(untrained_clients) if untrained_clients else {}
            ),
            "backbone": None,  # a diverged model is not saved
            "duration_s": round(time.time() - started, 1),
            "run_dir": str(run.path),
        })  # fmt: skip
        raise RoundAborted(f"{exc}; the run is recorded as aborted in {run.path}") from exc
    save_weights(backbone, run.path / "backbone.safetensors")
    final = history[-1]
    summary: dict[str, Any] = {
        "status": "completed",
        "reason": f"{config.train.rounds} rounds' passes completed",
        "algorithm": "centralized",
        **{k: final[k] for k in HEADLINE if k in final},
        "held_out": final,
        "untrained": untrained,
        "untrained_clients_summary": per_client_summary(untrained_clients),
        "clients": clients,
        "clients_summary": per_client_summary(clients),
        "backbone": str(run.path / "backbone.safetensors"),
        "duration_s": round(time.time() - started, 1),
        "run_dir": str(run.path),
    }
    run.write_summary(summary)
    return summary
