"""One round's model steps, shared by the gRPC coordinator and the in-process simulation.

A round starts from the global model: the shared parameters, the head each client of a
``server-sees-heads`` design (FedGC) uploaded last, corrected by the server and sent back to
its owner only, and the round's broadcast (AdaFedFR's public representations ``R``, Eq. 4,
Algorithm 1 lines 6-8). Each client is sent those three; its update comes back with its head
apart from the mean; the strategy's server step moves the parameters by the mean update, its
head step (FedGC Eq. 5) moves the uploaded heads with the round's learning rate; and the new
model is vetted before anything releases it.

:class:`server.coordinator.Coordinator` wraps these steps in cohorts, transport, secure
aggregation and privacy accounting; :func:`fl_secure.app.simulation.simulate` calls them in
one process. A round is implemented once, here, so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from fl_secure.algorithms.base import BROADCAST_PREFIX, Broadcaster
from fl_secure.errors import ProtocolError
from fl_secure.evaluation import DegenerateEmbeddings
from fl_secure.messages import LocalTraining, Tensors, TensorSpec
from fl_secure.training import get_tensors, local_training, round_learning_rate

if TYPE_CHECKING:
    from fl_secure.algorithms import Strategy
    from fl_secure.config import Config
    from fl_secure.data.plan import FederatedData
    from fl_secure.training import FaceModel

#: Server-side model update: (global parameters, mean update, round) -> new global parameters.
ServerStep = Callable[[Tensors, Tensors, int], Tensors]
#: Evaluation of the global parameters on the server's held-out data -> metrics.
Evaluator = Callable[[Tensors], dict[str, float]]


class HeadStep(Protocol):
    """Server step on the cohort's uploaded heads (``Strategy.server_heads``, FedGC)."""

    def __call__(
        self, heads: Mapping[str, Tensors], *, learning_rate: float, round_: int
    ) -> dict[str, Tensors]:
        """Client id -> head tensors in, the corrected heads out."""
        ...


@dataclass(frozen=True)
class RoundRules:
    """What every round of a run takes from its config: the schedule and the heads' template."""

    rounds: int
    training: LocalTraining = field(default_factory=LocalTraining)
    lr_schedule: str = "constant"
    # server-sees-heads (FedGC): the head tensors every upload ends with, rows -1 (each client
    # has its own number of classes), and the most rows a client's head may have
    head_specs: tuple[TensorSpec, ...] = ()
    max_head_rows: int = 0

    def learning_rate(self, number: int) -> float:
        """The learning rate of round ``number`` (1-based) under the run's schedule."""
        base = self.training.learning_rate
        return round_learning_rate(base, number, self.rounds, self.lr_schedule)

    def training_for(self, number: int) -> LocalTraining:
        """The local training a task of round ``number`` asks for (its learning rate)."""
        return dataclasses.replace(self.training, learning_rate=self.learning_rate(number))


def round_rules(
    config: Config, strategy: Strategy, model: FaceModel, plan: FederatedData
) -> RoundRules:
    """The rules of ``config``'s rounds, for the server's ``model`` and data ``plan``.

    The head template is the strategy's head tensors with any number of rows; a client's head
    may have up to ``server.max_head_rows`` rows (default: the plan's training identities).
    """
    head = get_tensors(model, strategy.head_names(model))
    return RoundRules(
        rounds=config.train.rounds,
        training=local_training(config.train),
        lr_schedule=config.train.lr_schedule,
        head_specs=tuple(TensorSpec(k, a.dtype, (-1, *a.shape[1:])) for k, a in head.items()),
        max_head_rows=config.server.max_head_rows or len(plan.train_identities),
    )


