"""The simulation engine: a population of virtual clients, a sampled cohort per round.

A round runs the gRPC coordinator's steps (:class:`server.round.RoundState`), with the
network replaced by a :class:`~fl_secure.app.sim.executor.ClientExecutor`:

1. the budget is held before the round (:meth:`ReleaseAccounting.check_budget`: the run
   stops with status ``budget_exhausted`` once a round would pass ``privacy.target_epsilon``);
2. the cohort is drawn (:meth:`SimServer.draw_cohort`, the coordinator's
   :meth:`server.membership.Membership.sample_cohort`), redrawn while it is smaller than
   ``server.min_clients``, up to ``server.max_retries`` times;
3. each member gets a job with what the coordinator sends it
   (:meth:`RoundState.sent_to`) and its carried state; its upload comes back clipped and
   noised by :class:`privacy.client_round.ClientPrivacy` as the run's placement says;
4. the uploads are folded as the coordinator folds them: the DP aggregator of
   :meth:`ServerPrivacy.make_aggregator` (clipping and central noise) or the
   :class:`~fl_secure.aggregation.StreamingMean` weighted by example counts within the server's
   cap, FedGC's heads kept apart;
5. the strategy's server step, the vetting of the new model (:func:`server.round.vet_model`),
   then, with a run directory, the checkpoint with the round's ledger rows, the ledger commit,
   and only then the release of the model to the next cohort (:meth:`RoundState.advance`).

Memory grows with the cohort: the driver holds the carried state of clients that trained
(their private layers; FedAvg clients carry nothing), and the executor builds a client per job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from fl_secure.aggregation import StreamingMean
from fl_secure.app.sim.executor import EVALUATE, ClientJob, ClientResult, SerialExecutor
from fl_secure.app.sim.secure import secure_round
from fl_secure.app.sim.server_side import SimServer, sampled
from fl_secure.checkpoints import CheckpointStore
from fl_secure.errors import RoundAborted
from fl_secure.messages import LocalTraining, TaskKind, UpdateHeader
from privacy.ledger.anchors import STATE_KEY as LEDGER_HEAD_KEY
from privacy.site_figures import evaluation_figures, training_figures
from server.attempt import Attempt
from server.release_accounting import BudgetStop
from server.round import non_finite_names, update_weight, vet_model

if TYPE_CHECKING:
    from fl_secure.app.sim.executor import ClientExecutor
    from fl_secure.config import Config
    from fl_secure.messages import Tensors
    from fl_secure.runs import RunDir

#: Builds the executor from the config the clients receive (calibrated noise multiplier).
ExecutorFactory = Callable[["Config"], "ClientExecutor"]

#: At most this many clients score the global model before and after training (a seeded
#: choice when the population is larger): evaluation, not a release of training.
EVALUATED_CLIENTS = 200


@dataclasses.dataclass
class SimulationResult:
    """Final shared parameters, one record per round, and the run's summary figures."""

    params: Tensors
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    heads: dict[str, Tensors] = dataclasses.field(default_factory=dict)  # FedGC: final W_k
    status: str = "completed"  # or "budget_exhausted"
    privacy: dict[str, Any] | None = None  # ServerPrivacy.summary() of a private run
    rounds_completed: int = 0


