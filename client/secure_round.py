"""The calls of one secure-aggregation TRAIN round on the client (SecAgg/SecAgg+ or CKKS).

:class:`client.app.FlClient` decides whether it takes part in a round (the scheme it joined
under, a replayed round id, its keys) and what it tells the server when the round fails;
:class:`SecureExchange` runs the round on the wire once it does: the attendance call held open
for the whole round, the key stages, the download of the global parameters alongside them,
local training, the masked (or encrypted) upload and the unmasking. The protocol itself is
:func:`privacy.secagg.client_round.client_secure_update` or
:func:`privacy.ckks.client_round.client_ckks_update`; this module gives it the calls.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from fl_secure import serde
from fl_secure.errors import FlSecureError, PrivacyError, ProtocolError, RoundAborted, UpdateError
from fl_secure.messages import SecAggMessage, SecAggStage, UpdateHeader, WithdrawReason

# the round functions are looked up on their modules at call time: tests replace them there
from privacy.ckks import client_round as ckks_client_round
from privacy.ckks.round_setup import CKKS_TENSOR, check_ckks_setup
from privacy.secagg import client_round as secagg_client_round
from privacy.secagg.consistency import ConsistencyFailed
from privacy.secagg.stages import MASKED, MASKED_TENSOR, WIRE_STAGES, wire_dtype
from privacy.site_figures import released_header

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

    from client.trainer import LocalTrainer
    from fl_secure.config import Config
    from fl_secure.messages import Task, Tensors
    from fl_secure.v1 import transport_pb2_grpc as pb_grpc
    from privacy.ckks.client_round import CkksMember
    from privacy.ckks.round_setup import CkksSetup
    from privacy.secagg.round_setup import RoundSetup

#: Training metrics a secure round's upload may carry besides ``dp_*`` (no loss or accuracy).
#: Under DP not even these (:func:`privacy.site_figures.released_header`): the schedule is
#: epochs x N / batch without ``train.local_steps``.
SECURE_METRICS = frozenset({"local_steps"})


class SecureExchange:
    """One secure round on the wire, from the attendance call to the unmasking.

    Starts, when constructed, the attendance call and the download of the global parameters
    (public to the cohort: it runs while the key stages do; training starts only after them).
    Then :meth:`masked` or :meth:`ckks` runs the protocol, and :meth:`close` always follows.

    Args:
        stub: the client's channel to the server.
        task: the round's TRAIN task.
        metadata: what every call sends beside its message.
        trainer: this site's local trainer.
        run_config: the run config the client joined under.
        fetch: downloads the task's global parameters.
        started: when the task began (``time.monotonic()``), for ``local_seconds``.
        count_release: counts the update in the site ledger, before it may leave.
    """

    def __init__(
        self,
        stub: pb_grpc.FlSecureStub,
        task: Task,
        metadata: tuple[tuple[str, str], ...],
        *,
        trainer: LocalTrainer,
        run_config: Config,
        fetch: Callable[[], Tensors],
        started: float,
        count_release: Callable[[Task, dict[str, float]], None],
    ) -> None:
        self.stub, self.task, self.metadata = stub, task, metadata
        self.trainer, self.run_config = trainer, run_config
        self.started, self.count_release = started, count_release
        #: Set when local training raised: the withdrawal then says so.
        self.training_failed = False
        self.metrics: dict[str, float] = {}
        self.timeout = max(60.0, (task.deadline_unix_ms / 1000.0) - time.time() + 60.0)
        # Held open for the whole round, so that the server notices at once if this process
        # dies (the call closes); the server answers it when the round ends. The client keeps
        # it: gRPC cancels a call whose future is garbage collected. No deadline: the unmasking
        # may run a stage timeout past the round's deadline, and an expired call would tell
        # the server this client had gone. Nothing waits for its reply.
        self.attend: Any = stub.SecAggExchange.future(
            serde.secagg_message_to_proto(
                SecAggMessage(round=task.round, nonce=task.nonce, stage=SecAggStage.ATTEND)
            ),
            metadata=metadata,
        )
        # The "masked input" call only waits for the server's unmask request (sent once every
        # upload is in); it is started with the upload (see _upload) so that the request
        # reaches this client without a round trip after the upload's reply.
        self._pending: dict[int, Any] = {}
        # The global parameters download while the key stages run (they are public to the
        # cohort); training starts only after the key stages, as before.
        self._parameters = _background(fetch)
        self._setup: RoundSetup | None = None
        self._ckks_setup: CkksSetup | None = None

    def masked(
        self,
        setup: RoundSetup,
        client_id: str,
        identity: Ed25519PrivateKey,
        registry: Mapping[str, Ed25519PublicKey],
    ) -> None:
        """SecAgg/SecAgg+: the masked update goes into the cohort's sum (``setup`` checked)."""
        self._setup = setup
        # looked up on the module when called: tests replace it there to make a client fail
        # at a chosen point of the protocol
        secagg_client_round.client_secure_update(
            setup, client_id, identity, registry, self._exchange, self._compute, self._upload
        )

    def ckks(self, setup: CkksSetup, secret: bytes, member: CkksMember) -> None:
        """CKKS: the signed encrypted update goes into the cohort's sum."""
        self._ckks_setup = setup
        ckks_client_round.client_ckks_update(
            setup, secret, member, self._exchange, self._compute, self._upload
        )

    def close(self, finished: bool) -> None:
        """Cancel a call a failed round left over; leave the round if it did not finish."""
        for call in self._pending.values():
            call.cancel()
        if not finished:  # leaving the round (as a killed process would)
            self.attend.cancel()

    def _start(self, stage: int, payload: bytes) -> Any:  # a grpc.Future of the reply
        message = SecAggMessage(
            round=self.task.round,
            nonce=self.task.nonce,
            stage=SecAggStage(WIRE_STAGES[stage]),  # the session's numbers differ
            payload=payload,
        )
        return self.stub.SecAggExchange.future(
            serde.secagg_message_to_proto(message), metadata=self.metadata, timeout=self.timeout
        )

    def _exchange(self, stage: int, payload: bytes) -> bytes:
        call = self._pending.pop(stage, None)
        if call is None:
            call = self._start(stage, payload)
        elif payload:  # pragma: no cover - only the empty "masked input" call is started
            raise FlSecureError("a secure-aggregation call was started with another payload")
        return serde.secagg_message_from_proto(call.result()).payload

    def _compute(self) -> Tensors:  # after the key stages: the download, then training
        params = self._parameters.result()
        if self._ckks_setup is not None:  # the layers it encrypts, against the shared ones
            check_ckks_setup(self._ckks_setup, self.run_config, list(params))
        try:
            update, _, found = self.trainer.train(params, self.task.training)
        except BaseException:
            self.training_failed = True
            raise
        # Only the schedule and the DP bookkeeping go beside a masked upload: a training
        # loss or accuracy in the clear would tell the server about this site's update.
        self.metrics.update(
            {k: v for k, v in found.items() if k in SECURE_METRICS or k[:3] == "dp_"}
        )
        return update

    def _upload(self, vector: np.ndarray) -> None:
        # The example count is not sent: the secure sum is an unweighted one. Under DP
        # neither are the schedule and the time (they grow with the site's data).
        task = self.task
        header = UpdateHeader(
            round=task.round,
            nonce=task.nonce,
            num_examples=1,
            metrics={**self.metrics, "local_seconds": time.monotonic() - self.started},
        )
        header = released_header(header, unit=self.run_config.privacy.unit, train=True)
        if self._setup is None:  # CKKS
            tensors = OrderedDict([(CKKS_TENSOR, vector.astype(np.uint8))])
        else:
            dtype = wire_dtype(self._setup)
            tensors = OrderedDict([(MASKED_TENSOR, vector.astype(dtype, copy=False))])
            # Nothing is revealed before the upload has succeeded and the request is in:
            # client_secure_update reads the reply only after upload() returned.
            self._pending[MASKED] = self._start(MASKED, b"")
        try:
            self.count_release(task, self.metrics)  # before the masked/encrypted update leaves
            self.stub.SubmitUpdate(
                serde.update_to_chunks(header, tensors), metadata=self.metadata, timeout=600
            )
        except BaseException:
            call = self._pending.pop(MASKED, None)
            if call is not None:
                call.cancel()
            raise


