"""The client loop: join, poll, train, upload; and the site's own policy on what it releases.

:class:`FlClient` connects with the client's certificate (:mod:`client.transport`), joins,
polls for tasks and answers them: a plain round here, a securely aggregated one through
:class:`client.secure_round.SecureExchange`. When the server is unreachable or restarts, it
reconnects with exponential backoff and jitter and joins again. Before any update leaves, the
site's ledger (:class:`privacy.ledger.site_ledger.SiteLedger`) counts it, and a task the site has
answered, or one past its epsilon budget, is refused.

The module is a little over 500 lines because :class:`FlClient`'s join, plain round and secure
round share one session's state (run config, site ledger, signing identity and its registry
record); the signing identity's loading is the next part to move out.
"""

from __future__ import annotations

import logging
import time
import tomllib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from client.secure_round import SecureExchange, withdraw_reason
from client.transport import RETRYABLE, Backoff, open_channel, rpc_details
from fl_secure import __version__, serde
from fl_secure.algorithms.registry import check_config
from fl_secure.config import config_from_dict
from fl_secure.errors import ConfigError, FlSecureError, PrivacyError, ProtocolError, TlsError
from fl_secure.memory import retain_freed_memory
from fl_secure.messages import (
    JoinRequest,
    ParametersRequest,
    PollRequest,
    SecAggMessage,
    SecAggStage,
    Task,
    TaskKind,
    UpdateHeader,
    WithdrawReason,
)
from fl_secure.tls.identity import load_signing_identity
from fl_secure.tls.registry_seen import RegistryRollbackError, RegistrySeen, seen_path
from fl_secure.v1 import transport_pb2_grpc as pb_grpc
from privacy.ckks.client_round import CkksMember
from privacy.ckks.keys import load_secret_context
from privacy.ckks.round_setup import CkksSetup, is_ckks_setup
from privacy.client_round import ClientPrivacy
from privacy.ledger.site_heads import SiteHeads
from privacy.ledger.site_ledger import SiteLedger
from privacy.secagg.round_setup import RoundSetup, check_setup
from privacy.site_figures import released_header

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

    from client.trainer import LocalTrainer
    from client.transport import Connection
    from fl_secure.config import Config
    from fl_secure.messages import JoinReply, Tensors

log = logging.getLogger(__name__)


