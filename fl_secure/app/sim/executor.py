"""Virtual clients and the executors that run them: one job per drawn client and round.

A *virtual client* is nothing but an index into the run's data plan until it is drawn into a
cohort. The engine (:mod:`fl_secure.app.sim.engine`) then sends a :class:`ClientJob`: what
the client is sent (:meth:`server.round.RoundState.sent_to`), the round's training
instructions, and the client's carried state (its private layers as safetensors bytes, its
DP-SGD accountant), which the client returned in its last :class:`ClientResult`. A
:class:`VirtualClientWorker` builds the client from ``(config, index)`` with
:func:`client.trainer_factory.build_local_trainer` (the gRPC client's own builder, so both
train identically), restores the carry, runs the trainer's round (the strategy's client
step, then :class:`privacy.client_round.ClientPrivacy`'s clipping and noise), returns the
upload and the new carry, and drops the client. Memory therefore grows with the cohort, not
with the population: the driver keeps the carry of clients that have trained (none for
FedAvg, whose clients are stateless).

Jobs and results are plain picklable data (numpy arrays, frozen dataclasses, bytes), so a
process pool or a Ray actor can run :meth:`VirtualClientWorker.run` (:class:`ClientExecutor`
is the interface; :class:`SerialExecutor` runs the jobs here, one after the other).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from client.trainer_factory import build_local_trainer
from fl_secure.algorithms import get_strategy
from fl_secure.app.sim.reuse import ModelPool, reusable
from fl_secure.data.lazy_plan import plan_population
from fl_secure.data.plan import FederatedData, plan_client_id
from fl_secure.errors import ConfigError
from privacy.dp.noise import seeded_source

if TYPE_CHECKING:
    from client.trainer import LocalTrainer
    from fl_secure.config import Config
    from fl_secure.messages import LocalTraining, Tensors

#: Job kinds: a training round, or the scoring of the model the client is sent.
TRAIN, EVALUATE = "train", "evaluate"

#: Keys of a virtual client's carried state.
PRIVATE_KEY, ACCOUNTANT_KEY = "private", "accountant"


@dataclass(frozen=True)
class ClientJob:
    """One virtual client's task in one round."""

    client_id: str  # plan_client_id(index)
    index: int  # the client's share index in the plan
    round: int
    sent: Tensors  # what the client is sent (RoundState.sent_to)
    task: LocalTraining  # the round's training instructions
    state: dict[str, bytes]  # the client's carried state, opaque bytes; {} the first time
    kind: str = TRAIN  # TRAIN, or EVALUATE: score ``sent`` on the client's test images


@dataclass(frozen=True)
class ClientResult:
    """What a virtual client gives back: its upload, as it would leave a real client."""

    client_id: str
    upload: Tensors  # already clipped/noised as the run's DP placement says ({} to evaluate)
    examples: int  # the count it states (1 under DP: privacy.site_figures)
    metrics: dict[str, float]
    state: dict[str, bytes]  # the carry for the client's next job


