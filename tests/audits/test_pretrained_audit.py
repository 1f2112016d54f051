"""``fl-secure audit`` of a run that fine-tunes part of a pretrained backbone.

The run's checkpoints hold only what ``train.trainable`` trains; the frozen rest comes from
``model.pretrained``. The fixture is a tiny simulated run of ``cnn-small`` at 32 px that
starts from a saved random backbone and trains only its embedding layer (no real faces).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from audits import observations as observations_module
from audits.attacks import leakage as leakage_module
from audits.attacks.inversion import attacker_prior, public_faces
from audits.attacks.leakage import leakage_attack
from audits.inversion import InversionConfig, invert
from audits.leakage import identify, recover_fc_inputs_without_bias
from audits.observations import RunContext, choose_targets, load_run, observations
from audits.run_audit import AuditSettings, audit_run
from fl_secure.app.report import write_report
from fl_secure.app.simulated_run import write_simulated_run
from fl_secure.checkpoints import CheckpointStore
from fl_secure.config import config_from_dict, config_to_toml
from fl_secure.data import SyntheticFaceConfig, generate_synthetic_faces
from fl_secure.errors import CheckpointError
from fl_secure.models import get_backbone, save_weights
from fl_secure.models.pretrained import pretrained_provenance
from fl_secure.models.trainable import apply_trainable
from fl_secure.runs import RunDir
from fl_secure.training import FaceModel, build_model
from tests.audits.test_audit_run import TINY


def _pretrained_config(base: Path, algorithm: str = "fedavg") -> dict[str, Any]:
    """TINY from a saved random backbone (seed 5), training only the embedding layer."""
    raw = tomllib.loads(TINY.format(algorithm=algorithm))
    start = build_model(config_from_dict(raw).model, 1, 32, seed=5).backbone
    save_weights(start, base / "pretrained.safetensors")
    raw["model"]["pretrained"] = str(base / "pretrained.safetensors")
    raw["train"] |= {"trainable": "embedding", "rounds": 2, "local_epochs": 1}
    return raw


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("pretrained")
    return write_simulated_run(config_from_dict(_pretrained_config(base)), base)


def test_a_bias_free_layer_gives_one_input_up_to_scale_in_every_row() -> None:
    # Prepare: one image's gradient of a bias-free FC layer (dlib's embedding layer) whose
    # input is non-negative (pooled ReLU features)
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(16, 8, bias=False)
    x = torch.rand(1, 16, generator=gen)
    loss = (layer(x) * torch.randn(1, 8, generator=gen)).sum()
    loss.backward()
    assert layer.weight.grad is not None
    # Execute
    rec = recover_fc_inputs_without_bias(-0.1 * layer.weight.grad)
    # Assert: every row is the input up to a positive scale (the sign is fixed)
    assert rec.vectors.shape == (8, 16)
    cosine = F.normalize(rec.vectors, dim=1) @ F.normalize(x, dim=1).T
    assert torch.allclose(cosine, torch.ones(8, 1), atol=1e-5)
    # and it names the input's identity against a gallery
    gallery = torch.cat([x, torch.rand(5, 16, generator=gen)])
    found = identify(rec.vectors[:1], gallery, torch.arange(6))
    assert int(found.top1[0]) == 0


def _without_embedding_bias(model: FaceModel) -> FaceModel:
    layer = model.backbone.embedding
    assert isinstance(layer, torch.nn.Linear)
    layer.register_parameter("bias", None)
    return model


@pytest.fixture
def bias_free_run(
    pretrained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> RunContext:
    """The run as if its embedding layer had no bias (dlib's): models and checkpoint."""
    dest = tmp_path / "run"
    shutil.copytree(pretrained_run, dest)
    store = CheckpointStore(RunDir(dest).checkpoints)
    last = store.latest()
    assert last is not None
    params = type(last.parameters)(
        (k, v) for k, v in last.parameters.items() if k != "backbone.embedding.bias"
    )
    store.save(last.round, params, {"status": "completed"})
    for module in (observations_module, leakage_module):
        build = module.build_run_model
        monkeypatch.setattr(
            module,
            "build_run_model",
            lambda *a, build=build, **k: _without_embedding_bias(build(*a, **k)),
        )
    return load_run(dest)


def test_leakage_reads_an_embedding_layer_without_bias(bias_free_run: RunContext) -> None:
    # Prepare: the server's view (each client's update) of a run with a bias-free FC layer
    run = bias_free_run
    assert getattr(run.model.backbone.embedding, "bias", 0) is None
    server = next(v for v in observations(run, choose_targets(run, 2)) if v.party == "server")
    # Execute
    found = leakage_attack(run, server, seed=0)
    # Assert: one client's input recovered exactly from the rows of its weight update
    assert found["applicable"] is True
    assert "no bias" in found["layer"]
    one = found["single_client_one_image"]
    assert one["clients"] == 3
    assert one["mean_one_minus_cosine_to_truth"] < 1e-4
    assert found["secure_sum_one_image_each"]["rank"] == 3


def test_the_prior_says_a_backbone_without_norm_layers_has_no_statistics() -> None:
    # Prepare: dlib's ResNet, whose batch norms are folded into affine layers
    backbone = get_backbone("dlib-resnet", embedding_size=128, image_size=150)
    # Execute
    text = attacker_prior("faces", 64, False, backbone)["prior"]
    # Assert: it names neither BatchNorm statistics nor a GroupNorm it does not have
    assert text.endswith("(this backbone: no: no BatchNorm layer holds running statistics "
                         "(e.g. norms folded into affine layers))")  # fmt: skip
    assert "GroupNorm" not in text


def test_the_prior_is_fitted_on_at_most_max_faces_public_faces(pretrained_run: Path) -> None:
    run = load_run(pretrained_run)
    # Execute
    every, every_text = public_faces(run, None, 0)
    some, some_text = public_faces(run, None, 0, max_faces=20)
    # Assert: 12 held-out identities x 12 images; the cut is a subset, and is said
    assert len(every) == 144 and "random" not in every_text
    assert some.shape == (20, 3, 32, 32)
    assert some_text.startswith(every_text)
    assert "; a random 20 of them (32-px faces: the prior's PCA is limited to 20" in some_text
    assert all(any(torch.equal(face, other) for other in every) for face in some)


def test_dlib_resnet_is_inverted_from_pixels_through_its_frozen_trunk() -> None:
    # Prepare: dlib's ResNet (random weights) at 150 px, only its embedding layer trainable,
    # as a run with train.trainable = "embedding" builds it
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        backbone = get_backbone("dlib-resnet", embedding_size=128, image_size=150)
    apply_trainable(backbone, "embedding", backbone_name="dlib-resnet")
    target = F.normalize(torch.randn(1, 128, generator=torch.Generator().manual_seed(1)), dim=1)
    steps: list[int] = []
    cfg = InversionConfig(steps=3, restarts=1, jitter=4)
    # Execute
    result = invert(backbone, target, image_size=150, config=cfg, on_step=steps.append)
    # Assert: a [-1, 1] image of dlib's size, whose embedding from pixels is the one reported
    image = result.images
    assert image.shape == (1, 3, 150, 150)
    assert float(image.min()) >= -1.0 and float(image.max()) <= 1.0
    with torch.no_grad():
        cosine = F.normalize(backbone(image), dim=1) @ target.T
    assert float(cosine) == pytest.approx(float(result.cosine[0]), abs=1e-5)
    # every step was reported, and the frozen trunk stays frozen
    assert steps == [1, 2, 3]
    trainable = [n for n, p in backbone.named_parameters() if p.requires_grad]
    assert trainable == ["embedding.weight"]


def test_a_run_whose_pretrained_weights_changed_is_refused_by_name(
    pretrained_run: Path, tmp_path: Path
) -> None:
    # Prepare: a run (with its own pretrained file) that records its pretrained weights
    dest = tmp_path / "run"
    shutil.copytree(pretrained_run, dest)
    raw = tomllib.loads((dest / "config.toml").read_text())
    shutil.copy(raw["model"]["pretrained"], tmp_path / "pretrained.safetensors")
    raw["model"]["pretrained"] = str(tmp_path / "pretrained.safetensors")
    (dest / "config.toml").write_text(config_to_toml(config_from_dict(raw)))
    config = load_run(dest).config
    summary = json.loads((dest / "summary.json").read_text())
    summary["provenance"] = {"pretrained": pretrained_provenance(config.model.pretrained)}
    (dest / "summary.json").write_text(json.dumps(summary))
    assert load_run(dest).checkpoint.round == 2  # the unchanged weights load
    other = build_model(config.model, 1, 32, seed=0).backbone  # the pretrained weights ...
    with torch.no_grad():
        next(other.parameters()).add_(1.0)  # ... changed
    save_weights(other, Path(config.model.pretrained))
    # Execute / Assert: the frozen trunk would come from other weights: refused, naming them
    with pytest.raises(CheckpointError, match=r"started from model.pretrained = .* with SHA-256 "
                       r"[0-9a-f]{64} .*but those weights are now [0-9a-f]{64}"):  # fmt: skip
        load_run(dest)


def _identity_folders(root: Path, identities: int = 24, per_identity: int = 10) -> Path:
    """Synthetic faces written as identity folders: a run that reads them is a run on
    ``data.source = "folders"``, which the audit and the report treat as real faces."""
    from PIL import Image

    faces = generate_synthetic_faces(
        SyntheticFaceConfig(num_identities=identities, images_per_identity=per_identity,
                            image_size=32, seed=3)
    )  # fmt: skip
    pixels = ((faces.images.permute(0, 2, 3, 1) + 1) * 127.5).round().clamp(0, 255).byte()
    for n, (image, label) in enumerate(zip(pixels.numpy(), faces.labels.tolist(), strict=True)):
        folder = root / f"person_{label:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{n:04d}.png")
    return root


