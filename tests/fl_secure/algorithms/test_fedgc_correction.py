"""FedGC's server correction: the paper's step ``lambda * eta`` and a logit scale in Eq. 5.

FedGC paper, Algorithm 1 line 13: ``W <- W~ - lambda * eta * grad Reg(W~)`` with the paper's
``lambda = 20`` (Table 2) and constant ``eta = 0.1`` (Table 5), whatever the clients' own
optimiser. On a margin head's unit rows Reg takes the head's logit scale ``s``:
``-log(e^s / (e^s + sum_{cross} e^{s cos}))``.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

from fl_secure.algorithms import get_strategy
from fl_secure.algorithms.fedgc import WEIGHT, FedGC, softmax_regularizer
from fl_secure.config import AlgorithmConfig
from fl_secure.errors import ConfigError
from fl_secure.messages import Tensors

CLIENTS, CLASSES, DIM, SCALE = 4, 10, 128, 30.0


def _overlapping_heads(noise: float = 0.3) -> dict[str, Tensors]:
    """Each client's class ``j`` near one shared direction: cross-client rows with cos ~0.92.

    The paper's motivating failure (section 3): private heads trained apart put different
    clients' classes on overlapping directions.
    """
    rng = np.random.default_rng(0)
    shared = rng.standard_normal((CLASSES, DIM))
    return {
        f"client-{k}": OrderedDict([(WEIGHT, shared + noise * rng.standard_normal((CLASSES, DIM)))])
        for k in range(CLIENTS)
    }


def _unit(w: np.ndarray) -> np.ndarray:
    return w / np.linalg.norm(w, axis=1, keepdims=True)


def _stack(heads: dict[str, Tensors]) -> np.ndarray:
    return np.concatenate([np.asarray(heads[c][WEIGHT], np.float64) for c in sorted(heads)])


def _nearest_cross_client_cosine(w: np.ndarray) -> float:
    """Mean over rows of the cosine to the closest row of another client."""
    u = _unit(w)
    cos = u @ u.T
    owners = np.repeat(np.arange(CLIENTS), CLASSES)
    cos[owners[:, None] == owners[None, :]] = -np.inf
    return float(cos.max(axis=1).mean())


def test_the_papers_step_turns_overlapping_cross_client_rows_in_one_round() -> None:
    # Prepare: the default FedGC of a CosFace run (lambda 20, eta 0.1, s = 30); the clients
    # train with Adam at 1e-3, the round learning rate the server is handed
    heads = _overlapping_heads()
    strategy = get_strategy("fedgc", AlgorithmConfig(name="fedgc"), head="cosface")
    before = _stack(heads)
    # Execute
    after = _stack(strategy.server_heads(heads, learning_rate=1e-3, round_=1))
    late = _stack(strategy.server_heads(heads, learning_rate=5e-4, round_=10))
    # Assert: every row turns by at least 1 degree (measured 1.19-2.08; lambda times the
    # clients' lr, 0.02 without a scale, turned them by 0.0018-0.0032 degrees) ...
    angles = np.degrees(np.arccos(np.clip((_unit(before) * _unit(after)).sum(1), -1, 1)))
    assert angles.min() > 1.0
    # ... the overlapping pairs separate (nearest cross-client cosine 0.9236 -> 0.9046; it
    # was 0.9236 -> 0.9236 with lambda times the clients' lr) ...
    assert _nearest_cross_client_cosine(before) - _nearest_cross_client_cosine(after) > 0.015
    # ... and the step does not follow the clients' learning-rate schedule
    np.testing.assert_array_equal(after, late)


def _eq5_scaled(w: torch.Tensor, owners: torch.Tensor, s: float) -> torch.Tensor:
    """Eq. 5 on unit rows at logit scale ``s``, one anchor at a time (anchors constant)."""
    u = w / w.norm(dim=1, keepdim=True)
    total = w.new_zeros(())
    for a in range(len(w)):
        anchor = u[a].detach()
        others = u[owners != owners[a]]
        logits = torch.cat([(s * anchor @ anchor).reshape(1), s * (others @ anchor)])
        total = total - (logits[0] - torch.logsumexp(logits, dim=0))
    return total


def _eq11_scaled(w: np.ndarray, owners: np.ndarray, s: float) -> np.ndarray:
    """The closed form: dReg/du_b = s sum_a p(b | a) u_a, through u = W / |W|."""
    u = _unit(w)
    grad_u = np.zeros_like(w)
    for a in range(len(w)):
        cross = owners != owners[a]
        terms = np.exp(s * (u[cross] @ u[a]) - s)  # e^{s cos} / e^{s}, overflow-free
        p = terms / (1.0 + terms.sum())
        grad_u[cross] += s * p[:, None] * u[a]
    norms = np.linalg.norm(w, axis=1, keepdims=True)
    radial = (grad_u * u).sum(axis=1, keepdims=True) * u
    return (grad_u - radial) / norms


def test_the_correction_is_lambda_eta_times_the_gradient_of_scaled_eq5() -> None:
    # Prepare: float64 heads; a CosFace run's default FedGC (lambda 20, eta 0.1, s = 30)
    heads = _overlapping_heads()
    w = _stack(heads)
    owners = np.repeat(np.arange(CLIENTS), CLASSES)
    strategy = get_strategy("fedgc", AlgorithmConfig(name="fedgc"), head="cosface")
    # Execute: the server's step, autograd on Eq. 5 written out, and its closed form (Eq. 11)
    got = _stack(strategy.server_heads(heads, learning_rate=1e-3, round_=1))
    wt = torch.from_numpy(w).requires_grad_(True)
    (autograd,) = torch.autograd.grad(_eq5_scaled(wt, torch.from_numpy(owners), SCALE), [wt])
    closed = _eq11_scaled(w, owners, SCALE)
    # Assert: W - lambda * eta * grad Reg, with lambda * eta = 2
    np.testing.assert_allclose(autograd.numpy(), closed, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got, w - 2.0 * closed, rtol=1e-10, atol=1e-12)
    # the module's regulariser is the same function at this scale
    who = torch.from_numpy(owners)
    reg = softmax_regularizer(wt.detach(), who, scale=SCALE)
    assert float(reg) == pytest.approx(float(_eq5_scaled(wt.detach(), who, SCALE)), rel=1e-12)
    # and the full step of 2 lowers it (measured 9.18 -> 5.44)
    after = softmax_regularizer(torch.from_numpy(got), who, scale=SCALE)
    assert float(after) < float(reg)


def test_the_scale_comes_from_the_run_and_the_keys_are_checked() -> None:
    arcface = get_strategy("fedgc", AlgorithmConfig(name="fedgc"), head="arcface", scale=8.0)
    assert isinstance(arcface, FedGC) and arcface.scale == 8.0 and arcface.reg_eta == 0.1
    own = get_strategy(
        "fedgc", AlgorithmConfig(name="fedgc", reg_scale=16.0), head="arcface", scale=8.0
    )
    assert isinstance(own, FedGC) and own.scale == 16.0
    # Eq. 5 verbatim on a softmax head's raw rows, and FedCos's W^T W: no scale
    softmax = get_strategy("fedgc", AlgorithmConfig(name="fedgc"), head="softmax", scale=30.0)
    fedcos = get_strategy("fedcos", AlgorithmConfig(name="fedcos"), head="cosface", scale=30.0)
    assert isinstance(softmax, FedGC) and softmax.scale == 1.0
    assert isinstance(fedcos, FedGC) and fedcos.scale == 1.0
    assert AlgorithmConfig().reg_eta == 0.1 and AlgorithmConfig().reg_scale == 0.0
    for key, bad in (("reg_eta", 0.0), ("reg_eta", float("nan")), ("reg_scale", -1.0),
                     ("reg_scale", float("inf"))):  # fmt: skip
        with pytest.raises(ConfigError, match=f"algorithm.{key}"):
            AlgorithmConfig(**{key: bad})


def test_a_logit_scale_the_design_would_ignore_is_refused() -> None:
    from fl_secure.algorithms import check_config
    from fl_secure.config import Config, ModelConfig

    scaled = AlgorithmConfig(name="fedgc", reg_scale=16.0)
    check_config(Config(algorithm=scaled, model=ModelConfig(head="arcface")))
    with pytest.raises(ConfigError, match="algorithm.reg_scale = 16 .* model.head = 'softmax'"):
        check_config(Config(algorithm=scaled, model=ModelConfig(head="softmax")))
    for name in ("fedcos", "fedpe"):
        with pytest.raises(ConfigError, match=f"ignored by {name}"):
            check_config(Config(algorithm=AlgorithmConfig(name=name, reg_scale=16.0)))
