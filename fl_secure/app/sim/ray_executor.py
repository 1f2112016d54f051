"""Virtual clients on Ray actors: the simulation's :class:`ClientExecutor` for many cores.

:class:`RayExecutor` starts ``num_workers`` Ray actors, each holding one
:class:`~fl_secure.app.sim.executor.VirtualClientWorker` (built once from the config, with
``train.threads`` torch threads), and runs a cohort's :class:`ClientJob` s on them; the
results come back in job order, so the engine aggregates them exactly as the serial executor
does (same parameters, bit for bit: ``tests/fl_secure/app/sim/test_ray_executor.py``).

By default :func:`ray.init` starts an embedded local Ray (no set-up: no dashboard, warnings
only, one CPU slot per core); ``address`` joins an existing cluster (``"auto"``, or
``ray://host:10001``). An executor leaves a Ray that was already running as it found it, so
:func:`ray_session` around many runs (an experiment grid) starts Ray once, and each run's
executor starts and stops only its actors. Ray is an optional dependency:
``pip install 'fl-secure[sim]'``.

Trust: Ray moves jobs and results between processes with pickle (cloudpickle). That is sound
only inside the operator's own Ray cluster, one trust domain the operator runs (its nodes,
its object store, its network); a Ray cluster shared with parties that may not be trusted
must not run this executor. Nothing that crosses a real site boundary uses it: the gRPC path
(``fl-secure train`` / ``server`` / ``client``) keeps its protobuf + safetensors messages.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import OrderedDict, deque
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fl_secure.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from types import ModuleType

    from fl_secure.app.sim.executor import ClientJob, ClientResult
    from fl_secure.config import Config
    from fl_secure.messages import Tensors

#: The pip command that installs Ray for this executor.
INSTALL_HINT = "pip install 'fl-secure[sim]'"

#: Jobs queued on one actor at a time: the next job's arguments travel while one trains.
DEPTH = 2


def import_ray() -> ModuleType:
    """Import :mod:`ray`, or say how to install it.

    Raises:
        ConfigError: Ray is not installed.
    """
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            f"the Ray backend needs Ray, which is not installed ({exc}): {INSTALL_HINT} "
            "(or run with --backend serial)"
        ) from exc
    return ray


def start_ray(address: str | None = None) -> bool:
    """Start (or join, at ``address``) Ray unless it is running; True if this call started it.

    Raises:
        ConfigError: Ray is not installed.
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no report home
    options: dict[str, Any] = {
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "log_to_driver": False,  # a worker's error comes back as the job's exception
        "configure_logging": True,
    }
    if address is None:
        options["num_cpus"] = os.cpu_count() or 1
    ray.init(address=address, **options)
    return True


@contextmanager
def ray_session(address: str | None = None) -> Iterator[None]:
    """Ray for the block: started once for many runs' executors, stopped if started here.

    Raises:
        ConfigError: Ray is not installed.
    """
    started = start_ray(address)
    try:
        yield
    finally:
        if started:
            import_ray().shutdown()


class _Actor:
    """The body of one Ray actor: one virtual-client worker, pinned torch threads."""

    def __init__(self, config: Config, keep_trainers: bool, client_batch: int = 1) -> None:
        import torch

        # deferred to the actor's own process: Ray ships this class by reference, and the
        # driver that only dispatches jobs need not load the worker's training stack
        from fl_secure.app.sim.executor import VirtualClientWorker

        torch.set_num_threads(max(1, config.train.threads))
        self.worker = VirtualClientWorker(
            config, keep_trainers=keep_trainers, client_batch=client_batch
        )
        _ = self.worker.plan  # the data plan now, with the actors' start, not in round 1

    def run(self, job: ClientJob, sent: Tensors) -> ClientResult:
        """Run ``job`` with ``sent`` (passed apart: one object-store copy per distinct model)."""
        # Ray hands numpy arrays out of its object store read-only and zero-copy: the trainer
        # loads them into its model (a copy), so nothing writes into them
        return self.worker.run(dataclasses.replace(job, sent=sent))

    def run_many(self, jobs: list[ClientJob], sent: Tensors) -> list[ClientResult]:
        """Run ``jobs``, all sent ``sent``, some trained together (``client_batch``)."""
        return self.worker.run_many([dataclasses.replace(job, sent=sent) for job in jobs])

    def ready(self) -> bool:
        """True once the actor is up (its worker built)."""
        return True

    def tune_kept(self, config: Config, shared: Tensors) -> dict[int, tuple[str, dict[str, float]]]:
        """Plan index -> (id, tuned scores) of the clients this actor kept (see RayExecutor)."""
        # deferred to the actor's process, as in __init__: the driver never loads the tuning
        from fl_secure.app.tuning import tune_trained
        from fl_secure.data.plan import plan_client_id

        kept = sorted(self.worker.kept.items())
        ids = {index: plan_client_id(index) for index, _ in kept}
        scores = tune_trained(
            config,
            {ids[i]: (t.model, t.data) for i, t in kept},
            shared,
            tune_on={ids[i]: t.strategy.training_data(t.data) for i, t in kept},
            strategies={ids[i]: t.strategy for i, t in kept},
        )
        return {i: (ids[i], scores[ids[i]]) for i, _ in kept if ids[i] in scores}


