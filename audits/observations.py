"""What each party of a run saw, by design and setting: the views the audit attacks.

A run directory (:mod:`fl_secure.runs`) records the design (``summary.json``: ``algorithm``,
``exposure``, ``secure_aggregation``, privacy) and the released models (``checkpoints/``).
From them :func:`observations` builds, for the two adversaries of the threat model:

* **server** (honest-but-curious: follows the protocol, keeps everything it receives) -- the
  global model of every round; under ``server-sees-heads`` (FedGC/FedCos) the class embeddings
  every client uploads (the checkpoint's ``clients-%06d.safetensors``); under ``global-head``
  the head is part of the global model. Without secure aggregation it also receives each
  client's update: those are not stored in the run directory, so the leakage attack runs on a
  rebuilt single-client update (one local gradient step of a client on its data from the
  final checkpoint). Under secure aggregation (SecAgg+, or CKKS with honest clients) it sees
  only the sum.
* **curious client** (a participant that keeps what the server sends it) -- the global model;
  with the head of every site's identities under ``global-head``; under the other designs only
  its own class embeddings, which say nothing of the other sites' identities it would attack.

Each view names its *target directions*: the class embedding (head row) of each target
identity the view holds, or none, in which case the attacker falls back on a surrogate
(:mod:`audits.inversion`). The audit attacks exactly these views, nothing more.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from fl_secure.algorithms import Strategy, get_strategy
from fl_secure.checkpoints import Checkpoint, CheckpointStore
from fl_secure.config import Config, load_config
from fl_secure.data.plan import FederatedData, plan_client_id, plan_federation
from fl_secure.errors import CheckpointError, ConfigError
from fl_secure.models.pretrained import check_pretrained_unchanged
from fl_secure.runs import RunDir
from fl_secure.training import FaceModel, build_run_model, load_checkpoint_into

Party = Literal["server", "curious_client"]
UpdateAccess = Literal["each client's update", "only the sum", "none"]

CURIOUS_CLIENT = 0
"""Index of the client playing the curious participant; targets come from the other clients."""


@dataclass(frozen=True)
class RunContext:
    """A run directory loaded for auditing: config, plan, final global model, server state."""

    path: Path
    config: Config
    summary: dict[str, Any]
    strategy: Strategy
    plan: FederatedData
    checkpoint: Checkpoint
    model: FaceModel  # the final global model; head = global head (global-head designs only)
    client_ids: list[str]

    @property
    def exposure(self) -> str:
        """``global-head``, ``server-sees-heads`` or ``private-embedding``."""
        return str(self.summary.get("exposure") or self.strategy.exposure)

    @property
    def secure_aggregation(self) -> str:
        """Scheme name, ``"none"`` without secure aggregation."""
        sa = self.summary.get("secure_aggregation") or {}
        return str(sa.get("scheme", self.config.secure_aggregation.scheme))

    @property
    def privacy_unit(self) -> str:
        """``none``, ``client`` or ``example``."""
        return str(self.summary.get("privacy_unit") or self.config.privacy.unit)

    def client_identities(self, index: int) -> np.ndarray:
        """Sorted identity labels of client ``index``'s training images."""
        return np.unique(self.plan.clients[index].train.labels.numpy())

    def owner(self, identity: int) -> int:
        """Index of the (first) client whose training images include ``identity``."""
        for k in range(len(self.plan.clients)):
            if identity in set(self.client_identities(k).tolist()):
                return k
        raise KeyError(f"identity {identity} is held by no client")


#: Algorithms the audit cannot attack faithfully yet, and why (named in the error).
UNAUDITED = {
    "fedaffect": "its shared model is an expression encoder plus a relation module, with no "
    "identity head, and its local objective (episodes + NT-Xent) is not the identity "
    "classification the update-leakage rebuild replays",
}


def check_auditable(algorithm: str) -> None:
    """Refuse, naming why, an algorithm whose runs the audit cannot attack.

    Raises:
        ConfigError: for the algorithms in :data:`UNAUDITED`.
    """
    if algorithm in UNAUDITED:
        raise ConfigError(
            f"fl-secure audit does not support algorithm.name = {algorithm!r} runs: "
            f"{UNAUDITED[algorithm]}"
        )


