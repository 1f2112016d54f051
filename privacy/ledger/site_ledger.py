"""A site's own record of the updates it released, and its epsilon against the server.

The server's ledger (:mod:`privacy.ledger.run_ledger`) states the run's guarantee as the
server computes it: with amplification by the cohort sampling the server itself performs, and
from a run config the server wrote. A site that does not want to take the server's word keeps this
ledger in its state folder (``fl-secure client --state-dir``): one row per update that left
the site, counted before the upload starts (an update that may have left is counted).

From it the site computes its client-level epsilon **against the server**, which knows who
it sampled: no amplification, each release a discrete Gaussian mechanism of sensitivity
``C`` (zero-out adjacency, as the server's accountant) and noise ``z C`` on the grid of the
update's integers (``local``: :mod:`privacy.dp.grid_noise`; ``distributed``: the distributed
discrete Gaussian), so ``1 / (2 z^2)``-zCDP, composed by adding ``rho`` and converted by
:func:`privacy.dp.zcdp.zcdp_epsilon` (a continuous Gaussian of ``z``, as an
older client released, has the same zCDP bound).

Two figures, by what the site trusts:

* ``epsilon`` (peers honest): the released sum carries the noise of at least the round's
  threshold of honest sites. ``local`` placement: ``z`` from this site alone already;
  ``distributed``: ``z`` once ``t`` shares are in (secure aggregation unmasks no fewer),
  by KLS21's zCDP bound (as the server accounts it).
* ``epsilon_colluding_peers``: the server and every other site collude and subtract their
  own noise; only this site's share protects it: ``z`` (local) or ``z / sqrt(t)``
  (distributed).

A release without client-level noise (a non-private run, example-level DP-SGD, central noise,
which the server adds after it has seen the sum) makes the client-level figures unbounded; so
does a release whose noise was seeded (``privacy.secure_rng = false``, joined with
``--accept-seeded-noise``): its seed is ``run.seed`` and the client id, which the server
knows, so it can regenerate the noise and subtract it (every figure of the row is unbounded).

A third figure, ``example_epsilon``, protects one training image of the site (add/remove one
image) instead of the whole site, over every release the ledger holds:

* an example-level DP-SGD release (``privacy.unit = "example"``) is ``T`` steps of the
  Poisson-subsampled Gaussian with the site's own ``q`` and ``z``: its sampling is drawn at
  the site, so the amplification holds against the server too; a release of the unchanged
  parameters (the run's own budget spent) costs nothing; an identity-level release
  (``"identity"``) counts the same (one image is part of one identity, sampled at ``q``
  with its gradient clipped to ``C``; the release alone also bounds one whole person);
* a client-level release is a Gaussian of multiplier ``z / 2`` (``own / 2`` if the peers
  collude): one image more or less moves the clipped update by up to ``2 C``;
* a release with neither makes it unbounded.

They compose in dp_accounting's PLD accountant (:func:`privacy.dp.gdp.example_epsilon`). A
site can hold a budget on it (``max_example_epsilon``): an example-level run is then joined,
and a round declined before it trains when its planned steps would pass the budget.

The same file (:mod:`privacy.ledger.site_file`; its rows :mod:`privacy.ledger.site_release`)
also lets a restarted client keep refusing tasks it already answered
(:meth:`SiteLedger.refusal`): a replayed task, an older round, a round past ``train.rounds``,
more attempts of a round than ``server.max_retries`` allows, and evaluation tasks other than
the run's two (round 0 and the final one). It records the SHA-256 of each run's config (its
noise multiplier aside: :func:`pinned_digest`), so a server that sends another config for a
run id the site knows is refused, also after a restart. The limits are per run id: a server
can always start a new run, and only the site's budget (``max_epsilon``) bounds what the
site releases over all of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fl_secure.config import Config, config_to_toml
from fl_secure.errors import PrivacyError
from privacy.dp.gdp import example_epsilon
from privacy.dp.zcdp import composed_rho, zcdp_epsilon
from privacy.ledger.site_file import SiteRecords, read_site_records, write_site_records
from privacy.ledger.site_release import Release, release_for

log = logging.getLogger(__name__)

FILE_NAME = "site_ledger.json"


def pinned_digest(config: Config) -> str:
    """SHA-256 of a run config as a site pins it: all of it but the noise multiplier."""
    doc = tomllib.loads(config_to_toml(config))
    doc.get("privacy", {}).pop("noise_multiplier", None)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode("utf-8")).hexdigest()


class SiteLedger:
    """The site's releases: kept in ``state_dir/site_ledger.json`` (in memory without one).

    Args:
        state_dir: The client's state folder, or None (nothing survives a restart).
        max_epsilon: The site's own budget: a release that would bring :meth:`epsilon` above
            it is refused (None: no budget, the figures are only kept and logged).
        delta: The delta of the site's figures (the site's choice, not the server's).
        colluding_peers: Hold the budget against ``epsilon_colluding_peers`` instead.
        max_example_epsilon: The site's budget for one training image
            (:func:`example_epsilon`, at ``delta``; None: no such budget). Unlike
            ``max_epsilon`` it admits example-level runs.
        exclusive: Hold an exclusive lock on the folder while this object lives (a client
            process): a second client on the same folder would overwrite this one's rows.

    Raises:
        PrivacyError: the file is damaged (it is left as it is), a budget is asked for
            without a state folder to keep it in, or (``exclusive``) another process holds
            the folder.
    """

    def __init__(
        self,
        state_dir: Path | None,
        *,
        max_epsilon: float | None = None,
        delta: float = 1e-5,
        colluding_peers: bool = False,
        max_example_epsilon: float | None = None,
        exclusive: bool = False,
    ) -> None:
        for name, budget in (("epsilon", max_epsilon), ("example-level", max_example_epsilon)):
            if budget is not None and not (budget > 0 and math.isfinite(budget)):
                raise PrivacyError(f"the site's {name} budget must be a number > 0, not {budget}")
        if not 0 < delta < 1:
            raise PrivacyError(f"the site's delta must be in (0, 1), not {delta}")
        if (max_epsilon is not None or max_example_epsilon is not None) and state_dir is None:
            raise PrivacyError(
                "a site epsilon budget needs a state folder (--state-dir) to keep its ledger "
                "in: without one a restarted client would start the budget afresh"
            )
        self.path = state_dir / FILE_NAME if state_dir is not None else None
        self.max_epsilon = max_epsilon
        self.max_example_epsilon = max_example_epsilon
        self.delta = delta
        self.colluding_peers = colluding_peers
        self.releases: list[Release] = []
        #: Secure-aggregation round ids (hex) this site has taken part in: never twice.
        self.secure_rounds: list[str] = []
        #: Each run id's config SHA-256, from the first join: a later join must match it.
        self.run_configs: dict[str, str] = {}
        #: Evaluation tasks answered: (run id, round, nonce hex).
        self.evaluations: list[tuple[str, int, str]] = []
        self._lock: Any = None
        if exclusive and state_dir is not None:
            self._hold(state_dir)
        self._load()

    def _hold(self, state_dir: Path) -> None:
        import fcntl  # POSIX only: imported where a client locks its folder, as in fl_secure.runs

        state_dir.mkdir(parents=True, exist_ok=True)
        handle = open(state_dir / ".site_ledger.lock", "a+", encoding="utf-8")  # noqa: SIM115
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise PrivacyError(
                f"the state folder {state_dir} is in use by another client process (pid "
                f"{holder}): two clients on one folder would overwrite each other's site "
                "ledger; give each its own --state-dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._lock = handle  # released when this process ends, however it ends

    # ------------------------------------------------------------ persistence
    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        found = read_site_records(self.path)
        self.releases = found.releases
        self.secure_rounds = found.secure_rounds
        self.run_configs = found.run_configs
        self.evaluations = found.evaluations

    def _save(self) -> None:
        if self.path is None:
            return
        records = SiteRecords(self.releases, self.secure_rounds, self.run_configs, self.evaluations)
        write_site_records(self.path, records)

    # ------------------------------------------------------------ figures
    @staticmethod
    def _epsilon(releases: Iterable[Release], delta: float, *, own: bool) -> float:
        rows = list(releases)
        if not rows:
            return 0.0
        rho = composed_rho(r.own_noise_multiplier if own else r.noise_multiplier for r in rows)
        return zcdp_epsilon(rho, delta)

    def epsilon(
        self, *, colluding_peers: bool | None = None, extra: Release | None = None
    ) -> float:
        """The site's client-level epsilon at :attr:`delta` over every release (+ ``extra``)."""
        own = self.colluding_peers if colluding_peers is None else colluding_peers
        rows = [*self.releases, *([extra] if extra else [])]
        return self._epsilon(rows, self.delta, own=own)

    def example_epsilon(
        self, *, colluding_peers: bool | None = None, extra: Release | None = None
    ) -> float:
        """One training image's epsilon at :attr:`delta` over every release (+ ``extra``)."""
        own = self.colluding_peers if colluding_peers is None else colluding_peers
        rows = [*self.releases, *([extra] if extra else [])]
        return example_epsilon(rows, self.delta, own=own, discrete=True)

    def summary(self) -> dict[str, Any]:
        """What the site can show: releases by run and unit, and its epsilon figures."""
        runs: dict[str, int] = {}
        units: dict[str, int] = {}
        for r in self.releases:
            runs[r.run_id] = runs.get(r.run_id, 0) + 1
            units[r.unit] = units.get(r.unit, 0) + 1
        unbounded = sum(1 for r in self.releases if r.noise_multiplier == 0)
        return {
            "releases": len(self.releases),
            "releases_by_run": runs,
            "releases_by_unit": units,
            "releases_without_client_level_noise": unbounded,
            "delta": self.delta,
            "epsilon": self.epsilon(colluding_peers=False),
            "epsilon_colluding_peers": self.epsilon(colluding_peers=True),
            "example_epsilon": self.example_epsilon(colluding_peers=False),
            "example_epsilon_colluding_peers": self.example_epsilon(colluding_peers=True),
            "dpsgd_steps": sum(max(r.dpsgd_steps, 0) for r in self.releases),
            "max_epsilon": self.max_epsilon,
            "max_example_epsilon": self.max_example_epsilon,
            "budget_against": "colluding_peers" if self.colluding_peers else "peers_honest",
            "adjacency": "zero-out (one site's whole update)",
            "accounting": "zCDP of the discrete Gaussian releases, no sampling amplification",
            "example_adjacency": "add/remove one training image of the site",
            "example_accounting": "the site's own DP-SGD sampling (PLD, or RDP beside "
            "client-level releases), client-level releases as discrete Gaussians of "
            "sensitivity 2 C (zCDP)",
        }

    # ------------------------------------------------------------ policy
    def check_run(self, config: Config, run_id: str | None = None) -> None:
        """Refuse a run this site knows under another config, or one that cannot keep its budget.

        The first join of ``run_id`` records the SHA-256 of its config; a later join of the
        same run id, also after a restart, must send the same config, except for the
        calibrated noise multiplier: a resumed run recalibrates it when the enrolled
        population changed, and each release records the multiplier it carried, so the
        site's figures and budget follow it. (``run_id`` None: only the budget is checked.)

        Raises:
            PrivacyError: the run id is known with another config; or ``max_epsilon`` is
                set and the run's releases would carry no client-level noise against the
                server (no DP, central noise, example level); or ``max_example_epsilon`` is
                set and they would carry no noise at all against it (no DP, central noise);
                or a client-level run came without its calibrated noise multiplier, or one
                release would already pass a budget.
        """
        digest = ""
        if run_id is not None:
            digest = pinned_digest(config)
            known = self.run_configs.get(run_id)
            if known is not None and known != digest:
                raise PrivacyError(
                    f"this site joined run {run_id!r} before under another run config (SHA-256 "
                    f"{known[:12]}..., now {digest[:12]}..., noise multiplier aside): a server "
                    "may not change a run's limits or protection under a site; refusing to join"
                )
        self._check_budget(config)
        if run_id is not None and self.run_configs.get(run_id) is None:
            self.run_configs[run_id] = digest
            self._save_or_raise(lambda: self.run_configs.pop(run_id))

    def _check_budget(self, config: Config) -> None:
        p = config.privacy
        if self.max_example_epsilon is not None:
            if p.unit == "none" or (p.unit == "client" and p.noise_placement == "central"):
                raise PrivacyError(
                    f"this site holds an example-level epsilon budget "
                    f"({self.max_example_epsilon:g}), and the run's updates would leave without "
                    f"noise against the server (privacy.unit {p.unit!r}"
                    + (", central noise" if p.unit == "client" else "")
                    + "); refusing to join"
                )
        if self.max_epsilon is None:
            if p.unit == "client":
                self._check_first_release(config)
            return
        if p.unit != "client":
            raise PrivacyError(
                f"this site holds a client-level epsilon budget ({self.max_epsilon:g}), and the "
                f"run's privacy.unit is {p.unit!r}: its updates would leave without client-level "
                "noise; refusing to join"
            )
        if p.noise_placement == "central":
            raise PrivacyError(
                "this site holds an epsilon budget against the server, and the run's noise is "
                "central: the server adds it after it has seen the sum; refusing to join"
            )
        self._check_first_release(config)

    def _check_first_release(self, config: Config) -> None:
        """A client-level run: one release of it must keep the site's budgets."""
        p = config.privacy
        if self.max_epsilon is None and self.max_example_epsilon is None:
            return
        if not p.noise_multiplier > 0:
            raise PrivacyError(
                "the run config came without a calibrated privacy.noise_multiplier; refusing "
                "to join"
            )
        if not p.secure_rng:
            raise PrivacyError(
                "the run's DP noise is seeded (privacy.secure_rng = false) from run.seed and "
                "the client id, which the server knows: it could subtract the noise, so this "
                "site's epsilon against the server would be unbounded; refusing to join"
            )
        first = self._over_budget(release_for(config, "", 0, b""))
        if first:
            raise PrivacyError(
                f"one more update of this run would bring {first}: the run's noise multiplier "
                f"z = {p.noise_multiplier:g} is too small (or the budget is spent); refusing to "
                "join"
            )

    def refusal(
        self,
        config: Config | None,
        run_id: str,
        round_: int,
        nonce: bytes,
        *,
        last_round: int,
        dpsgd: tuple[float, float, int] | None = None,
    ) -> str:
        """Why the site will not release an update for this task ("" if it will).

        ``dpsgd``: an example-level run, the ``(z, q, steps)`` the task would train with;
        the example-level budget is held against it before any training.
        """
        if self._counted(run_id, round_, nonce):
            return "this client already sent its update for this task (a replayed task)"
        mine = [r for r in self.releases if r.run_id == run_id]
        last = max([last_round, *(r.round for r in mine)])
        if round_ < last:
            return f"round {round_} is older than round {last}, already done"
        if config is None:
            return ""
        if not 1 <= round_ <= config.train.rounds:
            return f"round {round_} is not a training round of this run (1..{config.train.rounds})"
        attempts = 1 + config.server.max_retries
        if sum(1 for r in mine if r.round == round_) >= attempts:
            return (
                f"this client already sent {attempts} updates for round {round_}, as many "
                f"as server.max_retries = {config.server.max_retries} allows"
            )
        after = self._over_budget(release_for(config, run_id, round_, nonce, dpsgd))
        return f"another update would bring {after}" if after else ""

    def _over_budget(self, row: Release) -> str:
        """Which budget ``row`` would pass, and to what ("" if it keeps both)."""
        if self.max_epsilon is not None:
            after = self.epsilon(extra=row)
            if after > self.max_epsilon * (1 + 1e-12):
                return (
                    f"this site's epsilon against the server to {after:.4g} (delta "
                    f"{self.delta:g}), above its budget of {self.max_epsilon:g}"
                )
        if self.max_example_epsilon is not None:
            after = self.example_epsilon(extra=row)
            if after > self.max_example_epsilon * (1 + 1e-12):
                return (
                    f"this site's example-level epsilon (one training image) to {after:.4g} "
                    f"(delta {self.delta:g}), above its budget of {self.max_example_epsilon:g}"
                )
        return ""

    def _counted(self, run_id: str, round_: int, nonce: bytes) -> bool:
        """Whether this task's update is in the ledger already."""
        key = nonce.hex()
        return any(
            r.run_id == run_id and r.round == round_ and r.nonce == key for r in self.releases
        )

    def record(
        self,
        config: Config,
        run_id: str,
        round_: int,
        nonce: bytes,
        dpsgd: tuple[float, float, int] | None = None,
    ) -> Release | None:
        """Count a release (saved before the caller uploads); None if it was counted already.

        ``dpsgd``: example level, the ``(z, q, steps)`` the update was trained with.
        """
        if self._counted(run_id, round_, nonce):
            return None
        row = release_for(config, run_id, round_, nonce, dpsgd)
        self.releases.append(row)
        self._save_or_raise(self.releases.pop)
        return row

    def _save_or_raise(self, undo: Any) -> None:
        """Save; on failure undo the in-memory change and raise PrivacyError."""
        try:
            self._save()
        except OSError as exc:
            undo()
            raise PrivacyError(f"cannot write the site ledger {self.path}: {exc}") from exc

    def evaluation_refusal(
        self, config: Config | None, run_id: str, round_: int, nonce: bytes
    ) -> str:
        """Why the site will not answer this evaluation task ("" if it will).

        A run evaluates twice: the initial model (round 0) and the final one (round
        ``train.rounds + 1``), each in at most ``1 + server.max_retries`` attempts. Its
        figures (loss, accuracy on the site's test images) are not covered by DP: a server
        that asked for more would be querying the site's data at will.
        """
        if config is None:
            return ""
        final = config.train.rounds + 1
        if round_ not in (0, final):
            return f"round {round_} is not an evaluation round of this run (0 or {final})"
        if any(e[0] == run_id and e[1] == round_ and e[2] == nonce.hex()
               for e in self.evaluations):  # fmt: skip
            return "this client already answered this evaluation task (a replayed task)"
        attempts = 1 + config.server.max_retries
        if sum(1 for e in self.evaluations if e[0] == run_id and e[1] == round_) >= attempts:
            return (
                f"this client already answered {attempts} evaluation tasks for round {round_}, "
                f"as many as server.max_retries = {config.server.max_retries} allows"
            )
        return ""

    def record_evaluation(self, run_id: str, round_: int, nonce: bytes) -> None:
        """Count an evaluation answer (saved before it is sent)."""
        self.evaluations.append((run_id, round_, nonce.hex()))
        self._save_or_raise(self.evaluations.pop)

    def first_use(self, round_id: bytes) -> bool:
        """Record that this site takes part in secure round ``round_id``; False if it did before.

        A secure round's id is random for every attempt (``make_setup``), and the site's
        signed key advertisement names it: a round id seen again is a replay, in which
        adverts signed for the earlier round could be passed off as this one's.
        """
        key = round_id.hex()
        if key in self.secure_rounds:
            return False
        self.secure_rounds.append(key)
        self._save_or_raise(self.secure_rounds.pop)
        return True


__all__ = ["FILE_NAME", "SiteLedger", "pinned_digest"]