class RoundState:
    """The global model rounds advance, and the steps of one round on it.

    The coordinator reads it from servicer threads while its driver thread steps it: the
    driver replaces ``params``, ``heads`` and ``broadcast`` whole (never mutates them), and a
    reader takes each once.
    """

    def __init__(
        self,
        initial: Tensors,
        rules: RoundRules,
        *,
        server_step: ServerStep,
        head_step: HeadStep | None = None,
        broadcaster: Broadcaster | None = None,
    ) -> None:
        self.rules = rules
        self.server_step = server_step
        self.head_step = head_step
        self.broadcaster = broadcaster
        self.params: Tensors = initial
        self.specs = [TensorSpec.of(k, v) for k, v in initial.items()]
        # server-sees-heads: each client's latest (corrected) head, sent back to it alone
        self.heads: dict[str, Tensors] = {}
        # per-round tensors sent to the whole cohort with the parameters (AdaFedFR's R)
        self.broadcast: Tensors = OrderedDict()

    # ------------------------------------------------------------ what is sent
    def prepare_broadcast(self, number: int) -> None:
        """Round ``number``'s broadcast from the global parameters, before its cohort asks.

        Raises:
            ProtocolError: A tensor outside ``broadcast.*`` or with non-finite values.
        """
        if self.broadcaster is None:
            return
        tensors = self.broadcaster(self.params, number)
        for name, array in tensors.items():
            if not name.startswith(BROADCAST_PREFIX) or not np.all(np.isfinite(array)):
                raise ProtocolError(f"broadcast tensor {name!r}: bad name or non-finite values")
        self.broadcast = OrderedDict(tensors)

    def sent_to(self, client_id: str) -> Tensors:
        """What ``client_id`` is sent: the shared parameters, its own head, the broadcast."""
        params, broadcast = self.params, self.broadcast
        head: Tensors = self.heads.get(client_id, OrderedDict())
        if not head and not broadcast:
            return params
        return OrderedDict([*params.items(), *head.items(), *broadcast.items()])

    def sent_bytes(self, client_id: str) -> int:
        """Tensor bytes of :meth:`sent_to` (a task announces them)."""
        return (
            sum(sp.num_bytes for sp in self.specs)
            + sum(a.nbytes for a in self.heads.get(client_id, {}).values())
            + sum(a.nbytes for a in self.broadcast.values())
        )

    def bytes_per_client(self) -> dict[str, int]:
        """Payload bytes one client exchanges in a training round (tensor bytes, no framing).

        ``parameters_down`` and ``parameters_up`` are the shared parameters (the plain upload
        has the same specs; a masked upload's size is in the secure-aggregation record),
        ``broadcast`` the round's broadcast tensors.
        """
        params = sum(sp.num_bytes for sp in self.specs)
        extra = sum(int(a.nbytes) for a in self.broadcast.values())
        return {
            "broadcast": extra,
            "parameters_down": params,
            "parameters_up": params,
            "total": extra + 2 * params,
        }

    # --------------------------------------------------------- what comes back
    def head_expectation(self, client_id: str) -> tuple[list[TensorSpec], int]:
        """The head specs a client's upload must end with, and their byte bound.

        Once the server holds a client's head its shape is fixed; before that, any number of
        rows up to ``max_head_rows``.
        """
        known = self.heads.get(client_id)
        if known is not None:
            specs = [TensorSpec.of(k, v) for k, v in known.items()]
            return specs, sum(s.num_bytes for s in specs)
        specs = list(self.rules.head_specs)
        rows = max(self.rules.max_head_rows, 1)
        bound = sum(
            rows * int(np.prod(s.shape[1:], dtype=np.int64)) * s.dtype.itemsize for s in specs
        )
        return specs, bound

    def check_head(self, client_id: str, head: Mapping[str, np.ndarray]) -> None:
        """A head fits the template, all its tensors have the same rows, within the limit.

        Raises:
            ProtocolError: Naming the client and what does not fit.
        """
        template = self.rules.head_specs
        if list(head) != [s.name for s in template] or not all(
            s.fits(tuple(head[s.name].shape)) for s in template
        ):
            raise ProtocolError(f"the head of {client_id} does not fit this run's head")
        rows = {int(np.asarray(a).shape[0]) for a in head.values()}
        if len(rows) != 1:
            raise ProtocolError(f"the head of {client_id} has tensors of different row counts")
        count, most = rows.pop(), max(self.rules.max_head_rows, 1)
        if not 1 <= count <= most:
            raise ProtocolError(
                f"the head of {client_id} has {count} rows; this run takes 1 to {most} "
                "(server.max_head_rows; default: the identities of the server's data plan, "
                "which sites that bring their own data may exceed)"
            )

    def split_upload(
        self, client_id: str, tensors: Mapping[str, np.ndarray]
    ) -> tuple[Mapping[str, np.ndarray], Tensors]:
        """An update's shared tensors (for the mean) and its checked head (kept apart).

        Without a head template the upload is all shared tensors and the head is empty.

        Raises:
            ProtocolError: The head does not fit (:meth:`check_head`).
        """
        if not self.rules.head_specs:
            return tensors, OrderedDict()
        names = {s.name for s in self.rules.head_specs}
        head = OrderedDict((k, v) for k, v in tensors.items() if k in names)
        self.check_head(client_id, head)
        return OrderedDict((k, v) for k, v in tensors.items() if k not in names), head

    # ------------------------------------------------------------ the steps
    def step(self, number: int, mean_update: Tensors) -> Tensors:
        """The strategy's server step: round ``number``'s new global parameters (not kept)."""
        return self.server_step(self.params, mean_update, number)

    def step_heads(self, number: int, uploaded: Mapping[str, Tensors]) -> dict[str, Tensors]:
        """Every client's head after the step on the heads the cohort uploaded (FedGC, Eq. 5).

        Clients that uploaded none this round keep their last head (not kept here either).
        """
        if self.head_step is None or not uploaded:
            return dict(self.heads)
        lr = self.rules.learning_rate(number)
        return {**self.heads, **self.head_step(uploaded, learning_rate=lr, round_=number)}

    def advance(self, params: Tensors, heads: Mapping[str, Tensors]) -> None:
        """Make a vetted round's parameters and heads the global model."""
        self.params = params
        self.heads = dict(heads)