def withdraw_reason(exc: BaseException, training_failed: bool) -> WithdrawReason:
    """The category of a secure round's local failure that a withdrawal tells the server.

    Only the category leaves the client (``WithdrawReason``), never the error's text, which
    may quote data-dependent values.
    """
    if isinstance(exc, UpdateError):  # before training: a diverged model's update is refused
        return WithdrawReason.UPDATE_REFUSED
    if training_failed:
        return WithdrawReason.LOCAL_TRAINING
    if isinstance(exc, grpc.RpcError):
        return WithdrawReason.TRANSPORT
    if isinstance(exc, RoundAborted):  # a client raises it for too few neighbours only
        return WithdrawReason.TOO_FEW_SHARES
    if isinstance(exc, ConsistencyFailed):  # it revealed nothing: the server may be hostile
        return WithdrawReason.CONSISTENCY
    if isinstance(exc, (ProtocolError, PrivacyError)):
        return WithdrawReason.MESSAGE_REFUSED
    return WithdrawReason.OTHER


def _background(work: Callable[[], Tensors]) -> Future[Tensors]:
    """Run ``work`` in a daemon thread (it never holds up the process's exit)."""
    future: Future[Tensors] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():  # pragma: no cover - never cancelled
            return
        try:
            future.set_result(work())
        except BaseException as exc:  # handed to whoever waits for the result
            future.set_exception(exc)

    threading.Thread(target=run, name="fl-secure-prefetch", daemon=True).start()
    return future
