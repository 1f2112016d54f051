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
from typing import TYPE_CHECKING, Any, Protocol

from client.trainer_factory import build_local_trainer
from fl_secure.algorithms import get_strategy
from fl_secure.app.sim.reuse import ModelPool, reusable
from fl_secure.app.sim.vectorized import model_fits, train_stacked, vectorizable
from fl_secure.data.lazy_plan import LazyShares, plan_population
from fl_secure.data.plan import ClientShare, FederatedData, plan_client_id
from fl_secure.errors import ConfigError
from fl_secure.training import set_tensors
from privacy.dp.noise import seeded_source

if TYPE_CHECKING:
    from client.trainer import LocalTrainer
    from fl_secure.config import Config
    from fl_secure.messages import LocalTraining, Tensors
    from fl_secure.training import FaceModel, LocalData
    from privacy.client_round import TrainFn

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
        self,
        config: Config,
        *,
        keep_trainers: bool = False,
        reuse_models: bool = True,
        client_batch: int = 1,
    ) -> None:
        if client_batch < 1:
            raise ConfigError(f"client_batch must be >= 1, got {client_batch}")
        self.config = config
        self.keep_trainers = keep_trainers
        self.built = 0
        #: jobs of one :meth:`run_many` call trained together (1: one at a time)
        self.client_batch = client_batch
        self.trained_together = 0  # jobs whose local round ran vectorised
        self._plan: FederatedData | None = None
        self._kept: dict[int, LocalTrainer] = {}
        a, m = config.algorithm, config.model
        strategy = get_strategy(a.name, a, head=m.head, scale=m.scale)
        #: one model per worker, reset per job (:mod:`fl_secure.app.sim.reuse`), where the
        #: design allows it and clients are not kept; None builds a model per client
        self.models: ModelPool | None = None
        if reuse_models and not keep_trainers and reusable(strategy, config):
            self.models = ModelPool(config, config.data.image_size)
        self._together = client_batch > 1 and not keep_trainers and vectorizable(strategy, config)

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

    def trainer(self, index: int, share: ClientShare | None = None) -> LocalTrainer:
        """Client ``index`` as its gRPC process builds it (kept if ``keep_trainers``).

        ``share``: the client's data, when the caller has rendered it already.
        """
        kept = self._kept.get(index)
        if kept is not None:
            return kept
        plan = self.plan
        if not 0 <= index < len(plan.clients):
            raise ConfigError(f"virtual client {index} is outside the plan's {len(plan.clients)}")
        if share is None:
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
        return self._finish(job, self._prepared(job))

    def _finish(
        self, job: ClientJob, trainer: LocalTrainer, local: TrainFn | None = None
    ) -> ClientResult:
        """Run the prepared client's job (``local``: its local objective already run)."""
        if job.kind == EVALUATE:
            examples, metrics = trainer.evaluate(job.sent)
            return ClientResult(job.client_id, OrderedDict(), examples, metrics, job.state)
        upload, examples, metrics = trainer.train(job.sent, job.task, local=local)
        carry = {} if self.keep_trainers else carried_state(trainer)  # a kept one holds it
        return ClientResult(job.client_id, upload, examples, metrics, carry)

    def run_many(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        """Run ``jobs``, results in job order; some train together where the design allows.

        Up to :attr:`client_batch` consecutive training jobs sent the same model run their
        local objective in one pass (:mod:`fl_secure.app.sim.vectorized`); the rest run one
        at a time (:meth:`run`).
        """
        results: list[ClientResult | None] = [None] * len(jobs)
        group: list[int] = []

        def flush() -> None:
            if len(group) > 1:
                for i, result in zip(
                    group, self._run_together([jobs[i] for i in group]), strict=True
                ):
                    results[i] = result
            elif group:
                results[group[0]] = self.run(jobs[group[0]])
            group.clear()

        for i, job in enumerate(jobs):
            if not self._together or job.kind != TRAIN:
                flush()
                results[i] = self.run(job)
                continue
            if group and (jobs[group[0]].sent is not job.sent or len(group) >= self.client_batch):
                flush()
            group.append(i)
        flush()
        return [r for r in results if r is not None]

    def _run_together(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        """Jobs sent one model: their local objective in one pass, the rest per client."""
        plan = self.plan
        indices = [job.index for job in jobs]
        shares = (
            plan.clients.shares(indices)
            if isinstance(plan.clients, LazyShares)
            else [plan.clients[i] for i in indices]
        )
        first = self._prepared(jobs[0], shares[0])
        if not model_fits(first.model, list(jobs[0].sent)):
            # each build resets the worker's one model (a private head drawn from the client's
            # seed): build and run the clients one after the other, on the shares rendered here
            finished = [self._finish(jobs[0], first)]
            for job, share in zip(jobs[1:], shares[1:], strict=True):
                finished.append(self._finish(job, self._prepared(job, share)))
            return finished
        # every parameter is sent: a client's round starts from the sent values, whatever
        # builds came after its own, so the clients can be built first and trained after
        trainers = [
            first,
            *(self._prepared(j, s) for j, s in zip(jobs[1:], shares[1:], strict=True)),
        ]
        model = first.model
        by_size: dict[int, list[int]] = {}  # clients of one size share every step's shapes
        for i, trainer in enumerate(trainers):
            by_size.setdefault(len(trainer.data.train), []).append(i)
        results: list[ClientResult | None] = [None] * len(jobs)
        for members in by_size.values():
            if len(members) == 1:
                results[members[0]] = self._finish(jobs[members[0]], trainers[members[0]])
                continue
            set_tensors(model, jobs[0].sent)  # every parameter: whatever the last build left
            stacked = train_stacked(model, [trainers[i].data for i in members], jobs[0].task,
                                    [trainers[i].generator for i in members])  # fmt: skip
            for i, done in zip(members, stacked, strict=True):

                def local(m: FaceModel, _d: LocalData, _t: LocalTraining, done: Any = done) -> Any:
                    set_tensors(m, done.params)
                    return done.metrics

                results[i] = self._finish(jobs[i], trainers[i], local)
            self.trained_together += len(members)
        return [r for r in results if r is not None]

    def _prepared(self, job: ClientJob, share: ClientShare | None = None) -> LocalTrainer:
        """The job's client, its carry restored and this round's batch order seeded."""
        trainer = self.trainer(job.index, share)
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
        return trainer


class SerialExecutor:
    """A :class:`ClientExecutor` in this process: one worker runs the jobs in order."""

    def __init__(
        self, config: Config, *, keep_trainers: bool = False, client_batch: int = 1
    ) -> None:
        self.worker = VirtualClientWorker(
            config, keep_trainers=keep_trainers, client_batch=client_batch
        )

    def map(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        """Run ``jobs`` in order (``client_batch`` > 1: several trained together)."""
        return self.worker.run_many(jobs)

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
