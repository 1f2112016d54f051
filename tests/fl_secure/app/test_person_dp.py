"""Person-level DP rounds: devices independent, clipping, the noise released, the accounting."""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opacus.accountants import RDPAccountant

from fl_secure.app.person_dp import (
    EmbeddingLayer,
    PersonDPSettings,
    clip_rows,
    local_updates,
    private_round,
    public_representations,
    run_person_dp,
    spent_epsilon,
)
from fl_secure.errors import ConfigError
from privacy.dp.noise import SeededGaussian

IN, OUT = 12, 6


def _layer(seed: int = 0) -> EmbeddingLayer:
    g = torch.Generator().manual_seed(seed)
    return EmbeddingLayer(torch.randn(OUT, IN, generator=g) * 0.3, torch.zeros(OUT))


def _features(devices: int, images: int = 4, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(devices, 1, IN, generator=g)
    return centres + 0.3 * torch.randn(devices, images, IN, generator=g)


def _negatives(count: int = 5, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(count, OUT, generator=g), dim=1)


def test_a_device_update_does_not_depend_on_the_rest_of_its_cohort() -> None:
    # Prepare
    layer, feats, negs = _layer(), _features(6), _negatives()
    s = PersonDPSettings(local_steps=3, local_lr=0.2)
    # Execute: the cohort together, then device 4 alone
    together = local_updates(layer, feats, negs, s)
    alone = local_updates(layer, feats[4:5], negs, s)
    # Assert: vectorising over devices mixes nothing
    assert together.shape == (6, OUT * IN + OUT)
    torch.testing.assert_close(together[4], alone[0], rtol=1e-5, atol=1e-6)
    assert together.norm(dim=1).min() > 0  # every device moved


def test_local_steps_lower_the_device_loss_against_the_public_negatives() -> None:
    layer, feats, negs = _layer(), _features(1, images=8), _negatives()
    s = PersonDPSettings(local_steps=20, local_lr=0.05, margin=0.0)

    def loss(lay: EmbeddingLayer) -> float:
        emb = F.normalize(lay.embed(feats[0]), dim=1)
        own = F.normalize(emb.mean(dim=0), dim=0)
        logits = s.scale * torch.cat([(emb @ own)[:, None], emb @ negs.T], dim=1)
        return float(F.cross_entropy(logits, torch.zeros(8, dtype=torch.long)))

    after = layer.stepped(local_updates(layer, feats, negs, s)[0])
    assert loss(after) < loss(layer)


def test_clip_rows_bounds_each_update_and_keeps_small_ones() -> None:
    updates = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    clipped = clip_rows(updates, 1.0)
    torch.testing.assert_close(clipped[0], torch.tensor([0.6, 0.8]))
    torch.testing.assert_close(clipped[1:], updates[1:])


def test_public_representations_are_unit_means_of_unit_embeddings() -> None:
    layer = _layer()
    feats = torch.randn(9, IN)
    labels = torch.tensor([5, 5, 5, 7, 7, 9, 9, 9, 9])
    reps = public_representations(layer, feats, labels)
    unit = F.normalize(layer.embed(feats), dim=1)
    expected = F.normalize(unit[3:5].mean(dim=0), dim=0)
    assert reps.shape == (3, OUT)
    torch.testing.assert_close(reps[1], expected)
    torch.testing.assert_close(reps.norm(dim=1), torch.ones(3))


def test_the_release_is_the_clipped_sum_plus_noise_of_std_z_c_over_the_expected_cohort() -> None:
    # Prepare: every device in the cohort (q = 1), updates far above the clip norm
    layer, feats, negs = _layer(), _features(5), _negatives()
    s = PersonDPSettings(
        sample_rate=1.0, clip_norm=0.01, noise_multiplier=2.0, local_steps=2, local_lr=0.5,
        server_lr=1.0,
    )  # fmt: skip
    # Execute
    new, record = private_round(layer, feats, negs, s, SeededGaussian(11))
    # Assert: the same draws (5 uniforms, then the noise) give the release exactly
    replay = SeededGaussian(11)
    replay.uniform(5)
    noise = torch.from_numpy(replay.standard_normal(OUT * IN + OUT) * 2.0 * 0.01).float()
    clipped = clip_rows(local_updates(layer, feats, negs, s), 0.01).sum(dim=0)
    torch.testing.assert_close(new.flat(), layer.flat() + (clipped + noise) / 5, atol=1e-6, rtol=0)
    assert record.cohort == 5
    assert record.mean_update_norm == pytest.approx(0.01, rel=1e-4)  # every update clipped


def test_poisson_cohorts_have_the_sampled_size_on_average() -> None:
    layer, feats, negs = _layer(), _features(200, images=2), _negatives()
    s = PersonDPSettings(rounds=10, sample_rate=0.1, noise_multiplier=1.0, local_steps=1)
    _, records = run_person_dp(layer, feats, torch.randn(10, IN), torch.arange(10), s,
                               SeededGaussian(3))  # fmt: skip
    sizes = [r.cohort for r in records]
    assert 10 <= np.mean(sizes) <= 30 and len(set(sizes)) > 1  # Binomial(200, 0.1)
    assert all(r.noise_norm > 0 for r in records)
    del negs


@pytest.mark.parametrize(("z", "q", "rounds"), [(0.81, 0.2, 30), (3.0, 0.05, 50)])
def test_spent_epsilon_matches_dp_accounting_and_opacus(z: float, q: float, rounds: int) -> None:
    s = PersonDPSettings(rounds=rounds, sample_rate=q, noise_multiplier=z)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds
    )
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(event)
    assert spent_epsilon(s, 1e-3, "pld") == pytest.approx(pld.get_epsilon(1e-3), rel=0.02)
    rdp = RDPAccountant()  # Opacus's orders and conversion, which the rdp accountant uses
    rdp.history = [(z, q, rounds)]
    assert spent_epsilon(s, 1e-3, "rdp") == pytest.approx(rdp.get_epsilon(1e-3), rel=1e-9)


def test_settings_refuse_impossible_values() -> None:
    with pytest.raises(ConfigError, match="sample_rate"):
        PersonDPSettings(sample_rate=0.0)
    with pytest.raises(ConfigError, match="clip_norm"):
        PersonDPSettings(clip_norm=0.0)
    assert spent_epsilon(PersonDPSettings(), 1e-3) == float("inf")  # no noise: no guarantee