def load_run(path: Path) -> RunContext:
    """Read a run directory: config, summary, data plan, latest checkpoint, global model.

    Raises:
        CheckpointError: if the folder is not a completed run directory with a checkpoint.
        ConfigError: if the run's algorithm is one the audit cannot attack (UNAUDITED).
    """
    run = RunDir(Path(path))
    if not run.config.exists():
        raise CheckpointError(f"{path} is not a run directory (no config.toml)")
    config = load_config(run.config)
    check_auditable(config.algorithm.name)
    if not run.summary.exists():
        raise CheckpointError(f"{path} has no summary.json: audit a finished run")
    summary = run.read_summary()
    checkpoint = CheckpointStore(run.checkpoints).latest()
    if checkpoint is None:
        raise CheckpointError(f"{path} has no checkpoint")
    if config.train.trainable != "all":  # the frozen layers come from the pretrained file
        recorded = (summary.get("provenance") or {}).get("pretrained")
        check_pretrained_unchanged(config.model.pretrained, recorded, what=f"the run {path}")
    strategy = get_strategy(
        config.algorithm.name, config.algorithm, head=config.model.head, scale=config.model.scale
    )
    plan = plan_federation(config)
    classes = len(plan.train_identities) if strategy.shares_head else 1
    model = build_run_model(config, classes)
    load_checkpoint_into(
        model,
        checkpoint.parameters,
        source=f"the checkpoint of round {checkpoint.round} in {run.checkpoints}",
        required="backbone.",
    )
    model.eval()
    client_ids = _plan_client_ids(summary, len(plan.clients), path)
    unknown = sorted(set(checkpoint.client_tensors) - set(client_ids))
    if unknown:
        raise CheckpointError(
            f"{path}: the checkpoint holds the heads of clients {unknown}, which the run's "
            f"summary.json does not pair with a share of the plan ({client_ids}); the audit "
            "cannot tell whose identities their rows are"
        )
    return RunContext(
        path=Path(path),
        config=config,
        summary=summary,
        strategy=strategy,
        plan=plan,
        checkpoint=checkpoint,
        model=model,
        client_ids=client_ids,
    )


def _plan_client_ids(summary: Mapping[str, Any], shares: int, path: Path) -> list[str]:
    """Client id of each share of the plan: ``summary.json``'s ``client_plan``.

    Runs written before it was recorded name their clients :func:`plan_client_id` when they
    trained on the plan (they state ``client_train_sizes``).

    Raises:
        CheckpointError: the run does not say which client trained on which share (a
            standalone ``fl-secure server``, whose sites name themselves and may hold their
            own data), or the pairing does not cover the plan's shares.
    """
    pairing = summary.get("client_plan")
    if pairing is None:
        if summary.get("client_train_sizes") is None:
            raise CheckpointError(
                f"{path}: the run does not record which client trained on which share of the "
                "config's data plan (a standalone fl-secure server: its sites name themselves "
                "and may hold their own data), and the audit needs the targets' owners; audit "
                "an embedded run (fl-secure train) or a simulation"
            )
        return [plan_client_id(k) for k in range(shares)]
    if not isinstance(pairing, dict) or sorted(pairing.values()) != list(range(shares)):
        raise CheckpointError(
            f"{path}: summary.json's client_plan {pairing!r} does not pair one client with "
            f"each of the plan's {shares} shares"
        )
    by_share = {int(k): str(c) for c, k in pairing.items()}
    return [by_share[k] for k in range(shares)]


