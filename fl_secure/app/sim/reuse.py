"""One model per worker, reset for each job, instead of one model built per virtual client.

Building a client's model (:func:`fl_secure.training.build_run_model`) costs more than its
whole round on the small models of simulations at scale (about 30 ms of a 90 ms job for the
benchmark's ``cnn-small``, ``python -m cProfile`` on one worker). Every fresh client of a
run starts from the same deterministic weights (``run.seed``), except a private head, which
is drawn from its own seed (:func:`fl_secure.training.private_head_seed`). A
:class:`ModelPool` therefore builds one model per head size, keeps a copy of its initial
state, and for each job resets the model to that state (values, per-module training flags,
no gradients) and redraws a private head from the client's seed exactly as
:func:`fl_secure.training.build_model` draws it. The job then loads its carry on top, as a
freshly built client does, so the uploads and carries are bit-identical to the build path
(``tests/fl_secure/app/sim/test_reuse.py``).

Only designs whose whole client state is the model's own state are reset this way
(:func:`reusable`): FedAffect (its own model), designs that keep state outside the model or
take broadcast tensors (AdaFedFR, the public-share designs) and DP-SGD runs (its per-sample
gradient machinery) build their model per job as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fl_secure.algorithms.base import Strategy
from fl_secure.algorithms.fedaffect import FedAffect
from fl_secure.models import make_head
from fl_secure.training import FaceModel, build_run_model

if TYPE_CHECKING:
    from fl_secure.config import Config


def reusable(strategy: Strategy, config: Config) -> bool:
    """Whether a reset model stands for a freshly built one for this design and run."""
    kind = type(strategy)
    return (
        not isinstance(strategy, FedAffect)
        and kind.private_state is Strategy.private_state
        and kind.restore_private_state is Strategy.restore_private_state
        and kind.take_broadcast is Strategy.take_broadcast
        and not (config.privacy.enabled and config.privacy.dpsgd)
    )


@dataclass
class _Kept:
    model: FaceModel
    initial: dict[str, torch.Tensor]  # the state as built (run seed; the first head's seed)
    modes: list[bool]  # each module's training flag as built


class ModelPool:
    """The models of one worker, one per head size, each reset to a fresh client's state."""

    def __init__(self, config: Config, image_size: int) -> None:
        self.config = config
        self.image_size = image_size
        self.built = 0  # models built (the rest of the jobs reset one)
        self._kept: dict[int, _Kept] = {}

    def model(self, classes: int, head_seed: int | None) -> FaceModel:
        """A model exactly as ``build_run_model(config, classes, head_seed=head_seed)``."""
        kept = self._kept.get(classes)
        if kept is None:
            model = build_run_model(
                self.config, classes, image_size=self.image_size, head_seed=head_seed
            )
            self.built += 1
            initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self._kept[classes] = _Kept(model, initial, [m.training for m in model.modules()])
            return model
        model = kept.model
        with torch.no_grad():
            state = model.state_dict()
            for name, value in kept.initial.items():
                state[name].copy_(value)
            if head_seed is not None:
                fresh = self._head(classes, head_seed).state_dict()
                for name, value in model.head.state_dict().items():
                    value.copy_(fresh[name])
        for module, mode in zip(model.modules(), kept.modes, strict=True):
            module.training = mode
        for param in model.parameters():
            param.grad = None
        return model

    def _head(self, classes: int, head_seed: int) -> torch.nn.Module:
        """The private head :func:`fl_secure.training.build_model` draws from ``head_seed``."""
        cfg = self.config.model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(head_seed)
            if cfg.head == "softmax":
                return make_head("softmax", classes, cfg.embedding_size)
            return make_head(cfg.head, classes, cfg.embedding_size, s=cfg.scale, m=cfg.margin)
