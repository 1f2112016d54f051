"""fl-secure eval: a checkpoint scored on the run's held-out identities or LFW pairs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from fl_secure.algorithms import FedPE
from fl_secure.app.evaluate import evaluate_run
from fl_secure.checkpoints import CheckpointStore
from fl_secure.config import config_from_dict, config_to_toml
from fl_secure.data.lfw import load_pair_images, read_pairs
from fl_secure.data.plan import plan_federation
from fl_secure.errors import CheckpointError
from fl_secure.runs import RunDir
from fl_secure.training import build_model, embed, evaluate_verification, get_tensors

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
TINY = {
    "data": {
        "num_identities": 16,
        "images_per_identity": 4,
        "held_out_identities": 6,
        "image_size": 32,
    },
    "partition": {"num_clients": 2},
    "server": {"min_clients": 1},
    "model": {"backbone": "cnn-small", "embedding_size": 32},
}


def _run(tmp_path: Path):
    config = config_from_dict(TINY)
    run = RunDir(tmp_path)
    run.config.write_text(config_to_toml(config))
    model = build_model(config.model, 1, 32, seed=11)  # not the run's seed: a "trained" model
    CheckpointStore(run.checkpoints).save(3, get_tensors(model, FedPE().shared_names(model)), {})
    return config, run, model


def test_eval_reproduces_the_held_out_figures(tmp_path: Path) -> None:
    config, run, model = _run(tmp_path)
    result = evaluate_run(run.path)
    expected = evaluate_verification(model.backbone, plan_federation(config).held_out)
    assert result["round"] == 3
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, abs=1e-9), key


def test_eval_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a run directory"):
        evaluate_run(tmp_path)
    _run(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint of round 7"):
        evaluate_run(tmp_path, round_=7)


def test_a_checkpoint_altered_after_it_was_written_is_refused(tmp_path: Path) -> None:
    # Prepare: one bit of a weight flipped: still valid safetensors, finite, right shapes
    _, run, _ = _run(tmp_path)
    path = run.checkpoints / "round-000003.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01  # inside the last tensor's data
    path.write_bytes(bytes(raw))
    # Execute / Assert
    with pytest.raises(CheckpointError, match="is damaged or altered: its SHA-256 is not"):
        CheckpointStore(run.checkpoints).latest()
    with pytest.raises(CheckpointError, match="round-000003.safetensors is damaged or altered"):
        evaluate_run(run.path)
    raw[-3] ^= 0x01  # restored: loads again
    path.write_bytes(bytes(raw))
    latest = CheckpointStore(run.checkpoints).latest()
    assert latest is not None and latest.round == 3 and "sha256" not in latest.state


@pytest.mark.parametrize("named", [3, 4])
def test_a_round_named_by_number_is_checked_like_the_latest(tmp_path: Path, named: int) -> None:
    # Prepare: rounds 3 and 4 saved (4 the latest), and one bit of round `named` flipped
    _, run, model = _run(tmp_path)
    store = CheckpointStore(run.checkpoints)
    store.save(4, get_tensors(model, FedPE().shared_names(model)), {"status": "running"})
    path = store.path_of(named)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01
    path.write_bytes(bytes(raw))
    # Execute / Assert: --round N is refused as the latest is, by name
    with pytest.raises(CheckpointError, match=f"round-00000{named}.safetensors is damaged or alt"):
        evaluate_run(run.path, round_=named)
    other = 7 - named  # the untouched round loads, and its state has no digest bookkeeping
    loaded = store.load(other)
    assert loaded.round == other and "kept_sha256" not in loaded.state
    # pruned files leave the record: keep = 3 of rounds 3..6
    for r in (5, 6):
        store.save(r, get_tensors(model, FedPE().shared_names(model)), {})
    kept = store.latest_state()["kept_sha256"]  # type: ignore[index]
    assert sorted(kept) == [f"round-00000{r}.safetensors" for r in (4, 5, 6)]


def test_damaged_checkpoints_are_named_not_loaded(tmp_path: Path) -> None:
    config, run, model = _run(tmp_path)
    store = CheckpointStore(run.checkpoints)
    params = get_tensors(model, FedPE().shared_names(model))
    name = next(iter(params))
    path = run.checkpoints / "round-000003.safetensors"
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(CheckpointError, match="round-000003.safetensors is damaged"):
        evaluate_run(run.path)
    path.write_bytes(b"\xff" * 64)  # garbled header
    with pytest.raises(CheckpointError, match="not readable as safetensors"):
        evaluate_run(run.path)
    bad = params.copy()
    bad[name] = params[name].copy()
    bad[name].flat[:3] = [np.nan, np.inf, -np.inf]
    store.save(3, bad, {})
    with pytest.raises(CheckpointError, match=f"'{name}' holds 3 NaN/Inf values"):
        evaluate_run(run.path)
    missing = params.copy()
    del missing[name]  # a checkpoint that would leave one layer at its random start
    store.save(3, missing, {})
    with pytest.raises(CheckpointError, match=rf"missing \['{name}'\]"):
        evaluate_run(run.path)
    misshapen = params.copy()
    misshapen[name] = np.zeros((2, 2), np.float32)
    store.save(3, misshapen, {})
    with pytest.raises(CheckpointError, match=f"{name} has shape \\(2, 2\\)"):
        evaluate_run(run.path)
    (run.checkpoints / "latest.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="latest.json: expected a JSON object"):
        evaluate_run(run.path)


@pytest.mark.skipif(not (DATA / "lfw_devtest").is_dir(), reason="LFW dev-test not available")
def test_eval_on_lfw_dev_test_pairs(tmp_path: Path) -> None:
    _, run, model = _run(tmp_path)
    pairs = DATA / "lfw_protocol" / "pairsDevTest.txt"
    result = evaluate_run(run.path, lfw_pairs=pairs, lfw_root=DATA / "lfw_devtest")
    # independent computation of the AUC over the same 1000 pairs
    images = load_pair_images(read_pairs(pairs), DATA / "lfw_devtest", image_size=32)
    emb = embed(model.backbone, images.dataset.images)
    scores = np.sum(emb[images.left] * emb[images.right], axis=1)
    assert len(scores) == 1000 and images.same.sum() == 500
    assert result["roc_auc"] == pytest.approx(roc_auc_score(images.same, scores), abs=1e-9)
    assert 0.0 <= result["tar_at_far_1e-2"] <= 1.0


def test_a_run_without_held_out_identities_is_told_to_use_lfw_pairs(tmp_path: Path) -> None:
    from fl_secure.errors import DataError

    config = config_from_dict({**TINY, "data": {**TINY["data"], "held_out_identities": 0}})
    run = RunDir(tmp_path)
    run.config.write_text(config_to_toml(config))
    model = build_model(config.model, 1, 32, seed=11)
    CheckpointStore(run.checkpoints).save(1, get_tensors(model, FedPE().shared_names(model)), {})
    with pytest.raises(DataError, match="holds out no identity .* use --lfw-pairs"):
        evaluate_run(run.path)


@pytest.mark.skipif(not (DATA / "lfw_min10_cap20").is_dir(), reason="LFW subset not available")
def test_lfw_pairs_use_the_runs_crop_and_count_the_identities_it_trained_on(
    tmp_path: Path,
) -> None:
    from fl_secure.errors import DataError

    # Prepare: a run on the LFW subset (crop 150), scored on the dev-test pairs
    lfw = {"source": "folders", "path": str(DATA / "lfw_min10_cap20"), "center_crop": 150,
           "image_size": 32, "held_out_identities": 38, "test_fraction": 0.3}  # fmt: skip
    config = config_from_dict({**TINY, "data": lfw, "partition": {"num_clients": 4}})
    run = RunDir(tmp_path)
    run.config.write_text(config_to_toml(config))
    model = build_model(config.model, 1, 32, seed=11)
    CheckpointStore(run.checkpoints).save(1, get_tensors(model, FedPE().shared_names(model)), {})
    (run.path / "logs").mkdir()  # embedded: its clients trained on the plan
    pairs = DATA / "lfw_protocol" / "pairsDevTest.txt"
    root = DATA / "lfw_devtest"
    # Execute
    found = evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root)
    uncropped = evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root, center_crop=0)
    # Assert: the run's crop by default, 0 for none
    assert found["center_crop"] == 150 and uncropped["center_crop"] is None
    cropped = load_pair_images(read_pairs(pairs), root, image_size=32, center_crop=150)
    emb = embed(model.backbone, cropped.dataset.images)
    scores = np.sum(emb[cropped.left] * emb[cropped.right], axis=1)
    assert found["roc_auc"] == pytest.approx(roc_auc_score(cropped.same, scores), abs=1e-9)
    # the pairs naming an identity some client trained on, counted independently
    plan = plan_federation(config)
    trained = {plan.clients[0].train.identity_names[int(i)]
               for c in plan.clients for i in c.train.identities()}  # fmt: skip
    involved = sum(p.name1 in trained or p.name2 in trained for p in read_pairs(pairs).pairs)
    assert found["pairs_with_training_identities"] == involved > 0
    keep = np.array([not (p.name1 in trained or p.name2 in trained)
                     for p in read_pairs(pairs).pairs])  # fmt: skip
    expected = roc_auc_score(cropped.same[keep], scores[keep])
    assert found["disjoint_roc_auc"] == pytest.approx(expected, abs=1e-9)
    with pytest.raises(DataError, match="--center-crop -5: give a side >= 1, or 0"):
        evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root, center_crop=-5)


def _pairs_of_the_runs_identities(tmp_path: Path, config) -> tuple[Path, Path]:
    """An LFW-style root and a 1-fold pairs file over the run's own (synthetic) identities."""
    from PIL import Image

    plan = plan_federation(config)
    root = tmp_path / "lfw"
    names = []
    for dataset in (plan.clients[0].train, plan.held_out):
        for identity in dataset.identities()[:2]:
            name = dataset.identity_names[int(identity)]
            names.append(name)
            (root / name).mkdir(parents=True)
            idx = np.flatnonzero(dataset.labels.numpy() == identity)[:2]
            for k, i in enumerate(idx, 1):
                pixels = (dataset.images[int(i)].permute(1, 2, 0).numpy() * 255).clip(0, 255)
                Image.fromarray(pixels.astype(np.uint8)).save(root / name / f"{name}_{k:04d}.jpg")
    trained, held = names[:2], names[2:]
    pairs = tmp_path / "pairs.txt"
    pairs.write_text(  # 2 same-person pairs, 2 different-person pairs; 3 name a trained id
        f"2\n{trained[0]} 1 2\n{held[0]} 1 2\n{trained[1]} 1 {held[1]} 1\n{held[0]} 1 {held[1]} 2\n"
    )
    return pairs, root