@dataclass(frozen=True)
class View:
    """What one party saw, and so what the audit may use when it plays that party.

    Attributes:
        party: ``server`` or ``curious_client``.
        holder: the party's name (``server`` or the client id).
        sees: human-readable list of what the party received during training.
        head_rows: target identity -> the class embedding of it this view holds.
        head_source: where those rows come from (or why there are none).
        updates: access to individual clients' updates.
        inversion_key: views with the same key hold the same backbone and rows (attacked once).
    """

    party: Party
    holder: str
    sees: list[str]
    head_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    head_source: str = "none"
    updates: UpdateAccess = "none"
    inversion_key: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON form (rows summarised by count)."""
        return {
            "party": self.party,
            "holder": self.holder,
            "sees": self.sees,
            "head_rows_of_targets": len(self.head_rows),
            "head_source": self.head_source,
            "individual_updates": self.updates,
        }


def _global_rows(run: RunContext, targets: list[int]) -> dict[int, torch.Tensor]:
    weight = run.model.head.weight.detach()
    index = np.searchsorted(run.plan.train_identities, targets)
    return {t: weight[int(i)].clone() for t, i in zip(targets, index, strict=True)}


def held_heads(run: RunContext) -> list[int]:
    """Shares whose client's head the server holds at the final checkpoint (FedGC).

    A client never sampled (Poisson cohorts) uploaded none.

    Raises:
        CheckpointError: a held head's rows do not match its client's identities.
    """
    held = []
    for k, cid in enumerate(run.client_ids):
        weight = head_weight(run.checkpoint.client_tensors.get(cid, {}))
        if weight is None:
            continue
        own = len(run.client_identities(k))
        if weight.shape[0] != own:
            raise CheckpointError(
                f"{run.path}: the server's copy of {cid}'s head has {weight.shape[0]} rows, "
                f"but {cid} trained on share {k} of the plan, with {own} identities"
            )
        held.append(k)
    return held


def _server_held_rows(run: RunContext, targets: list[int]) -> dict[int, torch.Tensor]:
    """FedGC: the server's copy of each target's owner's head row (local index of its class).

    :func:`choose_targets` draws the targets from the clients whose heads the server holds.
    """
    rows: dict[int, torch.Tensor] = {}
    heads = run.checkpoint.client_tensors
    for t in targets:
        k = run.owner(t)
        weight = head_weight(heads.get(run.client_ids[k], {}))
        if weight is None:
            raise CheckpointError(
                f"{run.path}: target identity {t} belongs to {run.client_ids[k]}, whose head "
                "the server does not hold"
            )
        local = int(np.searchsorted(run.client_identities(k), t))
        rows[t] = torch.from_numpy(np.array(weight[local], copy=True))
    return rows


def threat_model(run: RunContext) -> dict[str, str]:
    """The adversaries and what the audit grants them, in words (for ``results.json``)."""
    return {
        "server": "honest-but-curious: runs the protocol as specified and keeps every message "
        "it receives; no extra queries, no tampering with the model it sends",
        "curious_client": f"{run.client_ids[CURIOUS_CLIENT]}, a participant that keeps every "
        "model the server sends it; it attacks the other sites' identities",
        "attacker_data": "no image of a target; public faces for a prior (see attacker_prior)",
        "collusion": "none (server and clients do not pool their views)",
        "scope": "the audit attacks exactly the views listed under 'views', from the final "
        "checkpoint; earlier rounds' models are not attacked",
    }


#: The layer the update-leakage attack reads (weight and bias of the embedding layer).
LEAKAGE_LAYER = ("backbone.embedding.weight", "backbone.embedding.bias")


def ckks_encrypted_layers(summary: Mapping[str, Any]) -> list[str] | None:
    """The layer prefixes a CKKS run encrypted (``ckks_layers``); None: every shared layer.

    Read from ``summary.json``'s ``secure_aggregation.encrypted_layers`` (``"all"``, or the
    run's ``secure_aggregation.ckks_layers``); a summary without it encrypted every layer.
    """
    sa = summary.get("secure_aggregation") or {}
    layers = sa.get("encrypted_layers", "all")
    return None if layers == "all" else [str(p) for p in layers]


def _clear_under_ckks(run: RunContext) -> list[str]:
    """The attacked layer's tensors a CKKS run sent in the clear (``ckks_layers`` subset)."""
    if run.secure_aggregation != "ckks":
        return []
    layers = ckks_encrypted_layers(run.summary)
    if layers is None:
        return []
    return [n for n in LEAKAGE_LAYER if not any(n.startswith(p) for p in layers)]


