"""FedAffect vs supervised FedAvg on the same few expression labels, and the no-unlabelled ablation.

Synthetic faces (:mod:`fl_secure.data.synthetic`) with ``data.expression_strength`` (default
2.5 here: at the generator's default 1.0 even a centrally trained supervised classifier on
1,200 expression labels stays near the majority class), the 5 expressions as labels. The run
config's data plan spreads the training identities over the clients and holds identities out;
each client labels ``--labels-per-class`` of its training images per expression (evenly spread
through them) and keeps the others unlabelled (:meth:`FedAffect.local_data`). The held-out
identities give the test: ``--labels-per-class`` support images per expression (the few-shot
support set; FedAffect's prototypes) and every other image as a query.

Every method starts from the same encoder initialisation and sees the same labels:

* ``fedaffect``: the ``fedaffect`` strategy through the client path of the gRPC runs
  (``build_local_trainer`` -> ``LocalTrainer.train``; example-count-weighted mean and the
  strategy's server step, as the coordinator does; no transport, no DP) -- Algorithm 1 of the
  FedAffect slides; accuracy of the relation scores against the support prototypes;
* ``fedaffect-no-unlabelled``: the same with ``algorithm.use_unlabelled = false`` (no
  ``LocalReprLearn``: the ablation), same ``D_k`` weights;
* ``fedavg``: supervised FedAvg, encoder + linear 5-way classifier, cross-entropy on the
  labelled images only, as many local steps as FedAffect's episodes, averaged weighted by the
  labelled count; accuracy of its classifier, and of nearest-prototype (cosine) on its
  embeddings with the same support set.

``--central-check`` instead measures whether the expressions are learnable at all: a centrally
trained supervised classifier (the same encoder + a linear head, 400 Adam steps of 64 images)
on 60 identities x 20 images, *every* image expression-labelled, tested on 20 held-out
identities, at expression strength 1.0 and ``--expression-strength``.

Prints one JSON object (``--out`` also writes it). Run on 2 cores, torch pinned to 1 thread::

    python benchmarks/fedaffect.py [--rounds 30] [--seeds 0 1 2] [--out FILE]
    python benchmarks/fedaffect.py --central-check
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from client.trainer import LocalTrainer
from client.trainer_factory import build_local_trainer
from fl_secure.aggregation import StreamingMean
from fl_secure.algorithms.fedaffect import (
    NUM_EXPRESSIONS,
    HeldOut,
    build_fedaffect_model,
    client_data,
    held_out_expression_split,
    make_expression_evaluator,
)
from fl_secure.algorithms.fedaffect_rounds import weighted_average
from fl_secure.config import Config, config_from_dict
from fl_secure.data.plan import FederatedData, plan_federation
from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces
from fl_secure.messages import TensorSpec
from fl_secure.models.factory import get_backbone
from fl_secure.training import get_tensors, local_training

C = NUM_EXPRESSIONS


def make_config(args: argparse.Namespace, seed: int, use_unlabelled: bool) -> Config:
    """The run config of one seed (the ablation flips ``algorithm.use_unlabelled``)."""
    return config_from_dict(
        {
            "run": {"name": "fedaffect", "seed": seed},
            "data": {
                "image_size": args.image_size,
                "num_identities": args.clients * args.ids_per_client + args.test_ids,
                "images_per_identity": args.images_per_identity,
                "held_out_identities": args.test_ids,
                "expression_strength": args.expression_strength,
            },
            "partition": {"num_clients": args.clients},
            "model": {"backbone": "cnn-small", "embedding_size": args.embedding_size},
            "algorithm": {
                "name": "fedaffect",
                "labels_per_class": args.labels_per_class,
                "n_way": C,
                "k_shot": args.k_shot,
                "n_query": args.labels_per_class - args.k_shot,
                "nt_xent_tau": args.tau,
                "use_unlabelled": use_unlabelled,
            },
            "train": {
                "rounds": args.rounds,
                "local_steps": args.local_steps,
                "batch_size": args.batch_size,
                "optimizer": "adam",
                "lr": args.lr,
            },
            "server": {"min_clients": args.clients},
        }
    )


def make_trainers(config: Config, plan: FederatedData) -> dict[str, LocalTrainer]:
    """One LocalTrainer per client, exactly as a gRPC client builds it."""
    return {
        f"client-{i}": build_local_trainer(
            config,
            share.train,
            share.test,
            plan.train_identities,
            client_id=f"client-{i}",
            image_size=config.data.image_size,
        )
        for i, share in enumerate(plan.clients)
    }


def run_fedaffect(config: Config, plan: FederatedData, eval_every: int) -> dict[str, Any]:
    """The strategy's rounds over the clients' LocalTrainers; accuracy every ``eval_every``."""
    trainers = make_trainers(config, plan)
    first = next(iter(trainers.values()))
    model = build_fedaffect_model(
        config.model, config.algorithm, config.data.image_size, config.run.seed
    )
    params = get_tensors(model, first.shared_names)  # w_f^0, w_g^0 (Algorithm 1 line 1)
    specs = [TensorSpec.of(k, v) for k, v in params.items()]
    evaluate = make_expression_evaluator(
        config.model, config.algorithm, config.data.image_size, config.run.seed, plan.held_out
    )
    task = local_training(config.train)
    curve: list[float] = []
    losses: dict[str, float] = {}
    for number in range(1, config.train.rounds + 1):
        aggregate = StreamingMean(specs)
        metrics = []
        for trainer in trainers.values():
            update, examples, found = trainer.train(params, task)
            aggregate.add(update, float(examples))  # D_k: labelled + unlabelled
            metrics.append(found)
        params = first.strategy.server_update(params, aggregate.mean(), number)
        losses = {
            k: round(float(np.mean([m[k] for m in metrics if k in m])), 4)
            for k in ("relation_loss", "nt_xent")
            if any(k in m for m in metrics)
        }
        if number % eval_every == 0 or number == config.train.rounds:
            curve.append(round(evaluate(params)["expression_accuracy"], 4))
    return {
        "accuracy": curve[-1],
        "curve": curve,
        "last_round_losses": losses,
        "client_sizes": [t.num_examples for t in trainers.values()],
        "labelled_per_client": [int((t.data.train_targets >= 0).sum()) for t in trainers.values()],
    }


def run_fedavg(
    config: Config, plan: FederatedData, held_out: HeldOut, eval_every: int
) -> dict[str, Any]:
    """Supervised FedAvg (encoder + linear head, cross-entropy) on the same labelled images."""
    clients = [client_data(t.data) for t in make_trainers(config, plan).values()]
    encoder = build_fedaffect_model(
        config.model, config.algorithm, config.data.image_size, config.run.seed
    ).backbone  # the same initial encoder as FedAffect's f
    torch.manual_seed(config.run.seed + 1)
    net = nn.Sequential(encoder, nn.Linear(config.model.embedding_size, C))
    gen = torch.Generator().manual_seed(config.run.seed)
    t = config.train
    curve: list[float] = []
    proto_acc = 0.0
    s_img, s_lab, q_img, q_lab = held_out
    for number in range(1, t.rounds + 1):
        local_states = []
        for data in clients:
            local = copy.deepcopy(net)
            opt = torch.optim.Adam(local.parameters(), lr=t.lr)
            for _ in range(t.local_steps):
                idx = torch.randperm(len(data.labels), generator=gen)[: t.batch_size]
                loss = F.cross_entropy(local(data.labelled[idx]), data.labels[idx])
                opt.zero_grad()
                torch.autograd.backward(loss)
                opt.step()
            local_states.append(local.state_dict())
        net.load_state_dict(weighted_average(local_states, [len(c.labels) for c in clients]))
        if number % eval_every == 0 or number == t.rounds:
            net.eval()
            with torch.no_grad():
                curve.append(round(float((net(q_img).argmax(1) == q_lab).float().mean()), 4))
                s_emb = F.normalize(net[0](s_img), dim=1)
                q_emb = F.normalize(net[0](q_img), dim=1)
                protos = F.normalize(
                    torch.stack([s_emb[s_lab == c].mean(0) for c in range(C)]), dim=1
                )
                proto_acc = float(((q_emb @ protos.T).argmax(1) == q_lab).float().mean())
            net.train()
    return {"accuracy": curve[-1], "curve": curve, "prototype_accuracy": round(proto_acc, 4)}


def central_check(image_size: int, strength: float, seed: int = 0) -> dict[str, float]:
    """Held-out expression accuracy of a central supervised classifier on plentiful labels."""

    def faces(first: int, ids: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = SyntheticFaceConfig(
            ids, 20, image_size=image_size, seed=seed, first_identity=first,
            expression_strength=strength,
        )  # fmt: skip
        data = generate_synthetic_faces(cfg)
        return data.images, torch.from_numpy(data.attributes["expression"])

    x, y = faces(0, 60)
    tx, ty = faces(100_000, 20)
    torch.manual_seed(seed)
    net = nn.Sequential(get_backbone("cnn-small", embedding_size=64, image_size=image_size),
                        nn.Linear(64, C))  # fmt: skip
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(400):
        idx = torch.randperm(len(y), generator=gen)[:64]
        loss = F.cross_entropy(net(x[idx]), y[idx])
        opt.zero_grad()
        torch.autograd.backward(loss)
        opt.step()
    net.eval()
    with torch.no_grad():
        acc = float((net(tx).argmax(1) == ty).float().mean())
        train_acc = float((net(x).argmax(1) == y).float().mean())
    majority = float(torch.bincount(ty, minlength=C).max()) / len(ty)
    return {
        "expression_strength": strength,
        "test_accuracy": round(acc, 4),
        "train_accuracy": round(train_acc, 4),
        "majority_class": round(majority, 4),
        "train_images": len(y),
        "test_images": len(ty),
    }


def summarise(seeds: dict[int, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean and std (population) over seeds of each method's final accuracy."""
    out: dict[str, dict[str, float]] = {}
    for name in ("fedaffect", "fedaffect-no-unlabelled", "fedavg"):
        acc = [row[name]["accuracy"] for row in seeds.values()]
        out[name] = {"mean": round(float(np.mean(acc)), 4), "std": round(float(np.std(acc)), 4)}
    protos = [row["fedavg"]["prototype_accuracy"] for row in seeds.values()]
    out["fedavg-prototype"] = {
        "mean": round(float(np.mean(protos)), 4),
        "std": round(float(np.std(protos)), 4),
    }
    majority = [row["majority_class_accuracy"] for row in seeds.values()]
    out["majority-class"] = {"mean": round(float(np.mean(majority)), 4), "std": 0.0}
    return out