COUNT = "pairs_with_training_identities"


def test_lfw_overlap_is_counted_for_plan_runs_and_unknown_when_sites_held_their_own_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: a run whose clients trained on the plan (embedded: logs/ of its clients)
    from fl_secure.app.cli import main

    (tmp_path / "run").mkdir()
    config, run, _ = _run(tmp_path / "run")
    pairs, root = _pairs_of_the_runs_identities(tmp_path, config)
    (run.path / "logs").mkdir()
    # Execute / Assert: the pairs naming a trained identity are counted
    assert evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root)[COUNT] == 2
    # a standalone server's run: the sites trained on their own data, not the server's plan
    (run.path / "logs").rmdir()
    run.write_summary({"status": "completed", "client_train_sizes": None})
    found = evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root)
    assert found[COUNT] is None
    assert found[f"{COUNT}_note"].startswith("unknown: the sites trained on their own data")
    assert "disjoint_roc_auc" not in found and 0.0 <= found["roc_auc"] <= 1.0
    # the same run with a summary that records the plan: counted again
    run.write_summary({"status": "completed", "client_train_sizes": [1, 1]})
    assert evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root)[COUNT] == 2
    # the printed output says it is unknown, and why
    run.write_summary({"status": "completed", "client_train_sizes": None})
    argv = ["eval", "--run", str(run.path), "--lfw-pairs", str(pairs), "--lfw-root", str(root)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "pairs_with_training_identities: unknown\n" in out
    assert "unknown: the sites trained on their own data" in out


def test_a_centralized_run_is_scored_with_its_saved_backbone(tmp_path: Path) -> None:
    from fl_secure.app.centralized import run_centralized

    # Prepare: a one-pass centralized run (it saves backbone.safetensors, no checkpoints)
    config = config_from_dict({**TINY, "train": {"rounds": 1, "local_steps": 1}})
    summary = run_centralized(config, out=tmp_path, progress=False)
    run_dir = Path(summary["run_dir"])
    # Execute
    result = evaluate_run(run_dir)
    # Assert: the figures the run reported for its final backbone
    assert result["round"] == 1 and result["model"] == "backbone.safetensors (centralized run)"
    for key in ("tar_at_far_1e-1", "tar_at_far_1e-2", "rank1", "roc_auc"):
        assert result[key] == pytest.approx(summary["held_out"][key], abs=1e-9), key
    with pytest.raises(CheckpointError, match="centralized run: it keeps only its final"):
        evaluate_run(run_dir, round_=1)


def test_lfw_options_without_a_pairs_file_are_refused(tmp_path: Path) -> None:
    from fl_secure.errors import DataError

    _run(tmp_path)
    with pytest.raises(DataError, match="--lfw-root applies to LFW pairs only: add --lfw-pairs"):
        evaluate_run(tmp_path, lfw_root=tmp_path)
    with pytest.raises(DataError, match="--lfw-root and --center-crop apply to LFW pairs only"):
        evaluate_run(tmp_path, lfw_root=tmp_path, center_crop=0)
    assert evaluate_run(tmp_path)["round"] == 3  # the held-out identities, as before


def test_disjoint_pairs_in_one_fold_keep_the_other_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fl_secure.app.cli import main

    # Prepare: a 2-fold pairs file whose pairs of untrained identities all sit in fold 1
    (tmp_path / "run").mkdir()
    config, run, model = _run(tmp_path / "run")
    _, root = _pairs_of_the_runs_identities(tmp_path, config)
    (run.path / "logs").mkdir()
    trained, held = (
        sorted(p.name for p in root.iterdir() if p.name in names)
        for names in (_trained_names_of(config), {p.name for p in root.iterdir()})
    )
    held = [n for n in held if n not in trained]
    t0, t1 = trained
    h0, h1 = held
    pairs = tmp_path / "pairs2.txt"
    pairs.write_text(
        "2 2\n"
        f"{h0} 1 2\n{h1} 1 2\n{h0} 1 {h1} 1\n{h0} 2 {h1} 2\n"
        f"{t0} 1 2\n{t1} 1 2\n{t0} 1 {t1} 1\n{t0} 2 {h1} 1\n"
    )
    # Execute: it used to stop on "folds must name at least two distinct folds"
    found = evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root)
    # Assert: the 10-fold (here 2-fold) accuracy of all pairs, and the disjoint figures
    # that need no folds, over the four untrained pairs (checked against sklearn)
    assert found[COUNT] == 4 and "lfw_accuracy_mean" in found
    assert "disjoint_lfw_balanced_accuracy" not in found and found["disjoint_num_genuine"] == 2
    images = load_pair_images(read_pairs(pairs), root, image_size=32)
    emb = embed(model.backbone, images.dataset.images)
    scores = np.sum(emb[images.left] * emb[images.right], axis=1)
    expected = roc_auc_score(images.same[:4], scores[:4])
    assert found["disjoint_roc_auc"] == pytest.approx(expected, abs=1e-9)
    # and the printout says the crop is none (0), not unknown
    argv = ["eval", "--run", str(run.path), "--lfw-pairs", str(pairs), "--lfw-root", str(root)]
    assert main(argv) == 0
    assert "center_crop: none\n" in capsys.readouterr().out


