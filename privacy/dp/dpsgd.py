"""Example-level DP-SGD for a client's local training, with Opacus.

Implements DP-SGD as in Abadi et al., "Deep Learning with Differential Privacy" (CCS 2016),
Algorithm 1, on top of Opacus (Yousefpour et al., 2021):

1. **Poisson sampling.** Each logical step includes every local example independently with
   probability ``q`` (``sample_rate``), so batch sizes vary and may be 0; this is the
   sampling the subsampled-Gaussian accountants (RDP, PRV, PLD) analyse. The inclusion
   decisions are ``noise.uniform(n) < q``: sampling randomness matters for privacy
   amplification, so it comes from the same generator as the noise.
2. **Per-example clipping**: each example's gradient (over all parameters) is clipped to L2
   norm ``C`` (``max_grad_norm``) and the clipped gradients are summed, by one of two
   engines (``DPSGDSettings.clipping``) that give the same sum up to float rounding:

   - ``book-keeping`` (:mod:`privacy.dp.bookkeeping`, the default whenever every trainable
     layer is supported): per-example norms from the layers' inputs and output gradients
     (ghost norms where cheaper), then the clipped sum as one weight gradient per layer;
     nothing of size batch x parameters is ever stored. About 2.3x faster than the hooks on
     the default backbone (``benchmarks/dp.py``: 0.59x against 0.25x plain training).
   - ``opacus``: Opacus' hooks-based :class:`GradSampleModule` materialises every
     per-example gradient (registered grad samplers for ``Conv2d``, ``GroupNorm`` and
     ``Linear``; the margin heads' :class:`~fl_secure.models.heads.CosineClassifier` has no
     registered sampler, so Opacus falls back to ``torch.func`` for it, which is exact
     because the margin and the class mask act downstream of it) and Opacus'
     :class:`DPOptimizer` clips and sums them.
3. **Noise** by Opacus' optimizers (:class:`DPOptimizer`, or
   :class:`DPOptimizerFastGradientClipping` which takes the clipped sum as given): Gaussian
   noise of std ``sigma * C`` is added (``sigma`` = ``noise_multiplier``), and the sum is
   divided by the *expected* batch size ``max(1, round(q * n))`` (``loss_reduction="mean"``),
   then the underlying SGD or Adam step is taken. An empty batch still takes a step that
   adds only noise, as the analysis assumes.
4. **Bounded memory** with Opacus' :class:`BatchMemoryManager`: a logical batch is processed
   in physical batches of at most ``max_physical_batch_size`` examples whose clipped
   gradients are accumulated before the one noisy step.

The noise does not come from ``torch.normal`` (a Mersenne Twister) but from a
:class:`privacy.dp.noise.NoiseSource`, in production :class:`privacy.dp.noise.SecureGaussian`, a
ChaCha20 CSPRNG with the Box-Muller transform. Caveat: like every floating-point Gaussian
sampler it is in principle subject to the floating-point attacks of Mironov (CCS 2012); the
rigorous fix is integer noise (the distributed discrete Gaussian of Kairouz, Liu & Steinke,
ICML 2021). See :mod:`privacy.dp.noise`.

The guarantee covers the model parameters only. ``train_loss`` and ``train_accuracy``
returned by :func:`train_local_dpsgd` are computed from the sampled examples without noise;
they are for local logs and are not differentially private. The class mask (which
identities the client holds) is taken as public, fixed before training: removing the only
example of an identity would change the mask, which this example-level guarantee does not
cover.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus.utils.module_utils import trainable_modules
from opacus.validators import ModuleValidator
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from fl_secure.errors import PrivacyError
from fl_secure.messages import LocalTraining
from fl_secure.training import AbsentRows, FaceModel, LocalData, make_optimizer, parameter_groups
from privacy.dp.bookkeeping import BookKeepingClipper, require_supported, unsupported_modules
from privacy.dp.noise import NoiseSource, gaussian_tensor_like

logger = logging.getLogger(__name__)

#: How the clipped sum of per-example gradients is computed (see the module docstring).
Clipping = Literal["auto", "book-keeping", "opacus"]
CLIPPING_ENGINES: tuple[Clipping, ...] = ("auto", "book-keeping", "opacus")

#: What Opacus attaches to modules and parameters; none may remain after training.
OPACUS_MODULE_ATTRS = (
    "activations",
    "max_batch_len",
    "ft_compute_sample_grad",
    "autograd_grad_sample_hooks",
)
OPACUS_PARAM_ATTRS = ("grad_sample", "summed_grad", "_forward_counter", "_current_grad_sample")

_NO_INPUT_GRAD_WARNING = "Full backward hook is firing when gradients are computed"


@dataclass(frozen=True)
class DPSGDSettings:
    """Parameters of DP-SGD for one client's local training."""

    noise_multiplier: float  # sigma: noise std / max_grad_norm
    max_grad_norm: float  # per-example clipping bound C
    sample_rate: float  # Poisson inclusion probability q per step (expected batch = q * n)
    max_physical_batch_size: int = 64  # memory bound (BatchMemoryManager)
    clipping: Clipping = "auto"  # book-keeping if every layer is supported, else opacus

    def __post_init__(self) -> None:
        """Reject values DP-SGD is not defined for."""
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise PrivacyError(
                f"noise_multiplier = {self.noise_multiplier!r}: expected a finite number >= 0"
            )
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise PrivacyError(
                f"max_grad_norm = {self.max_grad_norm!r}: expected a finite number > 0"
            )
        _check_sample_rate(self.sample_rate)
        if self.max_physical_batch_size < 1:
            raise PrivacyError(
                f"max_physical_batch_size = {self.max_physical_batch_size}: expected >= 1"
            )
        if self.clipping not in CLIPPING_ENGINES:
            raise PrivacyError(
                f"clipping = {self.clipping!r}: expected one of {', '.join(CLIPPING_ENGINES)}"
            )