class RayExecutor:
    """A :class:`~fl_secure.app.sim.executor.ClientExecutor` over Ray actors.

    Args:
        config: the run's config; every actor builds its worker from it.
        address: an existing Ray cluster (``"auto"``, ``"ray://host:10001"``); ``None``
            starts an embedded local Ray in this process (unless one is already running).
        num_workers: actors to start; default: the cluster's CPUs divided by
            ``train.threads`` (at least 1).
        keep_trainers: each worker keeps the clients it built (a small federation where
            every client trains every round); a client's jobs then always go to the same
            actor, ``index % num_workers``.
        client_batch: jobs sent to an actor at once; > 1 trains them together where the
            design allows (:mod:`fl_secure.app.sim.vectorized`).

    Raises:
        ConfigError: Ray is not installed, or ``num_workers`` is below 1.
    """

    def __init__(
        self,
        config: Config,
        *,
        address: str | None = None,
        num_workers: int | None = None,
        keep_trainers: bool = False,
        client_batch: int = 1,
    ) -> None:
        if num_workers is not None and num_workers < 1:
            raise ConfigError(f"the Ray backend needs at least 1 worker, got {num_workers}")
        if client_batch < 1:
            raise ConfigError(f"client_batch must be >= 1, got {client_batch}")
        self.client_batch = client_batch
        ray = import_ray()
        self._ray = ray
        self._started = start_ray(address)
        threads = max(1, config.train.threads)
        cpus = max(1.0, float(ray.cluster_resources().get("CPU", 1.0)))
        count = num_workers or max(1, int(cpus) // threads)
        # more workers than CPU slots still start: each asks for its share of the slots
        per_actor = min(float(threads), cpus / count)
        remote = ray.remote(num_cpus=per_actor)(_Actor)
        self._actors = [remote.remote(config, keep_trainers, client_batch) for _ in range(count)]
        self._sticky = keep_trainers
        ray.get([a.ready.remote() for a in self._actors])

    @property
    def num_workers(self) -> int:
        """How many actors run the jobs."""
        return len(self._actors)

    def map(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        """Run ``jobs`` on the actors; the results in job order.

        Each distinct ``sent`` model is put into Ray's object store once per call (a cohort
        is mostly sent the same global model), and each actor has at most :data:`DEPTH` jobs
        queued, so a slow client does not hold back the jobs behind it.

        Raises:
            Exception: the first job's error, as the worker raised it (same class).
        """
        ray = self._ray
        stored: dict[int, Any] = {}  # id(sent) -> its ObjectRef, this call only
        queues: list[deque[tuple[int, ClientJob]]]
        if self._sticky:
            queues = [deque() for _ in self._actors]
            for i, job in enumerate(jobs):
                queues[job.index % len(self._actors)].append((i, job))
        else:
            queues = [deque(enumerate(jobs))]
        results: list[ClientResult | None] = [None] * len(jobs)
        running: dict[Any, tuple[list[int], int]] = {}  # ObjectRef -> (job numbers, actor)
        load = [0] * len(self._actors)
        # an actor's share of the jobs left, so that a batch does not leave the others idle
        size = max(1, min(self.client_batch, -(-len(jobs) // (DEPTH * len(self._actors)))))

        def submit(actor: int) -> None:
            queue = queues[actor if self._sticky else 0]
            while queue and load[actor] < DEPTH:
                numbers: list[int] = []
                batch: list[ClientJob] = []
                while (  # consecutive jobs sent the same model (batch holds them bare)
                    queue
                    and len(batch) < size
                    and (not numbers or queue[0][1].sent is jobs[numbers[0]].sent)
                ):
                    i, job = queue.popleft()
                    numbers.append(i)
                    batch.append(dataclasses.replace(job, sent=OrderedDict()))
                key = id(jobs[numbers[0]].sent)
                if key not in stored:
                    stored[key] = ray.put(jobs[numbers[0]].sent)
                handle = self._actors[actor]
                ref = (
                    handle.run.remote(batch[0], stored[key])
                    if len(batch) == 1
                    else handle.run_many.remote(batch, stored[key])
                )
                running[ref] = (numbers, actor)
                load[actor] += 1

        for actor in range(len(self._actors)):
            submit(actor)
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            for ref in done:
                numbers, actor = running.pop(ref)
                load[actor] -= 1
                got = _get(ray, ref)
                for i, result in zip(numbers, got if isinstance(got, list) else [got], strict=True):
                    results[i] = result
                submit(actor)
        return [r for r in results if r is not None]

    def tune_kept(self, config: Config, shared: Tensors) -> dict[str, dict[str, float]]:
        """The kept clients' scores after fine-tuning (``keep_trainers``; else {}), by id.

        Each actor tunes and scores the clients it kept, where their models and design state
        live (:func:`fl_secure.app.tuning.tune_trained`, ``config``'s ``eval`` settings,
        ``shared`` the final global parameters), as the serial run does in its process; the
        scores come back in plan order.

        Raises:
            RoundAborted: a tuned model's embeddings are not finite (the tuning diverged).
        """
        if not self._sticky:
            return {}
        ray = self._ray
        stored = ray.put(shared)
        refs = [a.tune_kept.remote(config, stored) for a in self._actors]
        scores: dict[int, tuple[str, dict[str, float]]] = {}
        for ref in refs:
            scores.update(_get_any(ray, ref))
        return dict(scores[i] for i in sorted(scores))

    def close(self) -> None:
        """Stop the actors, and the embedded Ray if this executor started it."""
        for actor in self._actors:
            self._ray.kill(actor)
        self._actors = []
        if self._started:
            self._ray.shutdown()
            self._started = False


def _get(ray: ModuleType, ref: Any) -> ClientResult | list[ClientResult]:
    """``ray.get(ref)``, with a worker's exception re-raised as its own class."""
    result: ClientResult | list[ClientResult] = _get_any(ray, ref)
    return result


def _get_any(ray: ModuleType, ref: Any) -> Any:
    """``ray.get(ref)``, with an actor's exception re-raised as its own class."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        raise exc.as_instanceof_cause() from None