def _trained_names_of(config) -> set[str]:
    plan = plan_federation(config)
    return {c.train.identity_names[int(i)] for c in plan.clients for i in c.train.identities()}


def test_a_centralized_domain_run_trained_on_its_source_client_only() -> None:
    from fl_secure.app.centralized import pretraining_clients
    from fl_secure.app.evaluate import _trained_names

    # Prepare: a FedFR domain plan: client 0 the labelled source, the others targets
    config = config_from_dict({
        "data": {"image_size": 32, "num_identities": 12, "images_per_identity": 4,
                 "held_out_identities": 2},
        "partition": {"kind": "domain", "num_clients": 3}, "server": {"min_clients": 2},
    })  # fmt: skip
    plan = plan_federation(config)
    source = {plan.clients[0].train.identity_names[int(i)]
              for i in plan.clients[0].train.identities()}  # fmt: skip
    # Assert: a centralized run pooled the source client's identities alone
    assert len(pretraining_clients(config, plan)) == 1
    assert _trained_names(config, centralized=True) == source
    assert _trained_names(config) == _trained_names_of(config) > source


def _scaled(run: RunDir, model, scale: float, prefix: str = "") -> None:
    """Save round 3 again with the float weights under ``prefix`` multiplied by ``scale``."""
    params = get_tensors(model, FedPE().shared_names(model))
    for name, value in params.items():
        if name.startswith(prefix) and value.dtype.kind == "f":
            params[name] = (value * np.float32(scale)).astype(value.dtype)
    CheckpointStore(run.checkpoints).save(3, params, {})