def update_weight(num_examples: float, *, private: bool) -> float:
    """An update's weight in the mean: its example count, or 1 under differential privacy.

    Under DP a client's image count is part of what is protected (one image more or less, at
    example level): the mean is unweighted, as a secure sum is. The coordinator passes the
    count within the server's cap (:func:`server.influence.weight_cap`).
    """
    return 1.0 if private else float(num_examples)


def non_finite_names(tensors: Mapping[str, np.ndarray]) -> list[str]:
    """Names of the floating-point tensors with NaN or Inf values, in order."""
    return [k for k, a in tensors.items() if a.dtype.kind in "fc" and not np.isfinite(a).all()]


def vet_model(
    number: int, params: Tensors, evaluator: Evaluator | None
) -> tuple[dict[str, float] | None, str]:
    """Round ``number``'s new global model scored, or why it is refused as diverged.

    A model with NaN/Inf parameters (finite updates can still overflow it), or finite ones
    whose held-out embeddings overflow (or vanish), must be neither kept nor released.

    Returns:
        The held-out metrics (None without an evaluator) and "", or None and the reason.
    """
    bad = non_finite_names(params)
    if bad:
        return None, (
            f"round {number}: the aggregate made the global model non-finite in {bad} (updates "
            "too large: one client's, or all: lower train.lr, or clip them with privacy.unit = "
            f"'client'); the model of round {number - 1} is kept"
        )
    if evaluator is None:
        return None, ""
    try:
        return evaluator(params), ""
    except DegenerateEmbeddings as exc:
        return None, (
            f"round {number}: the new global model's held-out embeddings: {exc} "
            f"(training diverged: lower train.lr); the model of round {number - 1} "
            "is kept"
        )
