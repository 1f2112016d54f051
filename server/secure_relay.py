"""Secure aggregation on the server: the SecAgg / SecAgg+ stages and CKKS rounds, relayed.

The server holds no key that opens an update. For SecAgg and SecAgg+ (Bonawitz et al. 2017;
Bell et al. 2020) it relays the cohort's key advertisements and encrypted shares, closes each
stage when every live member answered or its clock ran out, asks the survivors for the shares
that unmask the sum, and dequantizes that sum; for CKKS it checks and keeps the clients'
signed ciphertexts and has one or two clients sum and decrypt them. The cryptography is
:mod:`privacy.secagg` and :mod:`privacy.ckks`; this module keeps their sessions in step with
the open attempt (:class:`server.attempt.Attempt`) and the clients' calls.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_secure.errors import PrivacyError, ProtocolError, RoundAborted
from fl_secure.logsafe import safe
from privacy.secagg.round_setup import make_setup
from privacy.secagg.server_round import ServerSecureRound
from privacy.secagg.stages import (
    ADVERTISE,
    CONSISTENCY,
    DONE,
    SHARE,
    STAGE_NAMES,
    UNMASK,
    WITHDRAW_REASONS,
)
from privacy.secagg.vectors import unflatten

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable, Mapping

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from fl_secure.messages import Tensors, TensorSpec
    from privacy.ckks.server_round import ServerCkksRound
    from privacy.server_round import ServerPrivacy
    from server.attempt import Attempt, RoundBoard
    from server.settings import CoordinatorSettings

log = logging.getLogger(__name__)


class SecureRelay:
    """Starts an attempt's secure session and moves its stages along with the clients' calls.

    Every method that takes an :class:`~server.attempt.Attempt` runs under the board's cv.
    """

    def __init__(
        self,
        board: RoundBoard,
        settings: CoordinatorSettings,
        specs: list[TensorSpec],
        *,
        privacy: ServerPrivacy | None = None,
        signing_registry: Mapping[str, Ed25519PublicKey] | None = None,
    ) -> None:
        self.board = board
        self.settings = settings
        self.specs = specs
        self.privacy = privacy
        self.signing_registry = dict(signing_registry or {})

    # ------------------------------------------------------------------ start
    def start(
        self, number: int, attempt: int, cohort: list[str]
    ) -> ServerSecureRound | ServerCkksRound:
        """The secure session of an attempt of round ``number`` over ``cohort``.

        Raises:
            RoundAborted: It cannot start for this cohort (e.g. no graph fits its size).
        """
        cfg = self.settings.secure_aggregation
        assert cfg is not None
        length = sum(int(np.prod(sp.shape, dtype=np.int64)) for sp in self.specs)
        try:
            if cfg.scheme == "ckks":
                return self._ckks_round(number, attempt, cohort)
            setup = make_setup(
                cfg,
                run_id=self.settings.run_id,
                round_=number,
                attempt=attempt,
                cohort=cohort,
                vector_length=length,
                ddg=self._ddg(),
                min_inputs=self.settings.min_clients,
            )
            return ServerSecureRound(
                setup, self.signing_registry, cfg.stage_timeout, self.board.clock
            )
        except PrivacyError as exc:
            raise RoundAborted(f"round {number}: secure aggregation cannot start: {exc}") from exc

    def _ckks_round(self, number: int, attempt: int, cohort: list[str]) -> ServerCkksRound:
        """A CKKS round: encrypted uploads summed here, decrypted by one or two clients."""
        # deferred: privacy.ckks imports tenseal, which only CKKS runs need
        from privacy.ckks.round_setup import CkksSetup, shared_layers
        from privacy.ckks.server_round import ServerCkksRound

        cfg = self.settings.secure_aggregation
        assert cfg is not None
        if not self.settings.ckks_public_context:
            raise RoundAborted("secure_aggregation.scheme = 'ckks' but no CKKS context is loaded")
        # random too: a resumed run repeats the round's number and attempt
        tag = f"fl-secure/ckks/{self.settings.run_id}/{number}/{attempt}/".encode()
        tag += secrets.token_bytes(16)
        setup = CkksSetup(
            round_id=hashlib.sha256(tag).digest()[:16],
            cohort=tuple(sorted(cohort)),
            layers=shared_layers([sp.name for sp in self.specs], cfg.ckks_layers),
            min_count=self.settings.min_clients,
            decryptors=cfg.ckks_decryptors,
        )
        return ServerCkksRound(
            setup, self.settings.ckks_public_context, list(self.specs), cfg.stage_timeout,
            self.board.clock, registry=self.signing_registry,
            flooding_bits=cfg.ckks_flooding_bits,
        )  # fmt: skip

    def _ddg(self) -> tuple[float, float, int] | None:
        """(z, C, t) when client-level DP noise is distributed: integer noise under SecAgg."""
        plan = self.privacy.plan if self.privacy is not None else None
        if plan is None or plan.placement != "distributed":
            return None
        return plan.noise_multiplier, plan.clip_norm, self.settings.min_clients

    # ------------------------------------------------------- clients' calls
    def exchange(
        self, client_id: str, round_: int, nonce: bytes, stage: int, payload: bytes
    ) -> bytes:
        """One secure-aggregation stage message; waits until the stage has closed.

        ``stage`` is the internal stage number of :mod:`privacy.secagg` (advertise,
        share, consistency: submit then wait; masked: wait for the unmask request; unmask:
        submit).
        """
        board = self.board
        with board.cv:
            rnd, sec = board.secure_member(client_id, round_, nonce)
            if stage in (ADVERTISE, SHARE, CONSISTENCY, UNMASK):
                sec.submit(stage, client_id, payload)
                board.cv.notify_all()
                if stage == UNMASK:
                    return sec.reply(stage, client_id)
            while sec.stage <= stage and not sec.aborted and not board.stopping:
                if board.current is not rnd:
                    raise RoundAborted(f"round {round_} closed before its secure stages ended")
                if stage in (ADVERTISE, SHARE) and sec.stage == stage and sec.ready():
                    self.close_stage(rnd)
                    break
                board.cv.wait(timeout=0.25)
            return sec.reply(stage, client_id)

    def attend(
        self,
        client_id: str,
        round_: int,
        nonce: bytes,
        alive: Callable[[], bool],
        wake: threading.Event,
    ) -> None:
        """Hold a cohort member's attendance call until its secure round ends.

        ``alive`` tells whether the call is still open; ``wake`` is set when it closes (a
        gRPC callback) and when the round ends. A call that closes first means the client is
        gone (its process died, or its link): the round stops waiting for it at once instead
        of at a deadline (:meth:`client_gone`). The wait is on ``wake``, not on the board's
        condition, so the round's every step does not wake every attendance handler.
        """
        board = self.board
        with board.cv:
            rnd, sec = board.secure_member(client_id, round_, nonce)
            if client_id in rnd.attending:
                raise ProtocolError(f"client {client_id} already attends round {round_}")
            rnd.attending[client_id] = wake
        try:
            while True:
                wake.wait(timeout=5.0)
                wake.clear()  # before the checks: a later wake-up is not lost
                with board.cv:
                    if board.current is not rnd or sec.aborted or board.stopping:
                        return
                    if not alive():
                        where = STAGE_NAMES[sec.stage]
                        self.client_gone(rnd, client_id, f"disconnected at {where}")
                        return
        finally:
            with board.cv:
                rnd.attending.pop(client_id, None)

    def withdraw(self, rnd: Attempt, client_id: str, reason: int) -> None:
        """``client_id`` leaves the attempt's secure session (it failed locally): a dropout.

        ``reason`` is the client's ``WithdrawReason``; a number this server does not know
        (a newer client's) reads as no reason.

        Raises:
            ProtocolError: The attempt is not securely aggregated.
        """
        if rnd.secure is None:
            raise ProtocolError(f"round {rnd.number} is not securely aggregated")
        why = WITHDRAW_REASONS.get(reason, "")
        how = f"withdrew at {STAGE_NAMES[rnd.secure.stage]}" + (f" ({why})" if why else "")
        self.client_gone(rnd, client_id, how)

    def client_gone(self, rnd: Attempt, client_id: str, how: str) -> None:
        """``client_id`` left the secure round: its open call closed, or it withdrew.

        No stage waits for it any more; if it has not uploaded, it never will, and the round
        stops waiting for its update too. The protocol then treats it as it treats a client
        that missed a deadline.
        """
        sec = rnd.secure
        assert sec is not None
        if client_id in sec.gone:  # withdrew, then its attendance call closed
            return
        sec.mark_gone(client_id)
        rnd.fail(client_id, f"secure aggregation: {how}")
        log.warning(
            "round %d: %s left secure aggregation: %s", rnd.number, safe(client_id), safe(how)
        )
        self.board.cv.notify_all()

    # ------------------------------------------------------------ the driver
    def close_stage(self, rnd: Attempt) -> None:
        """Close the open secure stage; late clients count as dropped."""
        sec = rnd.secure
        assert sec is not None
        try:
            sec.close_stage()
        finally:
            for client, where in sec.dropped.items():
                rnd.fail(client, f"dropped at secure-aggregation stage {where}")
            self.board.cv.notify_all()

    def close_ready_key_stage(self, rnd: Attempt) -> str | None:
        """Close the advertise or share stage once every live member answered.

        Returns:
            None, or why the session aborted when the stage closed.
        """
        sec = rnd.secure
        if sec is not None and sec.stage < 2 and sec.ready():
            try:
                self.close_stage(rnd)
            except RoundAborted as exc:
                return str(exc)
        return None

    def unmask(self, rnd: Attempt) -> str:
        """After the masked inputs: ask for shares, wait for them, unmask.

        Returns:
            "" once the sum is unmasked, or why the session aborted.
        """
        sec = rnd.secure
        assert sec is not None
        try:
            if sec.stage < 2:
                raise RoundAborted(
                    "secure aggregation aborted: the round ended before the key stages completed"
                )
            self.close_stage(rnd)  # masked input -> unmask request
            # SecAgg: consistency check -> signatures, then unmask -> the sum (CKKS: unmask)
            while sec.stage < DONE:
                while not self.board.stopping and not sec.ready():
                    self.board.cv.wait(timeout=0.25)
                self.close_stage(rnd)
        except RoundAborted as exc:
            return str(exc)
        return ""

    def record(self, rnd: Attempt, error: str) -> dict[str, Any]:
        """The attempt's secure-aggregation record (metrics.jsonl, the report)."""
        sec = rnd.secure
        assert sec is not None
        return {
            **sec.record(),
            "survivors": list(sec.survivors()) if not error else [],
            "dropped": dict(sorted(sec.dropped.items())),
            # seen to leave (a closed attendance call or a withdrawal), not at a deadline
            "left": sorted(sec.gone),
            "aborted": error,
        }

    def mean(self, rnd: Attempt) -> Tensors:
        """The attempt's aggregate update from the unmasked sum of the survivors."""
        sec = rnd.secure
        assert sec is not None
        total = unflatten(sec.decoded_sum(), self.specs)
        count = len(sec.survivors())
        if self.privacy is not None and self.privacy.plan is not None:  # client-level DP
            return self.privacy.finish_sum(total, self.specs)
        return OrderedDict((s.name, (total[s.name] / count).astype(s.dtype)) for s in self.specs)