@pytest.mark.parametrize("scale", [0.0, 1e30])
def test_a_model_with_degenerate_embeddings_is_refused_by_name_on_both_paths(
    tmp_path: Path, scale: float, capsys: pytest.CaptureFixture[str]
) -> None:
    from fl_secure.app.cli import main

    # Prepare: all weights zero (every embedding vanishes) or huge (outputs overflow)
    (tmp_path / "run").mkdir()
    config, run, model = _run(tmp_path / "run")
    pairs, root = _pairs_of_the_runs_identities(tmp_path, config)
    (run.path / "logs").mkdir()
    _scaled(run, model, scale)
    named = "the checkpoint of round 3 in .* cannot be scored: embedding rows .* zero or not fin"
    # Execute / Assert: no figures of a model without a cosine (the LFW path used to print
    # TAR 0 and AUC 0.5 for zero weights), and no traceback from the command
    with pytest.raises(CheckpointError, match=named):
        evaluate_run(run.path)
    with pytest.raises(CheckpointError, match=named):
        evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root)
    for extra in ([], ["--lfw-pairs", str(pairs), "--lfw-root", str(root)]):
        assert main(["eval", "--run", str(run.path), *extra]) == 2
        assert "fl-secure: error: the checkpoint of round 3" in capsys.readouterr().err


