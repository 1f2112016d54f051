"""Per-example clipping without per-example gradients: book-keeping with mixed ghost norms.

DP-SGD (Abadi et al., CCS 2016, Algorithm 1) needs, per step, the sum over the batch of each
example's gradient clipped to L2 norm ``C``::

    sum_i  c_i * grad l_i,      c_i = min(1, C / (||grad l_i|| + 1e-6))

(Opacus' clipping factor). Opacus' hooks mode materialises every ``grad l_i``: a
``[B, *param.shape]`` tensor per parameter, ~176 MB per step for the default backbone at
batch 32, written, clipped and summed. For a layer ``y = a W`` the example's gradient is a
product of two things one backward pass already has, the layer's input ``a_i`` and the
gradient ``g_i = dl_i/dy_i``: ``grad_W l_i = g_i^T a_i``. This module uses that twice:

1. **Norms** (the "ghost norm", Goodfellow 2015 for one position; Li, Tramer, Liang &
   Hashimoto, ICLR 2022 for sequences/convolutions): with ``T`` output positions,
   ``||g_i^T a_i||_F^2 = <a_i a_i^T, g_i g_i^T>`` costs ``T^2 (p + q)`` instead of ``T p q``
   for a ``p``-input, ``q``-output layer. The cheaper of the two is taken per layer (the
   "mixed ghost clipping" of Bu, Mao & Xu, NeurIPS 2022): convolutions at high resolution
   materialise their small per-example gradient (never stored), deep layers with few
   positions use the ghost norm.
2. **Clipped sum** ("book-keeping", Bu, Wang, Zha & Karypis, "Differentially Private
   Optimization on Large Model at Small Cost", ICML 2023): ``sum_i c_i g_i^T a_i`` is the
   ordinary weight gradient of the layer with its output gradients scaled by ``c_i``, one
   matrix product (``convolution_backward`` for convolutions), so no second backward pass
   is needed.

The backward pass itself asks autograd only for the gradients with respect to the layers'
outputs, so the weight gradients are computed once, already clipped.

Supported layers (every trainable module must be one of them; :func:`unsupported_modules`
names the others, and :mod:`privacy.dp.dpsgd` then falls back to Opacus' hooks):
``nn.Conv2d`` (zero padding, ``groups = 1``), ``nn.Linear``, ``nn.GroupNorm`` and the margin
heads' :class:`~fl_secure.models.heads.CosineClassifier` (per-example gradient of the row-
normalised class embeddings: row ``j`` of example ``i`` is
``g_ij (e_i - cos_ij w_j) / |W_j|`` with unit ``e_i``, ``w_j``, so its squared norm is
``g_ij^2 (|e_i|^2 - cos_ij^2) / |W_j|^2``). Each module must run once per forward pass
(no parameter tying). Results equal Opacus' hooks mode up to float rounding; the tests pin
both against a per-example loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fl_secure.errors import PrivacyError
from fl_secure.models.heads import CosineClassifier

#: Opacus' clipping factor ``min(1, C / (norm + EPS))``.
EPS = 1e-6

_SUPPORTED = (nn.Conv2d, nn.Linear, nn.GroupNorm, CosineClassifier)


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def unsupported_modules(model: nn.Module) -> list[str]:
    """Names (with types) of trainable modules the book-keeping engine cannot clip."""
    found = []
    for name, module in model.named_modules():
        if not _trainable(module):
            continue
        why = ""
        if type(module) not in _SUPPORTED:
            why = "no book-keeping rule"
        elif isinstance(module, nn.Conv2d) and (
            module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str)
        ):
            why = "grouped, non-zero-padded or 'same'-padded convolution"
        if why:
            found.append(f"{name or '<model>'} ({type(module).__name__}: {why})")
    return found


def require_supported(model: nn.Module) -> None:
    """Raise unless the book-keeping engine can clip every trainable module of ``model``.

    Raises:
        PrivacyError: naming every unsupported module (:func:`unsupported_modules`).
    """
    unsupported = unsupported_modules(model)
    if unsupported:
        raise PrivacyError(
            "book-keeping clipping cannot handle " + "; ".join(unsupported) + ": use "
            "privacy.clipping = 'opacus' (per-example gradients from Opacus' hooks)"
        )


def _sum_to_sample(t: torch.Tensor) -> torch.Tensor:
    """``[B, ...]`` -> ``[B]``: sum over every dimension but the first."""
    return t.reshape(len(t), -1).sum(1)


def _position_norms2(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Squared Frobenius norms of ``g_i^T a_i`` for ``a: [B, T, p]``, ``g: [B, T, q]``.

    Ghost norm ``<a a^T, g g^T>`` when ``T^2 (p + q) < T p q`` (few positions), else the
    per-example product itself (transient, one layer at a time).
    """
    positions, p, q = a.shape[1], a.shape[2], g.shape[2]
    if positions == 1:
        return _sum_to_sample(a.square()) * _sum_to_sample(g.square())
    if positions * (p + q) < p * q:
        aat = torch.bmm(a, a.transpose(1, 2))
        ggt = torch.bmm(g, g.transpose(1, 2))
        return _sum_to_sample(aat * ggt)
    return _sum_to_sample(torch.bmm(g.transpose(1, 2), a).square())