def _check_sample_rate(sample_rate: float) -> None:
    if not (math.isfinite(sample_rate) and 0.0 < sample_rate <= 1.0):
        raise PrivacyError(f"sample_rate = {sample_rate!r}: expected a number in (0, 1]")


def validate_model(model: nn.Module) -> None:
    """Check that Opacus can train ``model`` with per-example gradients.

    Runs Opacus' ``ModuleValidator`` (in training mode) and additionally rejects trainable
    modules with buffers (which ``GradSampleModule`` refuses) and any BatchNorm, even a
    frozen one: in training mode it normalises each example with statistics of its batch,
    so per-example gradients, and hence the privacy analysis, would be wrong.

    Raises:
        PrivacyError: naming every offending module and suggesting a GroupNorm backbone.
    """
    was_training = model.training
    model.train()
    try:
        offenders: dict[str, str] = {}
        for name, module in trainable_modules(model):
            validator = ModuleValidator.VALIDATORS.get(type(module))
            errors = validator(module) if validator is not None else []
            if errors:
                offenders[name] = str(errors[0]).split(". ")[0]
            elif any(True for _ in module.buffers(recurse=False)):
                offenders[name] = "a trainable module with buffers"
        for name, module in model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and name not in offenders:
                offenders[name] = "BatchNorm mixes the examples of a batch"
    finally:
        model.train(was_training)
    if offenders:
        listed = "; ".join(
            f"{name or '<model>'} ({type(model.get_submodule(name)).__name__}): {why}"
            for name, why in offenders.items()
        )
        raise PrivacyError(
            f"Opacus cannot train this model with DP-SGD: {listed}. Use a GroupNorm "
            "backbone (model.backbone = 'cnn', 'cnn-small' or 'resnet18', not 'resnet18-bn')."
        )


def dpsgd_steps(num_examples: int, training: LocalTraining, sample_rate: float) -> int:
    """Logical DP-SGD steps of one round.

    ``training.local_steps`` if positive, else ``local_epochs * round(1 / sample_rate)``: one
    "epoch" is ``1 / q`` Poisson steps, which see ``n`` examples in expectation (Opacus'
    convention). ``training.batch_size`` plays no part; the expected batch is ``q * n``.

    Raises:
        PrivacyError: if ``num_examples < 1`` or ``sample_rate`` is not in (0, 1].
    """
    if num_examples < 1:
        raise PrivacyError(f"num_examples = {num_examples}: DP-SGD needs at least 1 example")
    _check_sample_rate(sample_rate)
    if training.local_steps > 0:
        return training.local_steps
    return training.local_epochs * round(1.0 / sample_rate)


class PoissonBatchSampler(Sampler[list[int]]):
    """``steps`` batches of indices, each example included independently with probability q.

    The decisions are ``noise.uniform(num_examples) < sample_rate``, drawn lazily, one
    logical batch at a time. Batches may be empty.
    """

    def __init__(
        self, num_examples: int, sample_rate: float, steps: int, noise: NoiseSource
    ) -> None:
        _check_sample_rate(sample_rate)
        self.num_examples = num_examples
        self.sample_rate = sample_rate
        self.steps = steps
        self.noise = noise

    def __iter__(self) -> Iterator[list[int]]:
        """Yield the sorted indices of each step's sample."""
        for _ in range(self.steps):
            draws = self.noise.uniform(self.num_examples)
            yield np.flatnonzero(draws < self.sample_rate).tolist()

    def __len__(self) -> int:
        """Number of logical batches."""
        return self.steps