class ClientExecutor(Protocol):
    """Runs a cohort's jobs (in this process, a pool, Ray actors ...)."""

    def map(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        """Run ``jobs``; the results in job order."""
        ...

    def close(self) -> None:
        """Free the executor's workers."""
        ...


class VirtualClientWorker:
    """Builds a virtual client from ``(config, index)`` per job and runs its round.

    One per process (or Ray actor). It holds the config and a lazily built data plan (the
    deterministic :func:`fl_secure.data.plan.plan_federation`, the same one every gRPC client
    of the embedded mode derives). ``keep_trainers`` keeps every client it built (the
    in-process simulation of a small federation where every client trains every round, as
    :func:`fl_secure.app.simulation.simulate` always did); otherwise each job builds its
    client afresh and restores its carried state, and :attr:`built` counts the clients built.
    A fresh client's model is one model of the worker reset to the run's initial weights
    (:class:`fl_secure.app.sim.reuse.ModelPool`; ``reuse_models=False`` builds one per job).
    """

    def __init__(
        self, config: Config, *, keep_trainers: bool = False, reuse_models: bool = True
    ) -> None:
        self.config = config
        self.keep_trainers = keep_trainers
        self.built = 0
        self._plan: FederatedData | None = None
        self._kept: dict[int, LocalTrainer] = {}
        a, m = config.algorithm, config.model
        strategy = get_strategy(a.name, a, head=m.head, scale=m.scale)
        #: one model per worker, reset per job (:mod:`fl_secure.app.sim.reuse`), where the
        #: design allows it and clients are not kept; None builds a model per client
        self.models: ModelPool | None = None
        if reuse_models and not keep_trainers and reusable(strategy, config):
            self.models = ModelPool(config, config.data.image_size)

    @property
    def plan(self) -> FederatedData:
        """The run's data plan, built on first use (synthetic images rendered per share read).

        :func:`fl_secure.data.lazy_plan.plan_population`: a synthetic client's images are
        rendered when a job builds that client, so a worker holds its jobs' images only.
        """
        if self._plan is None:
            self._plan = plan_population(self.config)
        return self._plan

    @property
    def kept(self) -> dict[int, LocalTrainer]:
        """The clients kept so far (``keep_trainers``), by plan index."""
        return dict(self._kept)

    def trainer(self, index: int) -> LocalTrainer:
        """Client ``index`` as its gRPC process builds it (kept if ``keep_trainers``)."""
        kept = self._kept.get(index)
        if kept is not None:
            return kept
        plan = self.plan
        if not 0 <= index < len(plan.clients):
            raise ConfigError(f"virtual client {index} is outside the plan's {len(plan.clients)}")
        share = plan.clients[index]
        trainer = build_local_trainer(
            self.config,
            share.train,
            share.test,
            plan.train_identities,
            client_id=plan_client_id(index),
            image_size=self.config.data.image_size,
            model_source=None if self.models is None else self.models.model,
        )
        self.built += 1
        if self.keep_trainers:
            self._kept[index] = trainer
        return trainer

    def run(self, job: ClientJob) -> ClientResult:
        """Build (or take) the client, restore its carry, run the job, return the upload."""
        trainer = self.trainer(job.index)
        if not self.keep_trainers:  # a fresh client: its carry, and this round's batch order
            restore_state(trainer, job.state)
            seed = batch_seed(self.config.run.seed, job.client_id, job.round)
            trainer.generator.manual_seed(seed)
        if trainer.privacy is not None and not self.config.privacy.secure_rng:
            # reproducible test noise: a fresh stream per client and round (a rebuilt client
            # would otherwise repeat its first round's noise)
            trainer.privacy.source = seeded_source(
                self.config.run.seed, f"{job.client_id}:round-{job.round}"
            )
        if job.kind == EVALUATE:
            examples, metrics = trainer.evaluate(job.sent)
            return ClientResult(job.client_id, OrderedDict(), examples, metrics, job.state)
        upload, examples, metrics = trainer.train(job.sent, job.task)
        carry = {} if self.keep_trainers else carried_state(trainer)  # a kept one holds it
        return ClientResult(job.client_id, upload, examples, metrics, carry)


class SerialExecutor:
    """A :class:`ClientExecutor` in this process: one worker runs the jobs in order."""

    def __init__(self, config: Config, *, keep_trainers: bool = False) -> None:
        self.worker = VirtualClientWorker(config, keep_trainers=keep_trainers)

    def map(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        """Run ``jobs`` one after the other."""
        return [self.worker.run(job) for job in jobs]

    def close(self) -> None:
        """Nothing to free."""


def batch_seed(seed: int, client_id: str, round_: int) -> int:
    """A rebuilt client's batch-order seed in round ``round_`` (reproducible; not secret).

    A client process keeps one generator for the whole run; a virtual client rebuilt for each
    round it is drawn into takes a fresh one per round instead of carrying the generator's
    state (5 KB a client).
    """
    digest = hashlib.sha256(f"{seed}:{client_id}:round-{round_}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def carried_state(trainer: LocalTrainer) -> dict[str, bytes]:
    """What a virtual client carries to its next round (empty for a stateless client)."""
    state: dict[str, bytes] = {}
    private = trainer.export_private()
    if private:
        state[PRIVATE_KEY] = private
    if trainer.privacy is not None and trainer.privacy.cfg.dpsgd:
        blob = json.dumps(trainer.privacy.accountant.state_dict(), sort_keys=True)
        state[ACCOUNTANT_KEY] = blob.encode("utf-8")
    return state


def restore_state(trainer: LocalTrainer, state: dict[str, bytes]) -> None:
    """Restore :func:`carried_state` into a freshly built client (``{}``: its first round)."""
    trainer.import_private(state.get(PRIVATE_KEY, b""))
    accountant = state.get(ACCOUNTANT_KEY)
    if accountant and trainer.privacy is not None:
        trainer.privacy.accountant.load_state_dict(json.loads(accountant))
