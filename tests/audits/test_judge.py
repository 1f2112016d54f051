"""The independent evaluator: real images of a target are judged as that target."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from audits.canary import clopper_pearson_interval
from audits.image_metrics import psnr, ssim, to_unit_range
from audits.judge import EvaluatorConfig, judge, train_evaluator


def test_private_images_score_perfectly_against_themselves(faces) -> None:
    images = faces.targets.images[faces.private]
    labels = faces.targets.labels[faces.private]
    result = judge(faces.evaluator, images, labels, images, labels)
    assert result.top1 == 1.0 and result.top5 == 1.0
    assert result.knn_distance == pytest.approx(0.0, abs=1e-6)  # nearest image is itself
    assert result.ssim == pytest.approx(1.0) and result.psnr == float("inf")
    assert torch.equal(result.nearest, torch.arange(len(images)))
    assert result.chance_top1 == 0.1 and result.chance_top5 == 0.5
    # every other target is further away and less alike than the target itself
    assert result.chance_knn_distance > 0.5  # measured 1.37 (unit features: 0 .. 2)
    assert result.chance_ssim < 0.9 and result.chance_psnr < 30  # measured 0.10, 9.7 dB
    assert result.top1_ci95 == pytest.approx((0.025 ** (1 / 80), 1.0))  # 80 of 80: closed form


def test_held_out_real_images_beat_chance_and_noise_does_not(faces) -> None:
    # Images 0..7 of each target were never seen by the evaluator (the attacked model's data).
    held = ~faces.private
    private_images = faces.targets.images[faces.private]
    private_labels = faces.targets.labels[faces.private]
    real = judge(faces.evaluator, faces.targets.images[held], faces.targets.labels[held],
                 private_images, private_labels)  # fmt: skip
    assert real.top1 >= 0.8  # measured 0.9+ ; chance 0.1
    g = torch.Generator().manual_seed(0)
    noise = (0.5 * torch.randn(40, 3, 32, 32, generator=g)).clamp(-1, 1)
    targets = torch.arange(40) % 10
    fake = judge(faces.evaluator, noise, targets, private_images, private_labels)
    assert fake.top1 <= 0.3
    assert fake.knn_distance > real.knn_distance
    assert fake.ssim < real.ssim
    # real faces of the target sit closer to it than to the other targets ...
    assert real.knn_distance < real.chance_knn_distance
    assert real.ssim > real.chance_ssim and real.psnr > real.chance_psnr
    # ... noise, aimed at no one, scores its chance level on every measure
    gap = real.chance_knn_distance - real.knn_distance
    assert abs(fake.knn_distance - fake.chance_knn_distance) < 0.25 * gap
    assert fake.ssim == pytest.approx(fake.chance_ssim, abs=0.02)
    assert fake.psnr == pytest.approx(fake.chance_psnr, abs=0.5)
    summary = fake.summary()
    assert summary["num_reconstructions"] == 40 and summary["chance_top1"] == 0.1


def test_judge_rejects_a_target_without_private_images(faces) -> None:
    images = faces.targets.images[:2]
    with pytest.raises(ValueError, match="no private image"):
        judge(faces.evaluator, images, torch.tensor([0, 3]), images, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="one target"):
        judge(faces.evaluator, images, torch.tensor([0, 0]), images, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="no reconstructions"):
        judge(faces.evaluator, images[:0], torch.tensor([], dtype=torch.int64), images,
              torch.tensor([0, 1]))  # fmt: skip


def test_chance_levels_are_the_measures_against_every_other_target(faces) -> None:
    # reference: a plain loop over (reconstruction, other target) pairs
    private_images = faces.targets.images[faces.private]
    private_labels = faces.targets.labels[faces.private]
    g = torch.Generator().manual_seed(1)
    recon = faces.targets.images[~faces.private][torch.randperm(80, generator=g)[:12]]
    targets = torch.randint(0, 10, (12,), generator=g)
    result = judge(faces.evaluator, recon, targets, private_images, private_labels)
    feats = faces.evaluator.features(recon).double()
    private_feats = faces.evaluator.features(private_images).double()
    knn, ssims, psnrs = [], [], []
    for i in range(12):
        for other in range(10):
            if other == int(targets[i]):
                continue
            idx = (private_labels == other).nonzero().flatten()
            d = (private_feats[idx] - feats[i]).norm(dim=1)
            j = idx[int(d.argmin())]
            knn.append(float(d.min()))
            a, b = to_unit_range(recon[i : i + 1]), to_unit_range(private_images[j : j + 1])
            ssims.append(float(ssim(a, b)[0]))
            psnrs.append(float(psnr(a, b)[0]))
    assert len(knn) == 12 * 9
    assert result.chance_knn_distance == pytest.approx(sum(knn) / len(knn), rel=1e-9)
    assert result.chance_ssim == pytest.approx(sum(ssims) / len(ssims), rel=1e-5)
    assert result.chance_psnr == pytest.approx(sum(psnrs) / len(psnrs), rel=1e-5)


@pytest.mark.parametrize(("k", "n"), [(0, 10), (3, 10), (10, 10), (7, 40), (1, 1)])
def test_clopper_pearson_interval_matches_scipy(k: int, n: int) -> None:
    reference = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    low, high = clopper_pearson_interval(k, n)
    assert low == pytest.approx(reference.low, abs=1e-12)
    assert high == pytest.approx(reference.high, abs=1e-12)


def test_judge_reports_the_interval_of_its_top1(faces) -> None:
    images = faces.targets.images[~faces.private][:10]
    labels = faces.targets.labels[~faces.private][:10]
    result = judge(faces.evaluator, images, labels, faces.targets.images[faces.private],
                   faces.targets.labels[faces.private])  # fmt: skip
    hits = round(result.top1 * 10)
    assert result.top1_ci95 == clopper_pearson_interval(hits, 10)
    assert result.top1_ci95[0] <= result.top1 <= result.top1_ci95[1]
    assert result.summary()["top1_ci95"] == list(result.top1_ci95)


def test_large_images_are_judged_averaged_down_to_32_px(faces) -> None:
    # Prepare: the targets at 128 px (dlib's chips are 150 px; cnn-small's features collapse
    # on such images: on LFW chips a 150-px judge named 0.14 of 10 targets, a 32-px one 0.50)
    large = F.interpolate(faces.targets.images, size=128, mode="bilinear", align_corners=False)
    private, labels = large[faces.private], faces.targets.labels[faces.private]
    # Execute
    evaluator = train_evaluator(private, labels, config=EvaluatorConfig(epochs=30, seed=2))
    # Assert: it sees the images averaged down to 32 px, and judges the same either way
    assert evaluator.input_size == 32
    small = F.adaptive_avg_pool2d(large, 32)
    assert torch.allclose(evaluator.features(large), evaluator.features(small))
    # images of the targets it never saw are named well above chance (0.10)
    held = evaluator.scores(large[~faces.private]).argmax(dim=1)
    assert float((held == faces.targets.labels[~faces.private]).float().mean()) > 0.6
    # a negative limit is refused by name
    with pytest.raises(ValueError, match="max_image_size must be >= 0"):
        EvaluatorConfig(max_image_size=-1)