class _Examples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Images and targets fetched a whole batch at a time (``__getitems__``), empty allowed."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor) -> None:
        self.images, self.targets = images, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.targets[index]

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(list(indices), dtype=torch.int64)
        return self.images[idx], self.targets[idx]


def _as_batch(batch: Any) -> Any:
    """Collate function: ``_Examples.__getitems__`` already returns the batch."""
    return batch


class _NoiseFromSource:
    """``add_noise`` of Opacus' optimizers, drawing the Gaussian noise from a NoiseSource."""

    noise_multiplier: float
    max_grad_norm: float
    params: list[Any]  # parameters, with Opacus' summed_grad attribute

    def __init__(
        self, optimizer: torch.optim.Optimizer, *, noise: NoiseSource, **kwargs: Any
    ) -> None:
        super().__init__(optimizer, **kwargs)  # type: ignore[call-arg]
        self.noise_source = noise

    def add_noise(self) -> None:
        """Store ``summed_grad + noise`` in ``p.grad`` for every parameter."""
        std = self.noise_multiplier * self.max_grad_norm
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            summed: torch.Tensor = p.summed_grad
            if std == 0:  # as Opacus' _generate_noise: no draw for zero noise
                noisy = summed.clone()
            else:
                noisy = summed + gaussian_tensor_like(self.noise_source, summed, std)
            p.grad = noisy.view_as(p)
            _mark_as_processed(p.summed_grad)


class NoiseSourceDPOptimizer(_NoiseFromSource, DPOptimizer):  # type: ignore[misc]
    """Opacus' ``DPOptimizer`` drawing its Gaussian noise from a :class:`NoiseSource`.

    Only ``add_noise`` differs: as in Opacus, ``p.grad = p.summed_grad + N(0, (sigma C)^2)``
    per parameter (in the optimizer's parameter order), then ``scale_grad`` divides by the
    expected batch size. Clipping, accumulation over physical batches, the zero-grad checks
    and the skipped steps of ``BatchMemoryManager`` are Opacus' own.
    """


class NoiseSourceFastClipOptimizer(
    _NoiseFromSource,
    DPOptimizerFastGradientClipping,  # type: ignore[misc]  # opacus is untyped
):
    """Opacus' optimizer for an already clipped sum in ``p.grad``, noise from a NoiseSource.

    ``p.grad`` holds each physical batch's clipped sum (from :class:`BookKeepingClipper`);
    Opacus accumulates it into ``p.summed_grad`` over the physical batches of a logical
    batch, then ``add_noise`` and ``scale_grad`` act exactly as for
    :class:`NoiseSourceDPOptimizer`.
    """


def resolve_clipping(model: nn.Module, clipping: Clipping) -> Literal["book-keeping", "opacus"]:
    """The engine ``clipping`` means for ``model``: ``auto`` picks book-keeping when it can.

    Raises:
        PrivacyError: if ``book-keeping`` is asked for a model with unsupported layers.
    """
    if clipping == "opacus":
        return "opacus"
    unsupported = unsupported_modules(model)
    if not unsupported:
        return "book-keeping"
    if clipping == "book-keeping":
        require_supported(model)  # raises, naming the layers
    logger.info("DP-SGD clips with Opacus' hooks: %s", "; ".join(unsupported))
    return "opacus"