def test_lfw_pairs_score_embeddings_whose_norm_overflows_float32(tmp_path: Path) -> None:
    # Prepare: the embedding layer scaled by 1e20: outputs stay finite in float32, but
    # their norm (about 1e21) squared overflows it; the cosines are those of the unscaled
    (tmp_path / "run").mkdir()
    config, run, model = _run(tmp_path / "run")
    pairs, root = _pairs_of_the_runs_identities(tmp_path, config)
    (run.path / "logs").mkdir()
    plain = evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root)
    _scaled(run, model, 1e20, prefix="backbone.embedding.")
    # Execute
    found = evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root)
    # Assert: the same figures, not those of zero vectors (AUC 0.5)
    images = load_pair_images(read_pairs(pairs), root, image_size=32)
    with torch.no_grad():  # the unscaled model's outputs, normalised in float64
        raw = model.backbone.eval()(images.dataset.images).numpy().astype(np.float64)
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    scores = np.sum(unit[images.left] * unit[images.right], axis=1)
    assert len(np.unique(np.round(scores, 4))) == len(scores)  # no near-ties to reorder
    assert found["roc_auc"] == pytest.approx(roc_auc_score(images.same, scores), abs=1e-9)
    for key in ("roc_auc", "eer", "tar_at_far_1e-1"):
        assert found[key] == pytest.approx(plain[key], abs=1e-9), key


