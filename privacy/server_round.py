"""The server's side of a run's privacy, round by round: mechanism, accountant, ledger, budget.

:class:`ServerPrivacy` is the one object the coordinator calls for privacy, once per round
(its client-side counterpart is :class:`privacy.client_round.ClientPrivacy`). It stays one
class a little over 500 lines because its methods share the running accountant state; its
stateless parts live in :mod:`privacy.dp.example_level`, :mod:`privacy.ledger.resume` and
:mod:`privacy.ledger.inflight`.

Order of a round's release (what makes the ledger the source of truth):

1. before each attempt of the round (a retry too, after the sums the server saw in failed
   attempts are composed): :meth:`ServerPrivacy.budget_stop` computes the epsilon the attempt
   would bring and stops the run if it would pass ``privacy.target_epsilon``;
2. after aggregation: :meth:`ServerPrivacy.round_entries` computes the round's ledger
   entries, which the coordinator stores in the round's checkpoint state;
3. :meth:`ServerPrivacy.commit` appends and syncs them to ``ledger.sqlite``;
4. only then does the coordinator release the model (the next round's cohort receives it).

A crash between 2 and 3 leaves a checkpoint whose entries are not in the ledger:
:meth:`ServerPrivacy.resume` appends them before anything is released. A crash before 2
leaves neither, and the round is run again. Either way nothing is counted twice or forgotten.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fl_secure.config import PrivacyConfig
from fl_secure.errors import PrivacyError
from fl_secure.messages import LocalTraining, Tensors, TensorSpec
from privacy.dp.accountants.accountant import ADJACENCY, ZERO_OUT, client_adjacency
from privacy.dp.accountants.registry import create_accountant
from privacy.dp.amplification import amplification_statement
from privacy.dp.client_level import (
    ClientLevelPlan,
    NoisyClippedSum,
    client_level_plan,
    effective_noise_multiplier,
    server_aggregator,
)
from privacy.dp.example_level import check_example_metrics, example_event, example_payload
from privacy.dp.noise import NoiseSource, SecureGaussian
from privacy.dp.rounding import up_to_places
from privacy.ledger.anchors import STATE_KEY
from privacy.ledger.entries import CLIENT_KINDS, Entry, check_payload
from privacy.ledger.inflight import inflight_path, read_inflight, write_inflight
from privacy.ledger.recompute import client_event
from privacy.ledger.resume import check_same_sampling, resumable_entries
from privacy.ledger.run_ledger import Ledger
from privacy.ledger.signed_head import HeadSigner

log = logging.getLogger(__name__)

#: Budget comparisons allow this relative slack (the accountants' own numerical error).
_BUDGET_SLACK = 1e-9

LedgerRow = dict[str, Any]  # {"kind", "party", "payload"}


class ServerPrivacy:
    """Accounting and enforcement of one run's privacy guarantee on the server."""

    def __init__(
        self,
        cfg: PrivacyConfig,
        ledger: Ledger,
        *,
        plan: ClientLevelPlan | None = None,
        source: NoiseSource | None = None,
        min_survivors: int = 1,
    ) -> None:
        if cfg.unit == "client" and plan is None:
            raise PrivacyError("client-level DP needs a ClientLevelPlan")
        self.cfg = cfg
        self.ledger = ledger
        self.plan = plan
        self.source: NoiseSource = source or SecureGaussian()
        self.accountant_name = cfg.accountant_name()
        self.min_survivors = min_survivors
        self._client_history: list[dict[str, Any]] = []  # rounds and discarded sums
        # the same releases at the drawn rate (the figure that trusts the server's sampling)
        self._amplified_history: list[dict[str, Any]] = []
        self._redrawn_rounds: set[int] = set()  # released by an attempt after a failed one
        self.discarded_sums = 0
        self._example_history: dict[str, list[dict[str, Any]]] = {}
        self.epsilon = 0.0

    # ------------------------------------------------------------ properties
    @property
    def unit(self) -> str:
        """``client``, ``example`` or ``identity``."""
        return self.cfg.unit

    @property
    def placement(self) -> str:
        """Where the noise is added."""
        return self.cfg.noise_placement if self.unit == "client" else "local"

    @property
    def adjacency(self) -> str:
        """Neighbouring relation the guarantee is stated under (see ``client_adjacency``).

        Poisson cohorts: zero-out whatever the placement. The enrolled clients and each
        round's cohort are published, so add/remove (a client absent from the run) would be
        told apart by the client ids alone.
        """
        if self.plan is not None:
            if self.plan.sampling == "poisson":
                return ZERO_OUT
            return client_adjacency(self.plan.sampling, self.plan.placement)
        return ADJACENCY["poisson"]

    # ------------------------------------------------------------ aggregation
    def make_aggregator(self, specs: list[TensorSpec]) -> NoisyClippedSum | None:
        """Client level: the clipped noisy sum; example level: ``None`` (plain weighted mean)."""
        if self.plan is None:
            return None
        return self._aggregator(specs, sees_updates=True)

    def finish_sum(self, total: Mapping[str, Any], specs: list[TensorSpec]) -> Tensors:
        """A securely aggregated sum of clipped updates: ``(sum + central noise) / W``."""
        if self.plan is None:
            raise PrivacyError(
                "example-level DP with secure aggregation: average on the clients' side"
            )
        agg = self._aggregator(specs, sees_updates=False)  # it never sees a single update
        agg.add(total, 1.0)
        return agg.mean()

    def _aggregator(self, specs: list[TensorSpec], *, sees_updates: bool) -> NoisyClippedSum:
        """The plan's DP-FedAvg aggregator (:func:`~privacy.dp.client_level.server_aggregator`)."""
        p = self.plan
        assert p is not None
        return server_aggregator(
            specs,
            placement=p.placement,
            noise_multiplier=p.noise_multiplier,
            clip_norm=p.clip_norm,
            denominator=p.denominator,
            source=self.source,
            sees_updates=sees_updates,
        )

    # ------------------------------------------------------------ accounting
    def _epsilon_of(self, history: list[dict[str, Any]]) -> float:
        acc = create_accountant(self.accountant_name)
        acc.load_state_dict({"mechanism": self.accountant_name, "history": history})
        return acc.get_epsilon(self.cfg.delta)

    def _client_event(self) -> dict[str, Any]:
        if self.plan is None:  # pragma: no cover - guarded by callers
            raise PrivacyError("no client-level plan")
        return self.plan.event()

    def budget_stop(self, round_: int, attempt: int = 0) -> str | None:
        """Why attempt ``attempt`` of round ``round_`` must not run (past the budget), or None.

        Each attempt may release the round (:meth:`discard_sum`), so a retry is held against
        the budget left after the failed attempts' releases, composed like rounds.
        """
        target = self.cfg.target_epsilon
        if target <= 0:
            return None
        what = f"round {round_}" if attempt == 0 else f"round {round_} attempt {attempt}"
        if self.unit == "client":
            after = self._epsilon_of([*self._client_history, self._client_event()])
            if after > target * (1 + _BUDGET_SLACK):
                return self._stop_message(round_, after, what, "the federation")
            return None
        worst, who = 0.0, ""
        for party, history in self._example_history.items():
            if not history:
                continue
            after = self._epsilon_of([*history, dict(history[-1])])
            if after > worst:
                worst, who = after, party
        if worst > target * (1 + _BUDGET_SLACK):
            return self._stop_message(round_, worst, what, f"client {who}")
        return None

    def first_round_over_budget(self) -> float | None:
        """On a fresh client-level ledger: round 1's epsilon if it passes the budget, else None.

        A fixed ``noise_multiplier`` too small for ``target_epsilon`` would otherwise start a
        run that stops before its first round with the untrained model.
        """
        if self.unit != "client" or self._client_history or self.budget_stop(1) is None:
            return None
        return self._epsilon_of([self._client_event()])

    def _stop_message(self, round_: int, after: float, what: str, whose: str) -> str:
        return (
            f"privacy budget reached: {what} would bring {whose}'s epsilon to "
            f"{after:.4f} > target {self.cfg.target_epsilon:g} (delta {self.cfg.delta:g}, "
            f"{self.accountant_name} accountant, {self.adjacency} adjacency); stopped after "
            f"round {round_ - 1} with epsilon {up_to_places(self.epsilon, 4)}"
        )

    def _client_payload(self, cohort_size: int, updates: int, attempt: int) -> dict[str, Any]:
        """A client-level release's payload: its parameters and the epsilon after it."""
        event = self._client_event()
        epsilon = self._epsilon_of([*self._client_history, event])
        p = self.plan
        assert p is not None
        return {
            "noise_multiplier": p.noise_multiplier,
            "clip_norm": p.clip_norm,
            # the rate the epsilon is accounted at (1 for Poisson: no amplification, the
            # cohort is published); the rate the server drew the cohort at beside it
            "sample_rate": p.accounted_rate,
            "cohort_sample_rate": p.sample_rate,
            "sampling": p.sampling,
            "population": p.population,
            "cohort_size": cohort_size,
            "attempt": attempt,
            "updates": updates,
            # noise the released sum carries (>= z): sqrt(m / t) z for distributed shares
            "effective_noise_multiplier": effective_noise_multiplier(
                p.placement, p.noise_multiplier, updates, self.min_survivors
            )
            if p.placement == "distributed"
            else p.noise_multiplier,
            "accountant": self.accountant_name,
            "epsilon": epsilon,
            "delta": self.cfg.delta,
            "noise_placement": p.placement,
            # distributed shares are integers under secure aggregation (KLS21); local noise is
            # integer noise on a grid; both are accounted by their zCDP bound
            "noise_distribution": p.noise,
            "epsilon_bound": "zCDP of the discrete Gaussian (CKS20, KLS21), no amplification"
            if p.noise == "discrete_gaussian"
            else f"{self.accountant_name} accountant, continuous Gaussian",
            "adjacency": self.adjacency,
            "privacy_unit": "client",
            "noise_secure": bool(self.source.secure),
        }

    # ------------------------------------------------------------ in-flight releases
    @property
    def inflight_path(self) -> Path:
        """The marker of an attempt whose release is not yet in the ledger (beside it)."""
        return inflight_path(self.ledger.path)

    def _counts_server_view(self) -> bool:
        """Whether what the server sees of an attempt is a release the ledger must count."""
        return self.unit == "client" and self.placement != "central"

    def begin_release(self, round_: int, attempt: int, cohort_size: int) -> None:
        """Mark that round ``round_``'s attempt may now show the server its updates or sum.

        Written (synced) before the attempt's tasks go out, and removed once what the
        server saw is in the ledger: by :meth:`commit`, or by :meth:`end_release` when the
        coordinator has accounted a failed attempt (:meth:`discard_sum`) and starts the next
        one, or ends the round. A server process that ends in between (killed, crashed)
        leaves the marker, and :meth:`resume` counts that attempt as a discarded sum: it may
        have seen the sum, the clients did release it, and the rerun releases the round again.
        """
        if not self._counts_server_view():
            return
        write_inflight(self.inflight_path, round_, attempt, cohort_size)

    def end_release(self) -> None:
        """Remove the in-flight marker: what the server saw is accounted (or was nothing)."""
        self.inflight_path.unlink(missing_ok=True)

    def _account_inflight(self, completed_round: int) -> None:
        """Resume: count an attempt the last server process left in flight (see above)."""
        marker = read_inflight(self.inflight_path)
        if marker is None:
            return
        round_, attempt, cohort = marker
        if round_ > completed_round and self._counts_server_view():
            reason = (
                f"round {round_} attempt {attempt}: the server process ended before the "
                "round's ledger entry was written, after the cohort had been sent its tasks; "
                "the server may have seen the round's updates or sum, and the resumed run "
                "releases the round again"
            )
            # the least noise such a sum can carry: t = min_survivors shares (distributed)
            self.discard_sum(round_, cohort, min(cohort, self.min_survivors), attempt, reason)
            log.warning("%s; counted in epsilon like a round (ledger kind discarded_sum)", reason)
        self.end_release()

    def discard_sum(
        self, round_: int, cohort_size: int, updates: int, attempt: int, message: str
    ) -> bool:
        """Account a client-level release the server saw and then discarded; True if counted.

        A sum it unmasked and could not decode, or (without secure aggregation) the updates
        of an attempt that then failed: released to the server like any round's. With
        ``local`` or ``distributed`` noise (the guarantee covers the server's view) it is
        composed like a round and committed at once (``discarded_sum``). ``central`` noise
        trusts the server, and nothing left it. Example level: each client's accountant
        counted its own steps, so its next reported epsilon covers them.
        """
        if self.unit != "client" or self.placement == "central":
            return False
        payload = self._client_payload(cohort_size, updates, attempt)
        payload["message"] = message
        check_payload("discarded_sum", payload)
        entry = self.ledger.append("discarded_sum", round=round_, party="server", payload=payload)
        self._absorb(entry)
        return True

    def round_entries(
        self,
        round_: int,
        cohort_size: int,
        client_metrics: Mapping[str, Mapping[str, float]],
        attempt: int = 0,
    ) -> list[LedgerRow]:
        """The ledger rows of a completed round (not yet committed).

        ``attempt``: how many attempts of the round failed before this one. A client-level
        row records it: a cohort drawn again after a failed attempt is conditioned on that
        failure, which the unamplified epsilon of Poisson cohorts bounds; the amplified
        figure is then withdrawn (:mod:`privacy.dp.amplification`), and the report warns
        for fixed-size cohorts.
        """
        if self.unit == "client":
            row = self._client_payload(cohort_size, len(client_metrics), attempt)
            return [{"kind": "client_level", "party": "server", "payload": row}]
        rows: list[LedgerRow] = []
        for party, metrics in sorted(client_metrics.items()):
            payload = example_payload(
                party,
                metrics,
                delta=self.cfg.delta,
                accountant=self.accountant_name,
                clip_norm=self.cfg.clip_norm,
                unit=self.unit,
            )
            reported = payload["client_reported_epsilon"]
            # The server composes the party's rows itself: a client whose accountant was
            # reset (restarted without its --state-dir) reports one round's epsilon only.
            history = [*self._example_history.get(party, []), *example_event(payload)]
            composed = self._epsilon_of(history) if history else 0.0
            payload["epsilon"] = max(composed, reported)  # an upper bound whichever is larger
            check_payload("example_level", payload)  # never checkpoint a row the ledger refuses
            rows.append({"kind": "example_level", "party": party, "payload": payload})
        return rows

    def check_upload_metrics(
        self, party: str, metrics: Mapping[str, float], training: LocalTraining
    ) -> None:
        """Refuse an example-level update whose DP figures the ledger could not account.

        Checked when the upload opens, so a faulty client is refused alone instead of
        failing the round's ledger rows after aggregation (and every resume after them).
        ``dp_steps`` may not exceed what the round's task asks for at the stated rate.

        Raises:
            ProtocolError: Naming the key and what it must be.
        """
        if not self.cfg.dpsgd:
            return
        check_example_metrics(party, metrics, training)

    def commit(self, round_: int, rows: list[LedgerRow]) -> dict[str, Any]:
        """Append and sync the round's rows, update the running epsilon; metrics to record."""
        for row in rows:
            entry = self.ledger.append(
                row["kind"], round=round_, party=row["party"], payload=row["payload"]
            )
            self._absorb(entry)
        self.end_release()
        return self.metrics()

    def _absorb(self, entry: Entry) -> None:
        payload = entry.payload
        if not isinstance(payload, dict):  # pragma: no cover - validated by the ledger
            raise PrivacyError(f"ledger entry {entry.seq} has no payload")
        if entry.kind in CLIENT_KINDS:  # a discarded sum composes like a round
            if entry.kind == "discarded_sum":
                self.discarded_sums += 1
            event = client_event(payload)
            self._client_history.append(event)
            drawn = payload.get("cohort_sample_rate", payload["sample_rate"])
            self._amplified_history.append({**event, "sample_rate": drawn})
            if int(payload.get("attempt") or 0) > 0:  # type: ignore[arg-type]
                self._redrawn_rounds.add(entry.round)
            self.epsilon = float(payload["epsilon"])  # type: ignore[arg-type]
        elif entry.kind == "example_level":
            self._example_history.setdefault(entry.party, []).extend(example_event(payload))
            eps = float(payload["epsilon"])  # type: ignore[arg-type]
            self.epsilon = max(self.epsilon, eps)

    def preview(self, rows: list[LedgerRow]) -> dict[str, Any]:
        """What :meth:`metrics` will say once ``rows`` are committed."""
        out = self.metrics()
        for row in rows:
            eps = float(row["payload"]["epsilon"])
            out["epsilon"] = eps if row["kind"] == "client_level" else max(out["epsilon"], eps)
        return out

    def metrics(self) -> dict[str, Any]:
        """What ``metrics.jsonl`` and ``summary.json`` carry about privacy."""
        return {
            "epsilon": self.epsilon,
            "delta": self.cfg.delta,
            "accountant": self.accountant_name,
            "privacy_unit": self.unit,
            "noise_placement": self.placement,
            "adjacency": self.adjacency,
        }

    def summary(self) -> dict[str, Any]:
        """Final privacy statement of the run."""
        out = self.metrics()
        out.update(
            {
                "adjacency": self.adjacency,
                "target_epsilon": self.cfg.target_epsilon or None,
                "clip_norm": self.cfg.clip_norm,
                "noise_secure": bool(self.source.secure),
                "noise_generator": self.source.description
                if self.plan is None or self.plan.noise != "discrete_gaussian"
                else "each client: discrete Gaussian (Canonne, Kamath & Steinke 2020, Alg. 3) on "
                f"uniforms of its own source of the same kind ({self.source.description})",
                "ledger": str(self.ledger.path.name),
                "ledger_entries": len(self.ledger.entries()),
                "ledger_head": self.ledger.head(),
                STATE_KEY: self.signed_head(),
                "covers": "every released global model; not the client-reported metrics",
            }
        )
        if self.plan is not None:
            out.update(
                {
                    "noise_multiplier": self.plan.noise_multiplier,
                    "noise_calibrated_to_target": self.plan.calibrated,
                    "client_sample_rate": self.plan.sample_rate,
                    "client_sampling": self.plan.sampling,
                    "aggregate_denominator": self.plan.denominator,
                    "rounds_accounted": len(self._client_history) - self.discarded_sums,
                    # releases the server saw in attempts it discarded, composed like rounds
                    "discarded_sums_accounted": self.discarded_sums,
                }
            )
            if self.placement == "distributed":  # t of the noise shares, not Shamir's t
                out["noise_shares_required"] = self.min_survivors
            out.update(self._amplification())
        else:
            out["clients_epsilon"] = {
                party: self._epsilon_of(h) if h else 0.0
                for party, h in sorted(self._example_history.items())
            }
        return out

    def signed_head(self) -> dict[str, Any] | None:
        """The ledger's signed head as the server last wrote it (kept in checkpoints, summary)."""
        signed = self.ledger.signed_head()
        return None if signed is None else signed.to_dict()

    def _amplification(self) -> dict[str, Any]:
        """The stated figure's sampling and the amplified one beside it (summary keys)."""
        p = self.plan
        assert p is not None
        redrawn = sorted(self._redrawn_rounds)
        poisson = p.sampling == "poisson" and p.sample_rate < 1.0
        amplified = (
            self._epsilon_of(self._amplified_history)
            if poisson and self._amplified_history and not redrawn and p.noise == "gaussian"
            else None
        )
        return amplification_statement(p, amplified, redrawn)

    # ------------------------------------------------------------ resume
    def resume(self, completed_round: int, pending: list[LedgerRow]) -> None:
        """Rebuild the accountant from the ledger; append a checkpointed round's lost rows.

        Raises:
            PrivacyError: The ledger's chain is broken, or it records rounds after the last
                checkpoint (it does not belong to this run's checkpoints).
        """
        entries = resumable_entries(self.ledger, completed_round)
        recorded = {(e.kind, e.round, e.party) for e in entries}
        check_same_sampling(entries, self.plan)
        for entry in entries:
            self._absorb(entry)
        missing = [r for r in pending if (r["kind"], completed_round, r["party"]) not in recorded]
        if self.unit == "client" and self.plan is not None:  # check before writing anything
            accounted = (
                len(self._client_history)
                - self.discarded_sums
                + sum(r["kind"] == "client_level" for r in missing)
            )
            if accounted != completed_round:
                raise PrivacyError(
                    f"the ledger accounts {accounted} client-level rounds but the run completed "
                    f"{completed_round}; refusing to resume on a ledger that does not match "
                    "the checkpoints"
                )
        if self.cfg.dpsgd:  # every completed round released rows of its cohort
            rounds = {e.round for e in entries if e.kind == "example_level"}
            rounds |= {completed_round for r in missing if r["kind"] == "example_level"}
            lost = sorted(set(range(1, completed_round + 1)) - rounds)
            if lost:
                raise PrivacyError(
                    f"the ledger has no example-level rows of rounds {lost} although the run "
                    f"completed {completed_round}; refusing to resume on a ledger that does not "
                    "match the checkpoints"
                )
        if missing:
            log.warning(
                "round %d was checkpointed but %d ledger entries were not written before the "
                "crash; writing them now, before the model is released",
                completed_round,
                len(missing),
            )
            self.commit(completed_round, missing)
        self._account_inflight(completed_round)

    def note(self, round_: int, message: str) -> None:
        """Record a free-text event (for example a budget stop)."""
        self.ledger.append("note", round=round_, party="server", payload={"message": message})


def open_server_privacy(
    cfg: PrivacyConfig,
    ledger_path: Any,
    run_id: str,
    *,
    rounds: int,
    population: int,
    clients_per_round: int,
    sample_rate: float,
    source: NoiseSource | None = None,
    min_survivors: int = 1,
    signer: HeadSigner | None = None,
) -> ServerPrivacy | None:
    """The run's :class:`ServerPrivacy`, or ``None`` for a non-private run.

    ``signer``: the server's ledger key (:mod:`privacy.ledger.signed_head`), which signs the
    head after every commit and pins it on resume. The server always passes it
    (:func:`server.bootstrap.build_server`); without it the ledger is not signed.
    """
    if not cfg.enabled:
        return None
    plan = None
    if cfg.unit == "client":
        plan = client_level_plan(
            cfg,
            rounds=rounds,
            population=population,
            clients_per_round=clients_per_round,
            sample_rate=sample_rate,
        )
    ledger = Ledger.open(ledger_path, run_id, signer=signer)
    return ServerPrivacy(cfg, ledger, plan=plan, source=source, min_survivors=min_survivors)