def observations(run: RunContext, targets: list[int]) -> list[View]:
    """The server's and a curious client's view of ``targets`` under the run's design."""
    exposure = run.exposure
    clear = _clear_under_ckks(run)
    secagg = run.secure_aggregation != "none" and not clear
    rounds = f"the global model of each round (final: round {run.checkpoint.round})"
    updates: UpdateAccess = "only the sum" if secagg else "each client's update"
    if secagg:
        update_text = f"only the sum of the clients' updates ({run.secure_aggregation})"
    elif clear:
        update_text = (
            f"each client's update of the layers CKKS left in the clear ({', '.join(clear)} "
            "among them; secure_aggregation.ckks_layers encrypts a subset): seen, not "
            "recorded in the run directory; the leakage attack runs on a rebuilt "
            "single-client update"
        )
    else:
        update_text = (
            "each client's update of the shared parameters: seen, not recorded in the run "
            "directory; the leakage attack runs on a rebuilt single-client update"
        )
    if run.privacy_unit == "client":
        update_text += f"; client-level DP, noise placement {run.summary.get('noise_placement')}"
    curious = run.client_ids[CURIOUS_CLIENT]
    if exposure == "global-head":
        rows = _global_rows(run, targets)
        source = "global head row of the target (shared with every party)"
        return [
            View(
                "server",
                "server",
                [rounds + ", head included", update_text],
                rows,
                source,
                updates,
                "global",
            ),
            View(
                "curious_client",
                curious,
                [rounds + ", head included"],
                rows,
                source,
                "none",
                "global",
            ),
        ]
    if exposure == "server-sees-heads":
        rows = _server_held_rows(run, targets)
        return [
            View(
                "server",
                "server",
                [
                    rounds + " (backbone)",
                    update_text,
                    "every client's class embeddings (uploaded with its update)",
                ],
                rows,
                "the server's copy of the owning client's head row",
                updates,
                "server-heads",
            ),
            View(
                "curious_client",
                curious,
                [rounds + " (backbone)", "its own class embeddings only"],
                {},
                "none: the targets' rows never reach another client",
                "none",
                "backbone",
            ),
        ]
    return [
        View(
            "server",
            "server",
            [rounds + " (backbone)", update_text],
            {},
            "none: class embeddings never leave their site",
            updates,
            "backbone",
        ),
        View(
            "curious_client",
            curious,
            [rounds + " (backbone)", "its own class embeddings only"],
            {},
            "none: class embeddings never leave their site",
            "none",
            "backbone",
        ),
    ]


def choose_targets(run: RunContext, count: int) -> list[int]:
    """``count`` training identities of the clients other than the curious one, round-robin.

    Deterministic: client by client in turn, each client's identities in sorted order, so the
    targets spread over the sites. Identities the curious client also holds are skipped, and
    so is an identity already chosen from another site (an attribute partition splits an
    identity's images over the clients whose predicates they match): each target is one
    label of the judge and the gallery (:func:`audits.targets.target_data`). In a
    ``server-sees-heads`` run only the clients whose heads the server holds are drawn from
    (:func:`held_heads`): every target then has its row in the server's view.
    """
    own = set(run.client_identities(CURIOUS_CLIENT).tolist())
    sites = list(range(len(run.plan.clients)))
    if run.exposure == "server-sees-heads":
        sites = held_heads(run)
    pools = [
        [int(i) for i in run.client_identities(k) if int(i) not in own]
        for k in sites
        if k != CURIOUS_CLIENT
    ]
    chosen: list[int] = []
    taken: set[int] = set()
    depth = 0
    while len(chosen) < count and any(depth < len(p) for p in pools):
        for pool in pools:
            if depth < len(pool) and len(chosen) < count and pool[depth] not in taken:
                chosen.append(pool[depth])
                taken.add(pool[depth])
        depth += 1
    if len(chosen) < 2:
        held = "" if run.exposure != "server-sees-heads" else " whose heads the server holds"
        raise CheckpointError(
            f"the audit needs at least 2 target identities outside client 0{held}"
        )
    return sorted(chosen)


def head_weight(tensors: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """The class-embedding matrix among a client's ``head.*`` tensors (None if absent)."""
    for key in ("head.weight", "head.classifier.weight"):
        if key in tensors:
            return tensors[key]
    return None
