"""FedAffect over gRPC + mTLS with real LocalTrainers: f and g go up, the projection head never.

A tiny run (32 px synthetic faces with learnable expressions, 3 clients, 2 rounds) through the
same client path as every algorithm (``build_local_trainer`` -> ``LocalTrainer`` ->
``FlClient``) and the same server (``build_server`` -> ``Coordinator`` -> ``start_server``).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from client.trainer import LocalTrainer
from fl_secure.algorithms.fedaffect import (
    NUM_EXPRESSIONS,
    FedAffect,
    FedAffectModel,
    build_fedaffect_model,
    make_expression_evaluator,
)
from fl_secure.config import Config, config_from_dict
from fl_secure.messages import Tensors
from fl_secure.runs import RunDir
from privacy.dp.calibration import epsilon_for
from privacy.dp.noise import seeded_source

from .grid_release import assert_grid_noised_release  # type: ignore[import-not-found]

IDS = ["client-0", "client-1", "client-2"]
ROUNDS = 2
LABELS_PER_CLASS = 2
Z, C = 1.0, 0.1  # C below the raw update norms (~0.7), so clipping bites


def _config(privacy: dict[str, Any]) -> Config:
    return config_from_dict(
        {
            "run": {"seed": 3},
            "data": {"image_size": 32, "num_identities": 17, "images_per_identity": 8,
                     "held_out_identities": 4, "expression_strength": 2.5},
            "partition": {"num_clients": len(IDS)},
            "model": {"backbone": "cnn-small", "embedding_size": 16},
            "algorithm": {"name": "fedaffect", "labels_per_class": LABELS_PER_CLASS,
                          "k_shot": 1, "n_query": 1, "projection_dim": 8, "relation_hidden": 8},
            "train": {"rounds": ROUNDS, "local_steps": 2, "batch_size": 8, "optimizer": "adam",
                      "lr": 1e-3},
            "server": {"min_clients": len(IDS), "round_timeout": 120.0},
            "privacy": privacy,
        }
    )  # fmt: skip


def _run(
    tmp_path: Path, config: Config, serve: Any
) -> tuple[Any, dict[str, Any], dict[str, Tensors]]:
    """Serve ``config`` over gRPC + mTLS to 3 recording clients; return side, clients, inits."""
    projections: dict[str, Tensors] = {}

    def keep_projection(cid: str, trainer: LocalTrainer) -> None:
        state = trainer.model.state_dict()
        projections[cid] = OrderedDict(
            (k, v.numpy().copy()) for k, v in state.items() if k.startswith("projection.")
        )

    side, recorders = serve(tmp_path, config, IDS, state_dirs=True, before=keep_projection)
    return side, recorders, projections


def _check_split_and_privacy_of_p(
    config: Config, recorders: dict[str, Any], projections: dict[str, Tensors], tmp: Path
) -> None:
    for cid, rec in recorders.items():
        data = rec.trainer.data
        expr = data.train.attributes["expression"]
        targets = data.train_targets.numpy()
        labelled = targets >= 0
        # labelled/unlabelled split: min(L, available) per expression, labels = the attribute
        counts = np.bincount(expr, minlength=NUM_EXPRESSIONS)
        assert np.bincount(targets[labelled], minlength=NUM_EXPRESSIONS).tolist() == [
            min(LABELS_PER_CLASS, int(n)) for n in counts
        ]
        np.testing.assert_array_equal(targets[labelled], expr[labelled])
        assert len(data.train) == labelled.sum() + (~labelled).sum()
        # the count it tells the server: its images, or 1 under client-level DP
        client_level = config.privacy.unit == "client"
        assert rec.num_examples == (1 if client_level else len(data.train))
        # the shared names are f and g; p stays private: never received, never uploaded
        model = rec.trainer.model
        assert isinstance(model, FedAffectModel)
        shared = rec.trainer.shared_names
        assert shared == [f"backbone.{k}" for k in model.backbone.state_dict()] + [
            f"head.{k}" for k in model.relation.state_dict()
        ]
        for tensors in [*rec.received, *(u for u, _ in rec.released)]:
            assert list(tensors) == shared
        # ... but it trained, and is saved in the client's own state folder
        (path,) = (tmp / "clients" / cid).glob("private-*.safetensors")  # this run's
        saved = load_file(str(path))
        assert sorted(saved) == sorted(projections[cid])
        assert any(np.abs(saved[k] - v).max() > 0 for k, v in projections[cid].items())


def test_client_level_dp_round_is_the_mean_of_clipped_noised_f_and_g(
    tmp_path: Path, serve: Any
) -> None:
    # Prepare: client-level DP, local noise z = 1, C = 0.1, reproducible noise per client
    privacy = {"unit": "client", "noise_placement": "local", "noise_multiplier": Z,
               "clip_norm": C, "secure_rng": False}  # fmt: skip
    config = _config(privacy)
    initial_model = build_fedaffect_model(config.model, config.algorithm, 32, config.run.seed)
    # Execute
    side, recorders, projections = _run(tmp_path, config, serve)
    coord = side.coordinator
    # Assert: the run completed both rounds
    assert coord.status == "completed", coord.stop_reason
    assert isinstance(side.strategy, FedAffect)
    _check_split_and_privacy_of_p(config, recorders, projections, tmp_path)
    # Each released update = clip(raw, C) randomly rounded onto the power-of-two grid Lambda
    # plus integer discrete Gaussian noise, from the client's seeded source (in draw order)
    for cid, rec in recorders.items():
        source = seeded_source(config.run.seed, cid)
        assert len(rec.raw) == len(rec.released) == ROUNDS
        for raw, (released, examples) in zip(rec.raw, rec.released, strict=True):
            assert_grid_noised_release(raw, released, Z, C, source)
            assert examples == 1  # client level hides the data size
    # Round r's global f and g = previous + mean of the released updates over the cohort (3)
    params = OrderedDict(
        (k, v.numpy()) for k, v in initial_model.state_dict().items() if not k.startswith("proj")
    )
    for r in range(ROUNDS):
        for rec in recorders.values():
            for k, v in rec.received[r].items():
                np.testing.assert_allclose(v, params[k], rtol=0, atol=1e-6)
        params = OrderedDict(
            (k, (params[k] + sum(rec.released[r][0][k].astype(np.float64)
                                 for rec in recorders.values()) / len(IDS)).astype(np.float32))
            for k in params
        )  # fmt: skip
    for k, v in coord.params.items():
        np.testing.assert_allclose(v, params[k], rtol=0, atol=1e-6)
    # epsilon after each round = the zCDP bound of the integer local noise (q = 1, z = 1)
    records = RunDir(tmp_path / "run").read_metrics()
    train_records = [r for r in records if r["round"] >= 1]
    expected_eps = [
        epsilon_for(accountant="pld", noise_multiplier=Z, sample_rate=1.0, steps=r, delta=1e-5,
                    noise="discrete_gaussian")
        for r in range(1, ROUNDS + 1)
    ]  # fmt: skip
    assert [r["epsilon"] for r in train_records] == pytest.approx(expected_eps, rel=1e-9)
    # the server's evaluation is expression accuracy of the released f and g
    evaluate = make_expression_evaluator(
        config.model, config.algorithm, 32, config.run.seed, side.plan.held_out
    )
    final = evaluate(coord.params)
    assert train_records[-1]["held_out"]["expression_accuracy"] == pytest.approx(
        final["expression_accuracy"]
    )
    assert 0.0 <= final["expression_accuracy"] <= 1.0


def test_without_dp_f_and_g_are_averaged_by_labelled_plus_unlabelled_count(
    tmp_path: Path, serve: Any
) -> None:
    # Prepare: the same run, no DP, one round
    config = _config({"unit": "none"})
    initial_model = build_fedaffect_model(config.model, config.algorithm, 32, config.run.seed)
    # Execute
    side, recorders, projections = _run(tmp_path, config, serve)
    coord = side.coordinator
    # Assert: Algorithm 1 lines 13-14, D_k = labelled + unlabelled images of client k
    assert coord.status == "completed", coord.stop_reason
    _check_split_and_privacy_of_p(config, recorders, projections, tmp_path)
    sizes = {cid: len(rec.trainer.data.train) for cid, rec in recorders.items()}
    assert len(set(sizes.values())) > 1  # unequal D_k: a weighted mean differs from a plain one
    params = OrderedDict(
        (k, v.numpy()) for k, v in initial_model.state_dict().items() if not k.startswith("proj")
    )
    total = float(sum(sizes.values()))
    for r in range(ROUNDS):
        for cid, rec in recorders.items():
            assert rec.released[r][1] == sizes[cid]
        params = OrderedDict(
            (k, (params[k] + sum(rec.released[r][0][k].astype(np.float64) * sizes[cid] / total
                                 for cid, rec in recorders.items())).astype(np.float32))
            for k in params
        )  # fmt: skip
    for k, v in coord.params.items():
        np.testing.assert_allclose(v, params[k], rtol=0, atol=1e-6)
    # the metrics the clients report (no DP): both local objectives ran on the split
    last = RunDir(tmp_path / "run").read_metrics()[-1]
    for cid, m in last["clients"].items():
        assert m["labelled"] + m["unlabelled"] == sizes[cid]
        assert m["relation_loss"] > 0 and m["nt_xent"] > 0