def test_grids_of_a_folders_run_are_written_and_reported_only_when_asked(tmp_path: Path) -> None:
    # Prepare: a pretrained, partly frozen run on identity folders (real faces, as far as the
    # audit and the report can tell)
    raw = _pretrained_config(tmp_path)
    raw["data"] = {"source": "folders", "path": str(_identity_folders(tmp_path / "faces")),
                   "image_size": 32, "held_out_identities": 6, "test_fraction": 0.3}  # fmt: skip
    run = write_simulated_run(config_from_dict(raw), tmp_path / "runs")
    quick = AuditSettings(attacks=("inversion", "templates"), targets=2, steps=2, restarts=1,
                          prior_components=4, evaluator_epochs=1)  # fmt: skip
    # Execute: the audit and the report without --include-images
    found = audit_run(run, quick)
    write_report(run, ["md"])
    # Assert: no grid anywhere, and the results say why
    assert found["images"] == "no grids: real faces (use --include-images)"
    assert found["attacks"]["templates"]["server"]["applicable"] is True
    assert sorted(run.rglob("*.png")) == []
    # with --include-images the audit writes its grids, and only then the report has them
    audit_run(run, dataclasses.replace(quick, include_images=True))
    grids = sorted(p.name for p in (run / "audit").glob("*.png"))
    assert grids == ["inversion-global-head_row.png"]
    write_report(run, ["md"])
    assert sorted((run / "report").glob("*.png")) == []
    write_report(run, ["md"], include_images=True)
    assert sorted(p.name for p in (run / "report").glob("*.png")) == grids