class SimulationEngine:
    """One simulated run: the server's parts, an executor, the rounds.

    Args:
        config: the run.
        run_dir: where the ledger and per-round checkpoints go (required under DP).
        executor: builds the executor from the clients' config; default a
            :class:`SerialExecutor` that keeps its clients when every client trains every
            round (the in-process simulation as it always ran) and rebuilds them otherwise.
        evaluated: how many clients score the global model before and after training.
        dropout_rate: securely aggregated rounds: the fraction of a cohort that leaves the
            round, each at a stage drawn uniformly (:mod:`fl_secure.app.sim.secure`).
    """

    def __init__(
        self,
        config: Config,
        *,
        run_dir: RunDir | None = None,
        executor: ExecutorFactory | None = None,
        evaluated: int = EVALUATED_CLIENTS,
        dropout_rate: float = 0.0,
    ) -> None:
        self.config = config
        self.evaluated = evaluated
        self.dropout_rate = dropout_rate
        self.server = SimServer(config, run_dir)
        self.run_dir = run_dir
        self.store: CheckpointStore | None = None
        if run_dir is not None:
            self.store = CheckpointStore(run_dir.checkpoints)
        self.sampled = sampled(config)
        everyone = not self.sampled
        factory = executor or (lambda cfg: SerialExecutor(cfg, keep_trainers=everyone))
        self.executor = factory(self.server.client_config)
        #: client id -> carried state, for clients that trained and carry any
        self.carry: dict[str, dict[str, bytes]] = {}
        self.cohort_sizes: list[int] = []
        self.stop_reason = ""  # why the run stopped early (the budget)

    # ------------------------------------------------------------ the run
    def run(
        self, *, progress: bool = False, on_round: Callable[[dict[str, Any]], None] | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """Every round (until the budget stops it); return the records and the status."""
        s = self.server
        untrained: dict[str, Any] = {"round": 0, "clients": self.evaluate_clients()}
        if s.evaluator is not None:
            untrained["held_out"] = s.evaluator(s.state.params)
        records = [untrained]
        status = "completed"
        for number in tqdm(range(1, self.config.train.rounds + 1), disable=not progress):
            try:
                record = self.train_round(number)
            except BudgetStop as exc:
                status, self.stop_reason = "budget_exhausted", str(exc)
                break
            records.append(record)
            if on_round is not None:
                on_round(record)
        s.accounting.end_attempt()
        return records, status

    @property
    def rounds_completed(self) -> int:
        """Rounds whose model was released."""
        return len(self.cohort_sizes)

    def train_round(self, number: int) -> dict[str, Any]:
        """Round ``number`` (see the module docstring).

        Raises:
            BudgetStop: the round would pass the privacy budget (it did not run).
            RoundAborted: too few clients drawn after every retry, an update or the new
                global model diverged.
        """
        s, settings = self.server, self.config.server
        state = s.state
        task = state.rules.training_for(number)
        state.prepare_broadcast(number)  # e.g. AdaFedFR Algorithm 1 lines 6-8: R under w^t
        why = ""
        for attempt in range(settings.max_retries + 1):
            s.accounting.end_attempt()  # the last attempt released nothing
            s.accounting.check_budget(number, attempt)
            cohort = s.draw_cohort(number)
            if len(cohort) < settings.min_clients:
                why = f"a draw of {len(cohort)} < server.min_clients = {settings.min_clients}"
                continue
            s.accounting.begin_attempt(number, attempt, TaskKind.TRAIN, len(cohort))
            results = self.executor.map([self._job(c, number, task) for c in cohort])
            for result in results:  # a client keeps what it trained, in the sum or not
                if result.state:
                    self.carry[result.client_id] = result.state
            rnd, uploads = self._fold(number, attempt, cohort, results)
            mean, secure = self._aggregate(rnd, uploads)
            if mean is not None:
                break
            why = f"the secure round aborted: {secure['aborted'] if secure else ''}"
        else:
            raise RoundAborted(f"round {number}: every attempt failed (last: {why})")
        params = state.step(number, mean)
        held, reason = vet_model(number, params, s.evaluator)
        if reason:
            s.accounting.diverged(rnd, reason)
            raise RoundAborted(reason)
        heads = state.step_heads(number, rnd.heads)
        record: dict[str, Any] = {
            "round": number,
            "clients": {c: h.metrics for c, h in rnd.received.items()},
        }
        if self.sampled:
            record["cohort_size"] = len(cohort)
        if secure is not None:
            record["secure_aggregation"] = secure
        if state.broadcaster is not None:
            record["bytes_per_client"] = state.bytes_per_client()
        if held is not None:
            record["held_out"] = held
        self._release(number, rnd, params, heads, record)
        self.cohort_sizes.append(len(cohort))
        return record

    def _aggregate(
        self, rnd: Attempt, uploads: dict[str, Tensors]
    ) -> tuple[Tensors | None, dict[str, Any] | None]:
        """The round's mean update (None: the secure round aborted) and its secure record."""
        s = self.server
        if not self.config.secure_aggregation.enabled:
            assert rnd.aggregator is not None
            return rnd.aggregator.mean(), None
        outcome = secure_round(
            self.config,
            s.privacy,
            s.state.specs,
            uploads,
            number=rnd.number,
            attempt=rnd.attempt,
            dropout_rate=self.dropout_rate,
        )
        # the server received the survivors' inputs only (the ledger counts them)
        rnd.received = {c: h for c, h in rnd.received.items() if c in outcome.survivors}
        if outcome.mean is None and outcome.sum_seen:  # counted like a round, conservatively:
            # with the fewest noise shares the sum may carry (as a resumed in-flight attempt)
            least = min(len(rnd.cohort), self.config.server.min_clients)
            reason = f"round {rnd.number} attempt {rnd.attempt}: {outcome.record['aborted']}"
            s.accounting._discard(rnd.number, len(rnd.cohort), least, rnd.attempt, reason)
        return outcome.mean, outcome.record

    def _job(self, client_id: str, number: int, task: LocalTraining) -> ClientJob:
        return ClientJob(
            client_id=client_id,
            index=self.server.index[client_id],
            round=number,
            sent=self.server.state.sent_to(client_id),
            task=task,
            state=self.carry.get(client_id, {}),
        )

    def _fold(
        self, number: int, attempt: int, cohort: list[str], results: list[ClientResult]
    ) -> tuple[Attempt, dict[str, Tensors]]:
        """The uploads folded into the round's aggregate, as the coordinator's upload desk.

        Securely aggregated, the shared tensors are returned instead, to be masked.
        """
        s = self.server
        privacy, state = s.privacy, s.state
        secure = self.config.secure_aggregation.enabled
        dp = privacy.make_aggregator(state.specs) if privacy is not None and not secure else None
        rnd = Attempt(
            number=number,
            kind=TaskKind.TRAIN,
            attempt=attempt,
            cohort=dict.fromkeys(cohort, b""),
            deadline=math.inf,
            aggregator=None if secure else dp if dp is not None else StreamingMean(state.specs),
            weight_cap=s.weight_cap,
        )
        uploads: dict[str, Tensors] = {}
        unit = privacy.unit if privacy is not None else "none"
        for result in results:
            bad = non_finite_names(result.upload)
            if bad:
                raise RoundAborted(
                    f"round {number}: {result.client_id}'s update has non-finite values in "
                    f"{bad[:5]}{' ...' if len(bad) > 5 else ''} (training diverged: lower "
                    "train.lr)"
                )
            if privacy is not None:
                privacy.check_upload_metrics(result.client_id, result.metrics, self._task(number))
            shared, head = state.split_upload(result.client_id, result.upload)
            if head:
                rnd.heads[result.client_id] = head
            weight = update_weight(min(result.examples, s.weight_cap), private=privacy is not None)
            if rnd.aggregator is not None:
                rnd.aggregator.add(shared, weight)
            else:
                uploads[result.client_id] = OrderedDict(shared)
            metrics = training_figures(unit, result.metrics) if unit != "none" else result.metrics
            rnd.received[result.client_id] = UpdateHeader(number, b"", result.examples, metrics)
        return rnd, uploads

    def _task(self, number: int) -> LocalTraining:
        return self.server.state.rules.training_for(number)

    def _release(
        self,
        number: int,
        rnd: Attempt,
        params: Tensors,
        heads: dict[str, Tensors],
        record: dict[str, Any],
    ) -> None:
        """Checkpoint with the ledger rows, commit the ledger, then release the model."""
        s = self.server
        if self.store is not None:
            encoded = self.store.encode(number, params)
            rows = s.accounting.ledger_rows(rnd, encoded)
            preview = s.accounting.preview(rows)
            if preview is not None:
                record["privacy"] = preview
            ckpt: dict[str, Any] = {"status": "running", "privacy_rows": rows}
            signed = s.privacy.signed_head() if s.privacy is not None else None
            if signed is not None:
                ckpt[LEDGER_HEAD_KEY] = signed
            if self.run_dir is not None:
                ckpt["run_id"] = self.run_dir.path.name
            self.store.save(number, params, ckpt, client_tensors=heads, encoded=encoded)
            s.accounting.commit(number, rows)
        s.state.advance(params, heads)

    # ------------------------------------------------------------ evaluation
    def evaluated_clients(self) -> list[str]:
        """The clients that score the global model (all, or a seeded choice of them)."""
        ids = self.server.ids
        if len(ids) <= self.evaluated:
            return list(ids)
        seed = hashlib.sha256(f"{self.config.run.seed}:evaluated".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little") >> 1)
        chosen = torch.randperm(len(ids), generator=g)[: self.evaluated].tolist()
        return [ids[i] for i in sorted(chosen)]

    def evaluate_clients(self) -> dict[str, dict[str, float]]:
        """The global model, as sent, scored on each evaluated client's test images."""
        s = self.server
        jobs = [
            dataclasses.replace(self._job(c, 0, LocalTraining()), kind=EVALUATE)
            for c in self.evaluated_clients()
        ]
        unit = s.privacy.unit if s.privacy is not None else "none"
        return {
            r.client_id: evaluation_figures(unit, r.metrics) if unit != "none" else r.metrics
            for r in self.executor.map(jobs)
        }

    def close(self) -> None:
        """Free the executor."""
        self.executor.close()


def kept_trainers(engine: SimulationEngine) -> dict[str, Any]:
    """The clients a serial executor kept (every client trains every round), else {}."""
    executor = engine.executor
    if not isinstance(executor, SerialExecutor) or not executor.worker.keep_trainers:
        return {}
    worker = executor.worker
    return OrderedDict((engine.server.ids[i], t) for i, t in sorted(worker.kept.items()))