class FlClient:
    """Runs tasks from the server until it says the run is finished."""

    def __init__(
        self,
        conn: Connection,
        trainer_factory: Callable[[JoinReply], LocalTrainer],
        *,
        max_wait: float = 600.0,
        sleep: Callable[[float], None] = time.sleep,
        site: SiteLedger | None = None,
    ) -> None:
        self.conn = conn
        self.trainer_factory = trainer_factory
        self.max_wait = max_wait  # give up after this long without reaching the server
        self.sleep = sleep
        self.trainer: LocalTrainer | None = None
        self._signing: tuple[Ed25519PrivateKey, dict[str, Ed25519PublicKey]] | None = None
        self._registry_seen: RegistrySeen | None = None  # the newest registry accepted
        self._ckks_secret: bytes | None = None  # the clients' shared CKKS key (scheme ckks)
        self._attend: Any = None  # the open attendance call of the current secure round
        self.last_round = 0
        self.rounds_done = 0
        #: Every training update that left this site (persisted in its state folder when it
        #: has one): tasks are never answered twice, and the site's own epsilon is kept.
        self.site = site if site is not None else SiteLedger(None)
        #: The run config and run id of the first join: every later round is held to them.
        self._run_config: Config | None = None
        self._run_config_toml: str | None = None
        self._run_id = ""
        self._heads: SiteHeads | None = None  # the server's signed ledger heads seen
        self._unreachable_since: float | None = None  # start of the current outage
        self._metadata = conn.metadata

    def run(self) -> str:
        """Loop until FINISHED; return the server's closing message."""
        retain_freed_memory()  # reuse each round's buffers (fl_secure/memory.py)
        backoff = Backoff()
        while True:
            channel = open_channel(self.conn)
            try:
                stub = pb_grpc.FlSecureStub(channel)
                message = self._session(stub, backoff)
                return message
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code not in RETRYABLE:
                    raise
                now = time.monotonic()
                first = self._unreachable_since is None
                if self._unreachable_since is None:
                    self._unreachable_since = now
                if now - self._unreachable_since > self.max_wait:
                    raise
                delay = backoff.next_delay()
                log.log(
                    logging.WARNING if first else logging.INFO,
                    "cannot reach the server at %s (%s: %s); retrying for up to %.0f s",
                    self.conn.address,
                    getattr(code, "name", code),
                    rpc_details(exc),
                    self.max_wait,
                )
                self.sleep(delay)
            finally:
                channel.close()

    def _session(self, stub: pb_grpc.FlSecureStub, backoff: Backoff) -> str:
        examples = self.trainer.num_examples if self.trainer else 0
        reply = serde.join_reply_from_proto(
            stub.Join(
                serde.join_request_to_proto(JoinRequest(__version__, examples)),
                metadata=self._metadata,
                timeout=30,
            )
        )
        if reply.client_id != self.conn.client_id:
            raise TlsError(
                f"server knows this client as {reply.client_id!r}, not {self.conn.client_id!r}"
            )
        self._hold_run_config(reply.run_config_toml, reply.run_id)
        self._unreachable_since = None  # reached: a later outage gets max_wait of its own
        self._load_signing_keys()
        if self.trainer is None:
            self.trainer = self.trainer_factory(reply)
            stub.Join(
                serde.join_request_to_proto(JoinRequest(__version__, self.trainer.num_examples)),
                metadata=self._metadata,
                timeout=30,
            )
        backoff.reset()
        log.info("joined run %s as %s", reply.run_id, reply.client_id)
        while True:
            task = serde.task_from_proto(
                stub.PollTask(
                    serde.poll_request_to_proto(PollRequest(self.last_round)),
                    metadata=self._metadata,
                    timeout=60,
                )
            )
            if task.kind is TaskKind.FINISHED:
                log.info("run finished: %s", task.message)
                return task.message
            if task.kind is TaskKind.WAIT:
                continue  # the server long-polls; ask again at once
            if task.kind in (TaskKind.TRAIN, TaskKind.EVALUATE):
                refusal = (
                    self._refuse_training(task)
                    if task.kind is TaskKind.TRAIN
                    else self.site.evaluation_refusal(
                        self._run_config, self._run_id, task.round, task.nonce
                    )
                )
                if refusal:
                    what = "training" if task.kind is TaskKind.TRAIN else "evaluation"
                    log.error("round %d: %s task refused: %s", task.round, what, refusal)
                    # said at once, so that the round (or its cohort) does not wait for it
                    self._withdraw(stub, task, WithdrawReason.DECLINED)
                    self.sleep(1.0)  # a server that insists is not answered in a tight loop
                    continue
            self._do_task(stub, task)

    def _refuse_training(self, task: Task) -> str:
        """Why this client will not train on ``task`` ("" if it will).

        Each update this client releases spends privacy; the server's ledger counts one
        release per round. So a task already answered, an older round, or more attempts of a
        round than the run's ``server.max_retries`` allows are refused, and so is an update
        past the site's own epsilon budget (:class:`privacy.ledger.site_ledger.SiteLedger`, which
        keeps the releases across restarts). (The local settings' ranges are checked when the
        task is read: :func:`fl_secure.serde.check_training`.)
        """
        privacy = getattr(self.trainer, "privacy", None)  # ClientPrivacy | None
        return self.site.refusal(
            self._run_config,
            self._run_id,
            task.round,
            task.nonce,
            last_round=self.last_round,
            # example level: the steps the task would train, held against the site's budget
            dpsgd=privacy.planned_dpsgd(task.training) if privacy is not None else None,
        )

    def _hold_run_config(self, run_config_toml: str, run_id: str = "") -> None:
        """Keep the run config and id of the first join; refuse others on a later join.

        Each round's secure-aggregation setup is then checked against it
        (:func:`privacy.secagg.round_setup.check_setup`), so a later message cannot weaken the
        protection this client joined under (drop the masking or the noise, lower the
        threshold).

        The run id keys this site's releases (:meth:`_refuse_training`): a server that
        changed it between joins would start the per-round limits afresh.

        Raises:
            ConfigError: the config is not valid.
            ProtocolError: the server sends another config or run id than at the first join.
            PrivacyError: the run cannot keep the site's own epsilon budget.
        """
        if self._run_config_toml is not None:
            if run_config_toml != self._run_config_toml or run_id != self._run_id:
                raise ProtocolError(
                    f"the server's run {'config' if run_id == self._run_id else 'id'} differs "
                    "from the one this client joined under; restart the client to join the "
                    "new run"
                )
            return
        try:
            config = config_from_dict(tomllib.loads(run_config_toml))
            check_config(config)
        except (tomllib.TOMLDecodeError, FlSecureError) as exc:
            raise ConfigError(f"the server sent an invalid run config: {exc}") from exc
        self.site.check_run(config, run_id)
        self._run_config, self._run_config_toml, self._run_id = config, run_config_toml, run_id

    def _load_signing_keys(self) -> None:
        """Load this site's signing key at join when the run masks updates (SecAgg/SecAgg+).

        A missing or damaged key, or one that is not the key the CA-signed registry enrolls for
        this site (a stale copy after a re-issue, which the peers would reject), then stops
        the client before it takes part in any round, instead of in the middle of the first
        secure round, where the cohort waits for it.
        The scheme is the joined run config's (:meth:`_hold_run_config` has read it).
        A registry older than one this site accepted before does not stop it: it is logged,
        and each secure round refuses it (:meth:`_secure_round`) until the operator's newest
        registry is in place.
        """
        if self._signing is not None or self._run_config is None:
            return
        if self._run_config.secure_aggregation.scheme not in ("secagg", "secagg+"):
            return
        try:
            self._signing = self._load_identity()
        except RegistryRollbackError as exc:
            log.error("secure rounds will be refused: %s", exc)

    def _load_identity(self) -> tuple[Ed25519PrivateKey, dict[str, Ed25519PublicKey]]:
        """This site's signing key and the CA-signed registry, checked against its record.

        A registry older than the newest this site accepted (it may still list a revoked
        site's key), or another one of the same version, is refused; a newer one is recorded
        in the site's state folder (``registry_seen.json``), or without one next to its keys
        (``clients/<id>.registry_seen.json``), so that the refusal survives a restart.

        Raises:
            TlsError: no certificate folder, or the key or registry is refused
                (:func:`fl_secure.tls.identity.load_signing_identity`).
        """
        site = self.conn.site_dir
        if site is None:
            raise TlsError("secure aggregation needs the certificate folder (signing keys)")
        if self._registry_seen is None:
            state = self.site.path.parent if self.site.path is not None else None
            self._registry_seen = RegistrySeen(seen_path(state, site, self.conn.client_id))
        return load_signing_identity(site, self.conn.client_id, seen=self._registry_seen)

    def _do_task(self, stub: pb_grpc.FlSecureStub, task: Task) -> None:
        trainer = self.trainer
        if trainer is None:  # pragma: no cover - set in _session
            raise RuntimeError("no trainer")
        if task.kind is TaskKind.TRAIN and not self._accept_ledger_head(task):
            return

        def fetch() -> Tensors:
            chunks = stub.GetParameters(
                serde.parameters_request_to_proto(ParametersRequest(task.round, task.nonce)),
                metadata=self._metadata,
                timeout=600,
            )
            limit = max(task.parameters_bytes, 1) + 1024
            return serde.parameters_from_chunks(chunks, max_bytes=limit)[1]

        if task.kind is TaskKind.TRAIN and task.secagg_setup:
            # The key stages (which wait for the whole cohort) come before training; the
            # download runs alongside them, so no stage waits for a client's download.
            self._secure_round(stub, task, fetch, time.monotonic())
            return
        scheme = self._run_config.secure_aggregation.scheme if self._run_config else "none"
        if task.kind is TaskKind.TRAIN and scheme != "none":
            log.error(
                "round %d: refused: a training task without a secure-aggregation setup, in a "
                "run that joined with secure_aggregation.scheme = %r (the update would leave "
                "this site unmasked)",
                task.round,
                scheme,
            )
            return
        try:
            shared = fetch()
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.FAILED_PRECONDITION:
                raise
            # the round (attempt) closed before the download began: wait for the next task
            log.warning("round %d: parameters refused: %s", task.round, exc.details())
            return
        started = time.monotonic()
        if task.kind is TaskKind.TRAIN:
            update, examples, metrics = trainer.train(shared, task.training)
        else:
            update = type(shared)()
            examples, metrics = trainer.evaluate(shared)
        metrics = {**metrics, "local_seconds": time.monotonic() - started}
        header = UpdateHeader(
            round=task.round, nonce=task.nonce, num_examples=examples, metrics=metrics
        )
        # under DP only data-independent figures leave: no count, schedule or time
        header = released_header(
            header, unit=self._privacy_unit(), train=task.kind is TaskKind.TRAIN
        )
        if task.kind is TaskKind.TRAIN:
            self._count_release(task, metrics)  # before it may leave: a failed upload too
        else:  # evaluation figures are not covered by DP: a run has two, each counted
            self.site.record_evaluation(self._run_id, task.round, task.nonce)
        try:
            reply = serde.submit_reply_from_proto(
                stub.SubmitUpdate(
                    serde.update_to_chunks(header, update), metadata=self._metadata, timeout=600
                )
            )
            log.info("round %d: %s", task.round, reply.message)
        except grpc.RpcError as exc:
            if exc.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.FAILED_PRECONDITION,
            ):
                log.warning("round %d: update refused: %s", task.round, exc.details())
                return
            raise
        self.last_round = task.round
        self.rounds_done += 1

    def _accept_ledger_head(self, task: Task) -> bool:
        """Check and keep the server's signed ledger head a training task carries.

        A head the site cannot accept (:class:`~privacy.ledger.site_heads.SiteHeads`: a bad
        signature, another key, fewer entries than one seen before) means the server's ledger
        lost entries or was rewritten: the site does not train for it.
        """
        if self._heads is None or self._heads.run_id != self._run_id:
            state = self.site.path.parent if self.site.path is not None else None
            self._heads = SiteHeads(state, self._run_id)
        try:
            self._heads.accept(task.ledger_head, task.round)
        except PrivacyError as exc:
            log.error("round %d: refused: %s", task.round, exc)
            return False
        return True

    def _privacy_unit(self) -> str:
        """The run's ``privacy.unit`` (``none`` without DP): what may leave beside an update."""
        privacy = getattr(self.trainer, "privacy", None)  # ClientPrivacy | None
        if privacy is not None:
            return str(privacy.cfg.unit)
        return self._run_config.privacy.unit if self._run_config is not None else "none"

    def _count_release(self, task: Task, metrics: dict[str, float] | None = None) -> None:
        """Count this training task's update in the site ledger, before it may leave.

        Saved before the upload starts, so a crash or a failed upload never leaves a release
        uncounted. ``metrics``: the update's, whose ``dp_*`` figures (example level) give the
        DP-SGD steps it was trained with.
        """
        if self._run_config is None:  # pragma: no cover - _session holds it before any task
            raise RuntimeError("a release before the run config was held")
        dpsgd = ClientPrivacy.released_dpsgd(metrics or {})
        row = self.site.record(self._run_config, self._run_id, task.round, task.nonce, dpsgd)
        if row is None or row.unit not in ("client", "example", "identity"):
            return
        if row.unit == "client":
            honest = self.site.epsilon(colluding_peers=False)
            colluding = self.site.epsilon(colluding_peers=True)
            figure = f"epsilon against the server {honest:.4g} ({colluding:.4g} if the other "
            figure += "sites collude)"
        else:
            figure = f"example-level epsilon (one training image) {self.site.example_epsilon():.4g}"
            if row.unit == "identity":  # the same DP-SGD releases bound one whole person too
                figure += " (identity level: also one person's images)"
        log.info(
            "round %d: site ledger: %d releases; this site's %s, delta %g",
            task.round,
            len(self.site.releases),
            figure,
            self.site.delta,
        )

    def _secure_round(
        self,
        stub: pb_grpc.FlSecureStub,
        task: Task,
        fetch: Callable[[], Tensors],
        started: float,
    ) -> None:
        """A TRAIN round under secure aggregation: the server only learns the cohort's sum.

        Refused before any stage (and the server told) when the setup's scheme is not the
        one the run joined under, its round id was seen before, or (masking) this site's
        signing key or the registry is refused (:meth:`_load_identity`); on a local failure the
        client withdraws with the failure's category (:func:`client.secure_round.withdraw_reason`).
        """
        trainer = self.trainer
        run_config = self._run_config
        assert trainer is not None and run_config is not None
        site = self.conn.site_dir
        if site is None:
            raise TlsError("secure aggregation needs the certificate folder (signing keys)")
        ckks = is_ckks_setup(task.secagg_setup)
        scheme = run_config.secure_aggregation.scheme
        if scheme != "ckks" if ckks else scheme not in ("secagg", "secagg+"):
            # e.g. a CKKS round in a masked run: distributed DP noise would be left out
            log.error(
                "round %d: refused: a %s setup in a run that joined with "
                "secure_aggregation.scheme = %r",
                task.round,
                "CKKS" if ckks else "masking (SecAgg)",
                scheme,
            )
            self._withdraw(stub, task, WithdrawReason.MESSAGE_REFUSED)
            return
        try:  # a round id this site has seen is a replay: refused before any stage
            parsed = (CkksSetup if ckks else RoundSetup).from_bytes(task.secagg_setup)
            self._first_use(parsed.round_id)
            # read each round (CKKS signs its upload, masking its advertisements): a registry
            # older than one this site accepted is refused
            self._signing = self._load_identity()
        except FlSecureError as exc:
            log.error("round %d: refused: %s", task.round, exc)
            self._withdraw(stub, task, WithdrawReason.MESSAGE_REFUSED)
            return
        exchange = SecureExchange(
            stub,
            task,
            self._metadata,
            trainer=trainer,
            run_config=run_config,
            fetch=fetch,
            started=started,
            count_release=self._count_release,
        )
        self._attend = exchange.attend  # held for the round (see SecureExchange)
        finished = False
        try:
            assert self._signing is not None
            identity, registry = self._signing
            if ckks:
                if self._ckks_secret is None:
                    self._ckks_secret = load_secret_context(site)
                exchange.ckks(
                    CkksSetup.from_bytes(task.secagg_setup),
                    self._ckks_secret,
                    CkksMember(
                        self.conn.client_id,
                        identity,
                        registry,
                        min_clients=run_config.server.min_clients,
                        flooding_bits=run_config.secure_aggregation.ckks_flooding_bits,
                    ),
                )
            else:
                setup = RoundSetup.from_bytes(task.secagg_setup)
                check_setup(setup, run_config, self.conn.client_id, registry)
                exchange.masked(setup, self.conn.client_id, identity, registry)
            finished = True
        except Exception as exc:
            # Say so at once, so that the cohort does not wait for this client to a deadline.
            self._withdraw(stub, task, withdraw_reason(exc, exchange.training_failed))
            if isinstance(exc, grpc.RpcError) and exc.code() in (
                grpc.StatusCode.ABORTED,
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.INVALID_ARGUMENT,
            ):
                log.warning("round %d: secure aggregation ended: %s", task.round, exc.details())
                return
            if isinstance(exc, FlSecureError):  # a peer's bad key or share: the round is lost
                log.warning("round %d: secure aggregation refused: %s", task.round, exc)
                return
            raise
        finally:
            exchange.close(finished)
        log.info("round %d: masked update in the secure sum", task.round)
        self.last_round = task.round
        self.rounds_done += 1

    def _first_use(self, round_id: bytes) -> None:
        """Refuse a secure round whose id this site has seen (kept in its site ledger)."""
        if not self.site.first_use(round_id):
            raise ProtocolError(
                f"secure round id {round_id.hex()} was used before: a replayed round (its "
                "signed key advertisements could be an earlier round's)"
            )

    def _withdraw(self, stub: pb_grpc.FlSecureStub, task: Task, reason: WithdrawReason) -> None:
        """Leave a secure round this client can no longer finish (best effort)."""
        message = SecAggMessage(
            round=task.round,
            nonce=task.nonce,
            stage=SecAggStage.WITHDRAW,
            withdraw_reason=reason,
        )
        try:
            stub.SecAggExchange(
                serde.secagg_message_to_proto(message), metadata=self._metadata, timeout=10
            )
        except grpc.RpcError as exc:  # the round is over, or the server is out of reach
            log.info("round %d: withdrawal not delivered: %s", task.round, exc.code())