def main() -> None:
    """Parse flags, run every method for every seed, print JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--ids-per-client", type=int, default=20)
    p.add_argument("--images-per-identity", type=int, default=10)
    p.add_argument("--test-ids", type=int, default=30)
    p.add_argument("--labels-per-class", type=int, default=4)
    p.add_argument("--k-shot", type=int, default=2)
    p.add_argument("--image-size", type=int, default=64, choices=(32, 64))
    p.add_argument("--expression-strength", type=float, default=2.5)
    p.add_argument("--embedding-size", type=int, default=64)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--tau", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--central-check", action="store_true", help="learnability check only")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.central_check:
        checks = [central_check(args.image_size, s) for s in (1.0, args.expression_strength)]
        print(json.dumps({"image_size": args.image_size, "central_check": checks}, indent=1))
        return
    started = time.perf_counter()
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "seeds": {}}
    for seed in args.seeds:
        config = make_config(args, seed, use_unlabelled=True)
        plan = plan_federation(config)
        held_out = held_out_expression_split(plan.held_out, args.labels_per_class)
        q_lab = held_out[3]
        row: dict[str, Any] = {
            "queries": len(q_lab),
            "majority_class_accuracy": round(
                float(torch.bincount(q_lab, minlength=C).max()) / len(q_lab), 4
            ),
        }
        for name in ("fedaffect", "fedaffect-no-unlabelled", "fedavg"):
            start = time.perf_counter()
            if name == "fedavg":
                row[name] = run_fedavg(config, plan, held_out, args.eval_every)
            else:
                cfg = make_config(args, seed, use_unlabelled=name == "fedaffect")
                row[name] = run_fedaffect(cfg, plan, args.eval_every)
            row[name]["seconds"] = round(time.perf_counter() - start, 1)
        results["seeds"][seed] = row
    results["summary"] = summarise(results["seeds"])
    results["config"] = json.loads(
        json.dumps(dataclasses.asdict(make_config(args, args.seeds[0], True)), default=str)
    )
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