def _conv_weight_norms2(conv: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Squared norms of the per-example weight gradients of a ``groups = 1`` convolution.

    Few output positions: the ghost norm on the unfolded input. Many: the per-example
    gradients themselves, as one convolution backward with the batch as groups (input
    ``[1, B * C_in, H, W]``, ``groups = B``), which beats unfolding when the input is large.
    """
    batch, q = g.shape[0], g.shape[1]
    positions = g.shape[2] * g.shape[3]
    p = conv.weight[0].numel()
    padding = conv.padding
    assert not isinstance(padding, str)  # excluded by unsupported_modules
    if positions * (p + q) < p * q:
        cols = F.unfold(a, conv.kernel_size, conv.dilation, padding, conv.stride)  # [B, p, T]
        return _position_norms2(cols.transpose(1, 2), g.flatten(2).transpose(1, 2))
    weight = conv.weight.detach()
    per_example = torch.ops.aten.convolution_backward(
        g.reshape(1, batch * q, *g.shape[2:]),
        a.reshape(1, -1, *a.shape[2:]),
        weight.expand(batch, *weight.shape).reshape(batch * q, *weight.shape[1:]),
        None,
        conv.stride,
        padding,
        conv.dilation,
        False,
        [0, 0],
        batch,
        [False, True, False],
    )[1]
    return _sum_to_sample(per_example.reshape(batch, -1).square())


class BookKeepingClipper:
    """Computes the clipped sum of per-example gradients of ``model`` into ``p.grad``.

    Use :meth:`attached` around the training loop: it registers forward hooks that record
    each supported module's input and output. After a forward pass producing per-example
    losses ``losses`` (``[B]``, unreduced), :meth:`clip_and_sum` sets ``p.grad`` of every
    trainable parameter to ``sum_i c_i grad l_i`` and returns the per-example norms.

    Raises:
        PrivacyError: if a trainable module is unsupported (see :func:`unsupported_modules`)
            or runs more than once in one forward pass.
    """

    def __init__(self, model: nn.Module, max_grad_norm: float) -> None:
        require_supported(model)
        self.max_grad_norm = max_grad_norm
        self.modules = {name: m for name, m in model.named_modules() if _trainable(m)}
        self._names = {id(m): name for name, m in self.modules.items()}
        self._records: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @contextmanager
    def attached(self) -> Iterator[BookKeepingClipper]:
        """Record the supported modules' inputs and outputs while the block runs."""
        handles = [m.register_forward_hook(self._record) for m in self.modules.values()]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self._records.clear()

    def _record(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if not torch.is_grad_enabled() or not module.training:
            return
        name = self._names[id(module)]
        if name in self._records:
            self._records.clear()
            raise PrivacyError(
                f"module {name} ran twice in one forward pass: book-keeping clipping needs "
                "each trainable module once (use privacy.clipping = 'opacus')"
            )
        self._records[name] = (inputs[0].detach(), output)

    def zero_grads(self) -> None:
        """``p.grad = 0`` for every trainable parameter (an empty Poisson batch)."""
        for module in self.modules.values():
            for p in _trainable(module):
                p.grad = torch.zeros_like(p)

    def clip_and_sum(self, losses: torch.Tensor) -> torch.Tensor:
        """Set ``p.grad = sum_i c_i grad l_i``; return the per-example gradient norms ``[B]``.

        ``losses`` are the batch's per-example losses from the forward pass just recorded.
        """
        records, self._records = self._records, {}
        missing = [name for name in self.modules if name not in records]
        if missing:
            raise PrivacyError(
                f"modules {missing} did not run in the forward pass: their parameters would "
                "get no clipped gradient"
            )
        names = list(self.modules)
        outputs = [records[name][1] for name in names]
        # Gradients w.r.t. the modules' outputs only: autograd skips the weight gradients.
        backprops = torch.autograd.grad(losses.sum(), outputs, allow_unused=True)
        batch = len(losses)
        norms2 = losses.new_zeros(batch)
        keep: dict[str, Any] = {}
        for name, g in zip(names, backprops, strict=True):
            module, (a, out) = self.modules[name], records[name]
            if g is None:
                g = torch.zeros_like(out)
            n2, extra = self._norms2(module, a, out.detach(), g)
            norms2 += n2
            keep[name] = (a, g, extra)
        norms = norms2.clamp_min(0).sqrt()
        factors = (self.max_grad_norm / (norms + EPS)).clamp(max=1.0)
        for name in names:
            a, g, extra = keep[name]
            self._clipped_grads(self.modules[name], a, g, extra, factors)
        return norms

    @staticmethod
    def _norms2(
        module: nn.Module, a: torch.Tensor, out: torch.Tensor, g: torch.Tensor
    ) -> tuple[torch.Tensor, Any]:
        """Squared per-example gradient norms of ``module``'s trainable parameters."""
        batch = len(g)
        n2 = g.new_zeros(batch)
        if isinstance(module, nn.Conv2d):
            if module.weight.requires_grad:
                n2 += _conv_weight_norms2(module, a, g)
            if module.bias is not None and module.bias.requires_grad:
                n2 += g.sum((2, 3)).square().sum(1)
            return n2, None
        if isinstance(module, nn.Linear):
            a3 = a.reshape(batch, -1, a.shape[-1])
            g3 = g.reshape(batch, -1, g.shape[-1])
            if module.weight.requires_grad:
                n2 += _position_norms2(a3, g3)
            if module.bias is not None and module.bias.requires_grad:
                n2 += g3.sum(1).square().sum(1)
            return n2, None
        if isinstance(module, nn.GroupNorm):
            normalised = F.group_norm(a, module.num_groups, eps=module.eps)
            dims = tuple(range(2, g.dim()))
            per_weight = (g * normalised).sum(dims) if dims else g * normalised  # [B, C]
            per_bias = g.sum(dims) if dims else g
            if module.weight.requires_grad:
                n2 += per_weight.square().sum(1)
            if module.bias.requires_grad:
                n2 += per_bias.square().sum(1)
            return n2, (per_weight, per_bias)
        if isinstance(module, CosineClassifier):
            row_norms2 = module.weight.detach().square().sum(1).clamp_min(1e-24)  # [C]
            e = F.normalize(a, dim=1)
            e_norms2 = e.square().sum(1, keepdim=True)  # 1, or 0 for a zero embedding
            n2 += (g.square() * (e_norms2 - out.square()).clamp_min(0) / row_norms2).sum(1)
            return n2, None
        raise AssertionError(type(module))  # excluded by unsupported_modules

    @staticmethod
    def _clipped_grads(
        module: nn.Module, a: torch.Tensor, g: torch.Tensor, extra: Any, factors: torch.Tensor
    ) -> None:
        """``p.grad = sum_i c_i grad_p l_i`` for ``module``'s trainable parameters."""
        scaled = g * factors.view(-1, *([1] * (g.dim() - 1)))
        if isinstance(module, nn.Conv2d):
            want_w = module.weight.requires_grad
            want_b = module.bias is not None and module.bias.requires_grad
            _, grad_w, grad_b = torch.ops.aten.convolution_backward(
                scaled,
                a,
                module.weight.detach(),
                [module.out_channels] if module.bias is not None else None,
                module.stride,
                module.padding,
                module.dilation,
                False,
                [0, 0],
                module.groups,
                [False, want_w, want_b],
            )
            if want_w:
                module.weight.grad = grad_w
            if want_b:
                assert module.bias is not None
                module.bias.grad = grad_b
        elif isinstance(module, nn.Linear):
            a2 = a.reshape(-1, a.shape[-1])
            s2 = scaled.reshape(-1, scaled.shape[-1])
            if module.weight.requires_grad:
                module.weight.grad = s2.t() @ a2
            if module.bias is not None and module.bias.requires_grad:
                module.bias.grad = s2.sum(0)
        elif isinstance(module, nn.GroupNorm):
            per_weight, per_bias = extra
            if module.weight.requires_grad:
                module.weight.grad = factors @ per_weight
            if module.bias.requires_grad:
                module.bias.grad = factors @ per_bias
        elif isinstance(module, CosineClassifier):
            with torch.enable_grad():
                weight = module.weight.detach().requires_grad_()
                cosines = F.linear(F.normalize(a, dim=1), F.normalize(weight, dim=1))
                (module.weight.grad,) = torch.autograd.grad(cosines, weight, scaled)
        else:  # pragma: no cover - excluded by unsupported_modules
            raise AssertionError(type(module))
