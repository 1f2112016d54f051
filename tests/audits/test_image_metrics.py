"""SSIM and PSNR against their definitions and known properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from audits.image_metrics import gaussian_window, psnr, ssim, to_unit_range


def _images(seed: int, n: int = 3, size: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g, dtype=torch.float64)


def test_window_is_a_normalised_gaussian() -> None:
    w = gaussian_window()
    assert w.shape == (11, 11) and float(w.sum()) == pytest.approx(1.0)
    assert float(w[5, 5]) == float(w.max())
    assert float(w[5, 6] / w[5, 5]) == pytest.approx(math.exp(-1 / (2 * 1.5**2)))


def test_ssim_identity_symmetry_and_noise() -> None:
    x, y = _images(0), _images(1)
    torch.testing.assert_close(ssim(x, x), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(ssim(x, y), ssim(y, x))
    g = torch.Generator().manual_seed(2)
    noise = torch.randn(x.shape, generator=g, dtype=torch.float64)
    values = [float(ssim(x, (x + s * noise).clamp(0, 1)).mean()) for s in (0.01, 0.05, 0.2, 0.5)]
    assert values == sorted(values, reverse=True) and values[0] > 0.95
    assert float(ssim(x, y).abs().max()) < 0.1  # independent noise images


def test_ssim_of_constant_images_is_the_luminance_term() -> None:
    # sigma terms vanish: SSIM = (2 a b + C1) / (a^2 + b^2 + C1), Wang et al. Eq. 13.
    a, b = 0.3, 0.7
    x, y = torch.full((1, 3, 16, 16), a), torch.full((1, 3, 16, 16), b)
    c1 = 0.01**2
    expected = (2 * a * b + c1) / (a * a + b * b + c1)
    assert float(ssim(x, y)) == pytest.approx(expected, rel=1e-6)


def test_ssim_of_one_window_is_wang_et_al_eq_13_with_c1_c2_of_eq_7() -> None:
    # An 11 x 11 pair is exactly one window: SSIM = l * c * s with Gaussian-weighted
    # statistics (sigma 1.5), C1 = (0.01 L)^2, C2 = (0.03 L)^2 (Wang et al. 2004, Eq. 7, 13)
    i = np.arange(11) - 5
    w = np.exp(-(i[:, None] ** 2 + i[None, :] ** 2) / (2 * 1.5**2))
    w /= w.sum()
    x = np.linspace(0.1, 0.9, 121).reshape(11, 11)
    y = np.clip(x**2 + 0.05 * np.sin(np.arange(121)).reshape(11, 11), 0, 1)
    mx, my = (w * x).sum(), (w * y).sum()
    vx, vy = (w * x * x).sum() - mx**2, (w * y * y).sum() - my**2
    cxy = (w * x * y).sum() - mx * my
    c1, c2 = 0.01**2, 0.03**2
    expected = (2 * mx * my + c1) * (2 * cxy + c2) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    got = ssim(torch.from_numpy(x)[None, None], torch.from_numpy(y)[None, None])
    assert 0.2 < expected < 0.99  # structure matters here, unlike constant images
    assert float(got) == pytest.approx(expected, rel=1e-10)


def test_psnr_reference_values() -> None:
    x = torch.zeros(2, 3, 8, 8)
    y = x.clone()
    y[0] += 0.1  # MSE 0.01 -> 20 dB
    y[1, :, :4] += 0.5  # MSE 0.125 -> 9.03 dB
    torch.testing.assert_close(
        psnr(x, y), torch.tensor([20.0, 10 * math.log10(8.0)], dtype=torch.float64)
    )
    assert math.isinf(float(psnr(x[:1], x[:1])))


def test_shape_checks_and_range_map() -> None:
    with pytest.raises(ValueError):
        ssim(torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 8))  # smaller than the window
    with pytest.raises(ValueError):
        psnr(torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 9))
    torch.testing.assert_close(to_unit_range(torch.tensor([-1.0, 0.0, 1.0, 3.0])),
                               torch.tensor([0.0, 0.5, 1.0, 1.0]))  # fmt: skip