def test_a_fedaffect_run_is_scored_by_expression_accuracy_not_verification(
    tmp_path: Path,
) -> None:
    from fl_secure.algorithms import get_strategy
    from fl_secure.algorithms.fedaffect import build_fedaffect_model, make_expression_evaluator
    from fl_secure.errors import DataError

    # Prepare: a FedAffect run's checkpoint (shared: encoder f and relation module g)
    config = config_from_dict({
        "data": {"image_size": 32, "num_identities": 10, "images_per_identity": 10,
                 "held_out_identities": 3, "expression_strength": 2.5},
        "partition": {"num_clients": 2}, "server": {"min_clients": 1},
        "model": {"backbone": "cnn-small", "embedding_size": 16},
        "algorithm": {"name": "fedaffect", "labels_per_class": 3, "k_shot": 1, "n_query": 1,
                      "projection_dim": 8, "relation_hidden": 8},
    })  # fmt: skip
    run = RunDir(tmp_path)
    run.config.write_text(config_to_toml(config))
    model = build_fedaffect_model(config.model, config.algorithm, 32, seed=11)
    strategy = get_strategy("fedaffect", config.algorithm)
    params = get_tensors(model, strategy.shared_names(model))
    assert any(k.startswith("head.") for k in params)  # g travels with f
    CheckpointStore(run.checkpoints).save(2, params, {})
    (run.path / "logs").mkdir()
    # Execute
    found = evaluate_run(run.path)
    # Assert: the server's figures of that model, and no identity verification
    held_out = plan_federation(config).held_out
    expected = make_expression_evaluator(config.model, config.algorithm, 32, 0, held_out)(params)
    assert found["round"] == 2 and "tar_at_far_1e-1" not in found
    assert found["expression_accuracy"] == pytest.approx(expected["expression_accuracy"])
    assert found["expression_majority"] == pytest.approx(expected["expression_majority"])
    pairs, root = tmp_path / "pairs.txt", tmp_path / "lfw"
    with pytest.raises(DataError, match="FedAffect run: its model recognises facial expr"):
        evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root)


def test_eval_needs_no_pretrained_weights_file_the_checkpoint_replaces(tmp_path: Path) -> None:
    from fl_secure.models import save_weights

    # Prepare: a run that started from model.pretrained weights, since moved away
    start = tmp_path / "start.safetensors"
    save_weights(build_model(config_from_dict(TINY).model, 1, 32, seed=5).backbone, start)
    config = config_from_dict({**TINY, "model": {**TINY["model"], "pretrained": str(start)}})
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.config.write_text(config_to_toml(config))
    model = build_model(config_from_dict(TINY).model, 1, 32, seed=11)
    CheckpointStore(run.checkpoints).save(3, get_tensors(model, FedPE().shared_names(model)), {})
    start.unlink()
    # Execute: it used to stop on "weights file ... does not exist"
    result = evaluate_run(run.path)
    # Assert: the checkpoint's model is scored
    expected = evaluate_verification(model.backbone, plan_federation(config).held_out)
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, abs=1e-9), key


