"""A client's local side: its model, its private state and the algorithm's client step.

Private parameters (for example FedPE's class embeddings) never leave this object; they are
kept in memory and, when ``state_dir`` is given, saved as safetensors after every round (one
file per run, :func:`private_state_path`), so a restarted client continues with its own head
while a new run in the same folder starts its private layers afresh, together with the
design's own client state (AdaFedFR's adapter and ``phi``) under ``strategy.*`` keys. In
``server-sees-heads`` designs (FedGC) the head is still kept and saved here, but it also
travels: the server's task may carry this client's corrected head (``head.*`` tensors next to
the shared ones), which replaces the local rows before training, and every update carries the
trained head's values after the shared parameters' update.
"""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save

from fl_secure.algorithms.base import BROADCAST_PREFIX
from fl_secure.errors import CheckpointError, ProtocolError
from fl_secure.runs import atomic_write_bytes, run_keyed_path
from fl_secure.training import FaceModel, LocalData, set_tensors
from privacy.site_figures import PRIVATE_EXAMPLE_COUNT

if TYPE_CHECKING:
    from fl_secure.algorithms import Strategy
    from fl_secure.messages import LocalTraining, Tensors
    from privacy.client_round import ClientPrivacy, TrainFn

log = logging.getLogger(__name__)

#: Key prefix, in the private state file (:func:`private_state_path`), of the design's own
#: client state (:meth:`Strategy.private_state`, e.g. AdaFedFR's adapter and ``phi``).
STRATEGY_PREFIX = "strategy."

#: The one private state file of a client before they were kept per run.
UNKEYED_PRIVATE_STATE = "private.safetensors"


def private_state_path(state_dir: Path, run_id: str) -> Path:
    """Where a client keeps its private layers for the run ``run_id``.

    One file per run, named by a digest of the run id (which comes from the server, so it is
    never used as a path itself), as the example-level accountant is: a client restarted into
    the same run continues with its own head, and a new run in the same state folder starts
    its private layers from the run's initial model instead of the last run's, whose file
    stays as it was. Without a run id (a trainer outside a run): ``private.safetensors``.
    """
    return run_keyed_path(state_dir, "private", ".safetensors", run_id)