def train_local_dpsgd(
    model: FaceModel,
    data: LocalData,
    training: LocalTraining,
    settings: DPSGDSettings,
    *,
    noise: NoiseSource,
) -> dict[str, float]:
    """Train like :func:`fl_secure.training.train_local`, with example-level DP-SGD.

    Takes :func:`dpsgd_steps` logical steps with Poisson batches of expected size
    ``max(1, round(q * n))``, optimiser from :func:`fl_secure.training.make_optimizer`
    (``training.batch_size`` is not used). Rows of classes absent from ``data.class_mask``
    are restored after every step, as in ``train_local`` (they receive noise but no
    gradient). The model's parameters are updated in place; on return it is a plain
    ``FaceModel`` again (no hooks, no per-example gradient attributes, ``grad`` None).

    Args:
        model: the model to train.
        data: the client's data; ``train_targets`` index the head's classes.
        training: local-training settings (epochs or steps, optimiser, learning rate).
        settings: DP-SGD parameters.
        noise: source of the Gaussian noise and of the Poisson sampling decisions.

    Returns:
        ``train_loss`` (mean per-example loss over the sampled examples), ``train_accuracy``
        (of the margin-free logits on each batch, from the same forward pass, before its
        update), ``local_steps`` and ``dp_noise_secure`` (1.0 if ``noise`` is a CSPRNG).
        Loss and accuracy are not differentially private: keep them local.

    Raises:
        PrivacyError: if Opacus cannot train the model privately, or on invalid settings.
    """
    validate_model(model)
    n = len(data.train)
    steps = dpsgd_steps(n, training, settings.sample_rate)
    expected_batch_size = max(1, round(settings.sample_rate * n))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    absent = AbsentRows(model, data.class_mask)
    loss_sum = 0.0
    correct = seen = 0
    taken = [0]

    def count_step(_: DPOptimizer) -> None:
        taken[0] += 1

    loader = DataLoader(
        _Examples(data.train.images, data.train_targets),
        batch_sampler=PoissonBatchSampler(n, settings.sample_rate, steps, noise),
        collate_fn=_as_batch,
    )
    engine = resolve_clipping(model, settings.clipping)
    gsm: GradSampleModule | None = None
    clipper: BookKeepingClipper | None = None
    optimizer: DPOptimizer | None = None
    try:
        optimizer_class: type[DPOptimizer]
        if engine == "opacus":
            gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)
            optimizer_class = NoiseSourceDPOptimizer
        else:
            clipper = BookKeepingClipper(model, settings.max_grad_norm)
            optimizer_class = NoiseSourceFastClipOptimizer
        optimizer = optimizer_class(
            make_optimizer(parameter_groups(model, training), training),
            noise=noise,
            noise_multiplier=settings.noise_multiplier,
            max_grad_norm=settings.max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction="mean",
        )
        optimizer.attach_step_hook(count_step)
        manager = BatchMemoryManager(
            data_loader=loader,
            max_physical_batch_size=settings.max_physical_batch_size,
            optimizer=optimizer,
        )
        hooks = clipper.attached() if clipper is not None else contextlib.nullcontext()
        with manager as physical, warnings.catch_warnings(), hooks:
            # The stem's input (the images) needs no gradient; Opacus still gets its backprops.
            warnings.filterwarnings("ignore", message=_NO_INPUT_GRAD_WARNING)
            for images, targets in physical:
                if len(targets) == 0:
                    # Empty Poisson batch: zero per-example gradients, so the step adds only
                    # noise (what Opacus' DPDataLoader achieves with empty batches).
                    if clipper is not None:
                        clipper.zero_grads()
                    else:
                        for p in params:
                            p.grad_sample = p.new_zeros((0, *p.shape))  # type: ignore[attr-defined]
                else:  # FaceModel.forward, split to reuse the embeddings for the accuracy
                    embeddings = model.backbone(images)
                    logits = model.head(embeddings, targets, data.class_mask)
                    losses = nn.functional.cross_entropy(logits, targets, reduction="none")
                    if clipper is None:
                        losses.mean().backward()  # type: ignore[no-untyped-call]
                    else:
                        clipper.clip_and_sum(losses)
                    with torch.no_grad():
                        plain = model.head(embeddings.detach(), None, data.class_mask)
                        correct += int((plain.argmax(1) == targets).sum())
                    loss_sum += float(losses.detach().sum())
                    seen += len(targets)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                absent.restore()
    finally:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        if gsm is not None:
            gsm.to_standard_module()
        _strip_opacus_state(model)
    if taken[0] != steps:  # BatchMemoryManager ends every logical batch with a noisy step
        raise RuntimeError(f"DP-SGD took {taken[0]} noisy steps, expected {steps}")
    return {
        "train_loss": loss_sum / max(seen, 1),
        "train_accuracy": correct / max(seen, 1),
        "local_steps": float(steps),
        "dp_noise_secure": 1.0 if noise.secure else 0.0,
    }


def _strip_opacus_state(model: nn.Module) -> None:
    """Remove whatever Opacus left on the model's modules and parameters (also after errors)."""
    for module in model.modules():
        for handle in module.__dict__.get("autograd_grad_sample_hooks", []):
            handle.remove()
        for attr in OPACUS_MODULE_ATTRS:
            if attr in module.__dict__:
                delattr(module, attr)
        if not module._backward_hooks:  # as never hooked: torch marks full-hook modules
            module._is_full_backward_hook = None
    for p in model.parameters():
        for attr in OPACUS_PARAM_ATTRS:
            if hasattr(p, attr):
                delattr(p, attr)
        p.grad = None