def test_lfw_overlap_counts_the_identities_a_pretrained_backbone_trained_on(
    tmp_path: Path,
) -> None:
    from fl_secure.models import save_weights

    # Prepare: a "centralized run" that trained on every identity, whose backbone another
    # run started from; that run's clients trained on 10 of the 16 identities
    (tmp_path / "run").mkdir()
    config, run, model = _run(tmp_path / "run")
    pairs, root = _pairs_of_the_runs_identities(tmp_path, config)
    (run.path / "logs").mkdir()
    assert evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root)[COUNT] == 2
    earlier = tmp_path / "pretraining"
    earlier.mkdir()
    everyone = config_from_dict({**TINY, "data": {**TINY["data"], "held_out_identities": 0}})
    (earlier / "config.toml").write_text(config_to_toml(everyone))
    save_weights(model.backbone, earlier / "backbone.safetensors")
    pretrained = {**TINY["model"], "pretrained": str(earlier / "backbone.safetensors")}
    run.config.write_text(config_to_toml(config_from_dict({**TINY, "model": pretrained})))
    # Execute
    found = evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root)
    # Assert: all 4 pairs name an identity the backbone saw (the 2 "held-out" ones in
    # pretraining): none is left for the disjoint figures
    assert found[COUNT] == 4 and "disjoint_roc_auc" not in found
    assert "model.pretrained backbone trained on too" in found[f"{COUNT}_note"]
    # weights without their run's config.toml: the overlap is unknown, not 2
    (earlier / "config.toml").unlink()
    found = evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root)
    assert found[COUNT] is None and "disjoint_roc_auc" not in found
    assert found[f"{COUNT}_note"].startswith("unknown: the model started from model.pretrained")


def test_disjoint_pairs_report_their_counts_and_balanced_accuracy(tmp_path: Path) -> None:
    from PIL import Image

    # Prepare: a model without skill (every embedding the same: its layer's bias) and a
    # 2-fold pairs file; dropping the pairs that name a trained identity leaves 2 genuine
    # and 1 impostor pair per fold, where accepting everything is right 2 times in 3
    (tmp_path / "run").mkdir()
    config, run, model = _run(tmp_path / "run")
    (run.path / "logs").mkdir()
    params = get_tensors(model, FedPE().shared_names(model))
    params["backbone.embedding.weight"] = np.zeros_like(params["backbone.embedding.weight"])
    CheckpointStore(run.checkpoints).save(3, params, {})
    plan = plan_federation(config)
    root = tmp_path / "lfw"
    names = []
    for dataset, count in ((plan.clients[0].train, 2), (plan.held_out, 4)):
        for identity in dataset.identities()[:count]:
            name = dataset.identity_names[int(identity)]
            names.append(name)
            (root / name).mkdir(parents=True)
            for k, i in enumerate(np.flatnonzero(dataset.labels.numpy() == identity)[:2], 1):
                pixels = (dataset.images[int(i)].permute(1, 2, 0).numpy() * 255).clip(0, 255)
                Image.fromarray(pixels.astype(np.uint8)).save(root / name / f"{name}_{k:04d}.jpg")
    t0, t1, h0, h1, h2, h3 = names
    pairs = tmp_path / "pairs.txt"
    pairs.write_text(
        "2 2\n"
        f"{h0} 1 2\n{h1} 1 2\n{h0} 1 {h1} 1\n{t0} 1 {t1} 1\n"
        f"{h2} 1 2\n{h3} 1 2\n{h2} 1 {h3} 1\n{t0} 2 {h3} 2\n"
    )
    # Execute
    found = evaluate_run(run.path, lfw_pairs=pairs, lfw_root=root)
    # Assert: the counts say how unbalanced the disjoint pairs are, and the balanced
    # accuracy gives the model no credit (plain 10-fold accuracy would say 2/3)
    assert found[COUNT] == 2 and found["roc_auc"] == 0.5
    assert (found["disjoint_num_genuine"], found["disjoint_num_impostor"]) == (4, 2)
    assert found["disjoint_lfw_balanced_accuracy"] == 0.5
    assert "disjoint_lfw_accuracy_mean" not in found
    assert found["lfw_balanced_accuracy"] == 0.5 and found["lfw_accuracy_mean"] == 0.5