class LocalTrainer:
    """Runs the strategy's client step on this client's data."""

    def __init__(
        self,
        strategy: Strategy,
        model: FaceModel,
        data: LocalData,
        *,
        state_dir: Path | None = None,
        seed: int | None = None,
        privacy: ClientPrivacy | None = None,
        run_id: str = "",
    ) -> None:
        self.strategy = strategy
        self.model = model
        self.data = data
        self.shared_names = strategy.shared_names(model)
        self.head_names = strategy.head_names(model)
        self.state_dir = state_dir
        self.run_id = run_id
        self.privacy = privacy
        self.generator = torch.Generator().manual_seed(
            seed if seed is not None else secrets.randbits(63)
        )
        self._load_private()

    @property
    def num_examples(self) -> int:
        """The example count this client tells the server (at join and with its updates).

        Its number of training images without DP; 1 under DP, where the count is part of
        what is protected (at the example level one image more or less is the neighbouring
        data set; at the client level it describes the site's data), and the DP and secure
        means are unweighted, so the server has no use for it (:mod:`privacy.site_figures`).
        """
        if self.privacy is not None:
            return PRIVATE_EXAMPLE_COUNT
        return len(self.data.train)

    def _private_path(self) -> Path | None:
        return private_state_path(self.state_dir, self.run_id) if self.state_dir else None

    def _private_names(self) -> list[str]:
        shared = set(self.shared_names)
        return [k for k in self.model.state_dict() if k not in shared]

    def _load_private(self) -> None:
        path = self._private_path()
        if path is None:
            return
        if not path.exists():
            self._adopt_unkeyed_private(path)
            return
        self._load_from(path)

    def _load_from(self, path: Path) -> None:
        try:
            saved = load_file(str(path))
        except (SafetensorError, OSError) as exc:  # kept, not overwritten: it may be restored
            raise CheckpointError(
                f"the site's private state {path} is damaged ({exc}); restore it from a "
                "backup, or move it away to start the private layers afresh"
            ) from exc
        if self._restore(saved, str(path)):
            log.info("restored private parameters from %s", path)
        else:
            log.warning("ignoring private state %s: it does not fit this model", path)

    def _restore(self, saved: dict[str, torch.Tensor], where: str) -> bool:
        """Load saved private tensors into the model; False if they do not fit it."""
        extra = {
            k[len(STRATEGY_PREFIX) :]: v for k, v in saved.items() if k.startswith(STRATEGY_PREFIX)
        }
        saved = {k: v for k, v in saved.items() if not k.startswith(STRATEGY_PREFIX)}
        state = self.model.state_dict()
        if set(saved) != set(self._private_names()) or any(
            saved[k].shape != state[k].shape for k in saved
        ):
            return False
        self.model.load_state_dict(saved, strict=False)
        try:
            self.strategy.restore_private_state(self.model, extra)
        except ValueError as exc:
            log.warning("ignoring the %s state in %s: %s", self.strategy.name, where, exc)
        return True

    def _adopt_unkeyed_private(self, path: Path) -> None:
        """Take over ``private.safetensors``, written before private state was kept per run.

        It names no run: it may hold this run's layers (a client upgraded in the middle of
        the run), so it is loaded, if it fits the model, copied to this run's file and renamed
        ``private.safetensors.adopted`` so that no later run starts from it again. A damaged
        one is named and left where it is.
        """
        legacy = path.with_name(UNKEYED_PRIVATE_STATE)
        if legacy == path or not legacy.exists():
            return
        log.warning(
            "%s names no run (written before private layers were kept per run): taken as this "
            "run's, if it fits the model; kept from now on in %s",
            legacy,
            path.name,
        )
        self._load_from(legacy)
        atomic_write_bytes(path, legacy.read_bytes())
        legacy.replace(legacy.with_name(legacy.name + ".adopted"))

    def _private_tensors(self) -> dict[str, torch.Tensor]:
        """The private layers and the design's own state, as the state file holds them."""
        state = self.model.state_dict()
        tensors = {k: state[k].contiguous().clone() for k in self._private_names()}
        for k, v in self.strategy.private_state(self.model).items():
            tensors[STRATEGY_PREFIX + k] = v.contiguous().clone()
        return tensors

    def export_private(self) -> bytes:
        """The private state as safetensors bytes (``b""`` if none): a virtual client's carry.

        The simulation engine (:mod:`fl_secure.app.sim`) rebuilds a client for each round it
        is drawn into and restores this with :meth:`import_private`, as a restarted client
        restores its state file.
        """
        tensors = self._private_tensors()
        return save(tensors) if tensors else b""

    def import_private(self, blob: bytes) -> None:
        """Restore what :meth:`export_private` gave (``b""``: nothing to restore).

        Raises:
            CheckpointError: the bytes are not this model's private state.
        """
        if not blob:
            return
        try:
            saved = load(blob)
        except (SafetensorError, ValueError) as exc:
            raise CheckpointError(f"a virtual client's private state is damaged: {exc}") from exc
        if not self._restore(saved, "the carried private state"):
            raise CheckpointError("the carried private state does not fit this client's model")

    def _save_private(self) -> None:
        path = self._private_path()
        if path is None:
            return
        tensors = self._private_tensors()
        if not tensors:
            return
        bad = sorted(
            k for k, v in tensors.items() if v.is_floating_point() and not v.isfinite().all()
        )
        if bad:  # a diverged round: keep the last good state, on disk and in the model
            log.error(
                "not saving the private state: %s not finite (training diverged); keeping %s",
                ", ".join(bad),
                path,
            )
            self._load_private()
            return
        atomic_write_bytes(path, save(tensors))

    def train(
        self, shared: Tensors, training: LocalTraining, *, local: TrainFn | None = None
    ) -> tuple[Tensors, int, dict[str, float]]:
        """One round: returns (update of the shared parameters, examples, metrics).

        With :attr:`Strategy.uploads_head` the update ends with this client's head values.
        ``local`` replaces the strategy's local objective (the simulation's clients trained
        together: :mod:`fl_secure.app.sim.vectorized`); DP-SGD runs keep theirs.

        Raises:
            ValueError: ``local`` given for a DP-SGD run.
        """
        shared = self._take_head(shared)
        if self.privacy is None:
            result = self.strategy.client_update(
                self.model, self.data, training, shared, generator=self.generator,
                train_fn=local,
            )  # fmt: skip
            self._save_private()
            return self._with_head(result.update), result.num_examples, result.metrics
        if not self.privacy.may_train(training):  # budget spent: a data-independent update
            update, metrics = self.privacy.release(zeros_like(shared), {}, trained=False)
            return self._with_head(update), self.num_examples, metrics
        result = self.strategy.client_update(
            self.model,
            self.data,
            training,
            shared,
            generator=self.generator,
            train_fn=self._local_objective(local),
        )
        self._save_private()
        # Example-level DP only (client-level DP is refused for uploaded heads): the head was
        # trained by DP-SGD with the rest of the model, so sending it is post-processing.
        update, metrics = self.privacy.release(result.update, result.metrics, trained=True)
        return self._with_head(update), self.num_examples, metrics

    def _local_objective(self, local: TrainFn | None) -> TrainFn | None:
        """DP-SGD's training (example- and identity-level runs), else ``local``."""
        assert self.privacy is not None
        dpsgd = self.privacy.train_fn()
        if dpsgd is not None and local is not None:
            raise ValueError("a DP-SGD client trains with DP-SGD, not a given local objective")
        return dpsgd or local

    def evaluate(self, shared: Tensors) -> tuple[int, dict[str, float]]:
        """Evaluate the global model on this client's test images.

        The design's own client scores (:meth:`Strategy.evaluate_client`): verification with
        the client's private personalisation where it has one (AdaFedFR's local adapter), or
        FedAffect's expression accuracy.
        """
        shared = self._take_head(shared)
        self._save_private()
        set_tensors(self.model, shared)
        return len(self.data.test), self.strategy.evaluate_client(self.model, self.data)

    def _take_head(self, tensors: Tensors) -> Tensors:
        """Load the server's copy of this client's head, if sent; return the shared part.

        The round's broadcast tensors (``broadcast.*``, e.g. AdaFedFR's R) go to the
        strategy, which checks them.

        Raises:
            ProtocolError: the server's tensors do not fit this client's model (names,
                shapes, a malformed broadcast tensor).
        """
        try:
            return self._split_server_tensors(tensors)
        except ValueError as exc:
            raise ProtocolError(f"refusing the server's parameters: {exc}") from exc

    def _split_server_tensors(self, tensors: Tensors) -> Tensors:
        broadcast = OrderedDict(
            (k, v) for k, v in tensors.items() if k.startswith(BROADCAST_PREFIX)
        )
        if broadcast:
            self.strategy.take_broadcast(self.model, broadcast)
        tensors = OrderedDict((k, v) for k, v in tensors.items() if k not in broadcast)
        head = OrderedDict((k, v) for k, v in tensors.items() if k in self.head_names)
        shared = OrderedDict((k, v) for k, v in tensors.items() if k not in self.head_names)
        if head:
            if list(head) != self.head_names:
                raise ValueError("the server sent an incomplete head for this client")
            set_tensors(self.model, head)  # FedGC: the corrected W_k replaces the local rows
        self._check_names(shared)
        return shared

    def _with_head(self, update: Tensors) -> Tensors:
        """The update followed by the head's current values (``server-sees-heads`` only)."""
        if not self.head_names:
            return update
        state = self.model.state_dict()
        head = ((k, state[k].detach().cpu().numpy().copy()) for k in self.head_names)
        return OrderedDict([*update.items(), *head])

    def _check_names(self, shared: Tensors) -> None:
        if list(shared) != self.shared_names:
            raise ValueError("the server's parameters do not match this client's model")
        state = self.model.state_dict()
        for name, array in shared.items():
            if tuple(array.shape) != tuple(state[name].shape):
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(array.shape)}, this client's model "
                    f"{tuple(state[name].shape)}"
                )

    def shared_parameters(self) -> Tensors:
        """This client's current values of the shared parameters."""
        state = self.model.state_dict()
        return OrderedDict((k, state[k].detach().numpy().copy()) for k in self.shared_names)


def zeros_like(tensors: Tensors) -> Tensors:
    """Zero arrays of the same specs."""
    return OrderedDict((k, np.zeros_like(v)) for k, v in tensors.items())
