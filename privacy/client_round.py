"""A client's side of a run's differential privacy, round by round: :class:`ClientPrivacy`.

The client's trainer holds one :class:`ClientPrivacy` per private run and passes each round's
update through it before the update may leave (its server-side counterpart is
:class:`privacy.server_round.ServerPrivacy`); the site's own record of what left is its site
ledger (:mod:`privacy.ledger.site_ledger`), which the client keeps beside it.

* Client level (``privacy.unit = "client"``): every update of the shared parameters is clipped
  to ``C`` and, with ``local`` (or ``distributed``) placement, noised before it leaves the
  client (:mod:`privacy.dp.client_level`). Training metrics and the schedule, which depend on
  the data, are not sent, and the example count is hidden (the aggregate does not use it;
  :mod:`privacy.site_figures`).
* Example level (``privacy.unit = "example"``): local training is DP-SGD
  (:mod:`privacy.dp.dpsgd`). The client keeps its own accountant for the run, persisted in its
  state folder under a name derived from the run id (a restarted client resumes the run's
  spending; another run starts afresh, its site's total being the site ledger's), calibrates
  its noise to the target over the planned rounds, reports its cumulative (epsilon, delta)
  with each update, and once another round would pass its budget it sends
  the unchanged parameters (a data-independent, privacy-free update) instead of training.
* Identity level (``privacy.unit = "identity"``): the same, with identity-level DP-SGD
  (:mod:`privacy.dp.identity_dpsgd`): the records sampled, clipped and counted are the site's
  identities (``num_identities``), each with all its images.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fl_secure.config import Config
from fl_secure.errors import PrivacyError
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.runs import atomic_write_json, run_keyed_path
from fl_secure.training import FaceModel, LocalData, local_training
from privacy.dp.accountants.registry import create_accountant
from privacy.dp.calibration import calibrate_noise
from privacy.dp.client_level import clip_update
from privacy.dp.dpsgd import DPSGDSettings, dpsgd_steps, train_local_dpsgd
from privacy.dp.example_level import MAX_DP_STEPS_PER_ROUND, MIN_DP_SAMPLE_RATE
from privacy.dp.grid_noise import add_grid_discrete_gaussian
from privacy.dp.identity_dpsgd import train_local_identity_dpsgd
from privacy.dp.noise import NoiseSource, SecureGaussian

log = logging.getLogger(__name__)

#: (model, data, training) -> metrics: the local objective a strategy runs.
TrainFn = Callable[[FaceModel, LocalData, LocalTraining], dict[str, float]]


class ClientPrivacy:
    """What a client does for the run's DP before an update leaves it."""

    def __init__(
        self,
        config: Config,
        *,
        num_examples: int,
        num_identities: int = 0,
        state_dir: Path | None = None,
        source: NoiseSource | None = None,
        min_survivors: int = 1,
        run_id: str = "",
    ) -> None:
        self.cfg = config.privacy
        if not self.cfg.enabled:
            raise PrivacyError("ClientPrivacy is only for private runs")
        self.source: NoiseSource = source or SecureGaussian()
        self.min_survivors = min_survivors
        self.run_id = run_id
        self.state_path = accountant_state_path(state_dir, run_id) if state_dir else None
        self.accountant_name = self.cfg.accountant_name()
        self.accountant = create_accountant(self.accountant_name)
        self.noise_multiplier = self.cfg.noise_multiplier
        self.sample_rate = 0.0
        self.steps_per_round = 0
        self.num_examples = 0  # DP-SGD: this client's records (images, or identities)
        if self.cfg.dpsgd:
            self._plan_example_level(config, num_examples, num_identities)
            self._load()
        elif self.cfg.noise_placement != "central" and not self.noise_multiplier > 0:
            # 0 means "calibrate" in a config file; the server calibrates it and sends the
            # result (server.bootstrap._config_for_clients). Taken as it is, it is no noise at all.
            raise PrivacyError(
                "the run config came without a calibrated privacy.noise_multiplier (0): this "
                f"site would add no {self.cfg.noise_placement} noise to its client-level "
                "updates; refusing to train"
            )
        if not self.source.secure:
            log.warning("DP noise is NOT from a CSPRNG: %s", self.source.description)

    # ------------------------------------------------------------ example level
    def _plan_example_level(self, config: Config, images: int, identities: int) -> None:
        """Sample rate, steps and noise of DP-SGD over the unit's records (images or people).

        The default rate is ``min(1, batch_size / images)`` for either unit: ``batch_size``
        images a step in expectation (at the identity level each identity is sampled at that
        rate and brings all its images).
        """
        if images < 1:
            raise PrivacyError("a client without training images cannot run DP-SGD")
        n = images
        if self.cfg.unit == "identity":
            if identities < 1:
                raise PrivacyError(
                    "identity-level DP-SGD needs the number of identities of the site's "
                    "training images (num_identities >= 1)"
                )
            n = identities
        q = self.cfg.sample_rate or min(1.0, config.train.batch_size / images)
        if q < MIN_DP_SAMPLE_RATE:  # the server refuses such updates: say so before training
            raise PrivacyError(
                f"DP-SGD sample rate q = {q:.3g} (batch {config.train.batch_size} of {images} "
                f"images) is below the {MIN_DP_SAMPLE_RATE:g} the server accounts; set "
                "privacy.sample_rate or a larger train.batch_size"
            )
        self.sample_rate = q
        self.num_examples = n
        self.steps_per_round = dpsgd_steps(n, local_training(config.train), q)
        if self.steps_per_round > MAX_DP_STEPS_PER_ROUND:
            raise PrivacyError(
                f"{self.steps_per_round} DP-SGD steps a round at q = {q:.3g} is more than the "
                f"{MAX_DP_STEPS_PER_ROUND} the server accounts; set train.local_steps or fewer "
                "train.local_epochs"
            )
        if self.noise_multiplier == 0:
            self.noise_multiplier = calibrate_noise(
                target_epsilon=self.cfg.target_epsilon,
                sample_rate=q,
                steps=config.train.rounds * self.steps_per_round,
                delta=self.cfg.delta,
                accountant=self.accountant_name,
            )
        log.info(
            "%s-level DP-SGD over %d records: z = %.4f, C = %g, q = %.4f, %d steps a round, "
            "%s accountant",
            self.cfg.unit,
            n,
            self.noise_multiplier,
            self.cfg.clip_norm,
            q,
            self.steps_per_round,
            self.accountant_name,
        )
        what = "identities" if self.cfg.unit == "identity" else "training images"
        if self.cfg.delta >= 1.0 / n:  # only this site knows n: the server cannot check it
            log.warning(
                "privacy.delta = %g is not below 1/N for this site's N = %d %s: a mechanism "
                "that publishes one record in the clear meets such a delta",
                self.cfg.delta,
                n,
                what,
            )
        if not self.cfg.sample_rate:
            log.warning(
                "privacy.sample_rate is not set: q = batch_size / N = %.4g is derived from this "
                "site's image count and sent with each update, so N is treated as public; set "
                "privacy.sample_rate to keep it private",
                q,
            )

    def _load(self) -> None:
        if self.state_path is None:
            return
        if not self.state_path.exists():
            self._adopt_unkeyed_state()
            return
        try:
            state = json.loads(self.state_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise PrivacyError(
                f"cannot read the accountant state {self.state_path}: {exc}"
            ) from exc
        if not isinstance(state, dict):
            raise PrivacyError(f"the accountant state {self.state_path} is not a JSON object")
        saved_run = state.get("run_id", self.run_id)
        if saved_run != self.run_id:  # the file name is the run id's digest: a copied file
            raise PrivacyError(
                f"the accountant state {self.state_path} belongs to run {saved_run!r}, not "
                f"{self.run_id!r}; move it away (the site ledger keeps every run's releases)"
            )
        try:
            self.accountant.load_state_dict(state)
        except PrivacyError as exc:
            raise PrivacyError(
                f"the accountant state {self.state_path} does not fit this run: {exc} (the "
                f"run uses the {self.accountant_name!r} accountant)"
            ) from exc
        log.info(
            "restored the accountant of run %r: epsilon %.4f so far", self.run_id, self.epsilon()
        )

    def _adopt_unkeyed_state(self) -> None:
        """Take over a state written before accountants were kept per run, if it may be ours.

        Such a file (``privacy_accountant.json``) names no run: it may hold this run's
        spending (a client upgraded in the middle of the run), so it is adopted, which at
        worst counts another run's steps too (a client stops early, never late), and renamed
        ``privacy_accountant.json.adopted`` so that no later run adopts it again. One written
        by another accountant cannot be this run's (a run keeps its config): left alone.
        """
        assert self.state_path is not None
        legacy = self.state_path.with_name("privacy_accountant.json")
        if legacy == self.state_path or not legacy.exists():
            return
        try:
            state = json.loads(legacy.read_text(encoding="utf-8"))
            mechanism = state.get("mechanism") if isinstance(state, dict) else None
        except (OSError, ValueError) as exc:
            raise PrivacyError(f"cannot read the accountant state {legacy}: {exc}") from exc
        if mechanism != self.accountant_name:
            log.warning(
                "%s was written by the %r accountant, not this run's %r: not this run's; left "
                "as it is",
                legacy,
                mechanism,
                self.accountant_name,
            )
            return
        self.accountant.load_state_dict(state)
        log.warning(
            "%s names no run (written before accountants were kept per run): taken as this "
            "run's spending so far, epsilon %.4f (if it is another run's, this client stops "
            "early); kept from now on in %s",
            legacy,
            self.epsilon(),
            self.state_path.name,
        )
        self._save()
        legacy.replace(legacy.with_name(legacy.name + ".adopted"))

    def _save(self) -> None:
        if self.state_path is not None:
            state = self.accountant.state_dict()
            state["run_id"] = self.run_id
            atomic_write_json(self.state_path, state)

    def epsilon(self) -> float:
        """This client's DP-SGD (example- or identity-level) epsilon so far."""
        return self.accountant.get_epsilon(self.cfg.delta)

    def _epsilon_after_round(self, steps: int) -> float:
        trial = create_accountant(self.accountant_name)
        trial.load_state_dict(self.accountant.state_dict())
        trial.step(
            noise_multiplier=self.noise_multiplier,
            sample_rate=self.sample_rate,
            num_steps=steps,
        )
        return trial.get_epsilon(self.cfg.delta)

    def train_fn(self) -> TrainFn | None:
        """DP-SGD for example- and identity-level runs (``None``: the strategy's own training)."""
        if not self.cfg.dpsgd:
            return None
        settings = DPSGDSettings(
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.cfg.clip_norm,
            sample_rate=self.sample_rate,
            max_physical_batch_size=self.cfg.max_physical_batch_size,
            clipping=self.cfg.clipping,
        )

        def train(model: FaceModel, data: LocalData, training: LocalTraining) -> dict[str, float]:
            if self.cfg.unit == "identity":
                return train_local_identity_dpsgd(
                    model, data, training, settings, noise=self.source
                )
            return train_local_dpsgd(model, data, training, settings, noise=self.source)

        return train

    def may_train(self, training: LocalTraining | None = None) -> bool:
        """Example level: whether another round, of the task's steps, stays within the budget.

        The steps are those DP-SGD will take for ``training`` (the round's task: its
        ``local_steps`` or epochs), not the ones planned from the config at join, so a task
        asking for more steps is charged what it would spend.
        """
        target = self.cfg.target_epsilon
        if not self.cfg.dpsgd:
            return True
        steps = self.steps_per_round
        if training is not None:
            steps = dpsgd_steps(self.num_examples, training, self.sample_rate)
        if steps > MAX_DP_STEPS_PER_ROUND:  # the server would refuse the update it gives
            log.warning(
                "the task asks for %d DP-SGD steps, more than the %d the server accounts; "
                "sending the unchanged parameters instead of training",
                steps,
                MAX_DP_STEPS_PER_ROUND,
            )
            return False
        if target <= 0:  # no budget to hold
            return True
        after = self._epsilon_after_round(steps)
        if after > target * (1 + 1e-9):
            log.warning(
                "%s-level budget: another round would bring epsilon to %.4f > %g; "
                "sending the unchanged parameters instead of training",
                self.cfg.unit,
                after,
                target,
            )
            return False
        return True

    def planned_dpsgd(self, training: LocalTraining) -> tuple[float, float, int] | None:
        """DP-SGD units: the ``(z, q, steps)`` DP-SGD would run for ``training`` (else None)."""
        if not self.cfg.dpsgd:
            return None
        steps = dpsgd_steps(self.num_examples, training, self.sample_rate)
        return self.noise_multiplier, self.sample_rate, steps

    @staticmethod
    def released_dpsgd(metrics: dict[str, float]) -> tuple[float, float, int] | None:
        """The ``(z, q, steps)`` an example-level update went out with (else None).

        Read from the metrics :meth:`release` returned with it.
        """
        try:
            z = float(metrics["dp_noise_multiplier"])
            q = float(metrics["dp_sample_rate"])
            steps = int(metrics["dp_steps"])
        except (KeyError, TypeError, ValueError):
            return None
        return z, q, steps

    # ------------------------------------------------------------ release
    def release(
        self, update: Tensors, metrics: dict[str, float], trained: bool
    ) -> tuple[Tensors, dict[str, float]]:
        """The update and metrics that may leave this client (it goes out with weight 1)."""
        if self.cfg.unit == "client":
            clipped, _ = clip_update(update, self.cfg.clip_norm)
            noisy = clipped  # distributed: integer noise is added when encoding for SecAgg
            if self.cfg.noise_placement == "local" and self.cfg.noise_multiplier > 0:
                # on a grid, with integer noise: float noise would leak through its low-order
                # bits (Mironov 2012)
                noisy = add_grid_discrete_gaussian(
                    clipped, self.cfg.noise_multiplier, self.cfg.clip_norm, self.source
                )
            # Loss, accuracy, the update norm and the schedule (epochs x N / batch) depend on
            # the data: they stay here (privacy.site_figures).
            return noisy, {}
        steps = int(metrics.get("local_steps", self.steps_per_round)) if trained else 0
        if steps > 0:  # the accountant is saved before the update is released
            self.accountant.step(
                noise_multiplier=self.noise_multiplier,
                sample_rate=self.sample_rate,
                num_steps=steps,
            )
            self._save()
        # Loss and accuracy depend on the data and are not covered by DP: they stay here, and
        # so does the image count (LocalTrainer.num_examples); the steps go out as dp_steps,
        # data-independent with privacy.sample_rate set (privacy.site_figures).
        out: dict[str, Any] = {
            "dp_epsilon": self.epsilon(),
            "dp_steps": float(steps),
            "dp_noise_multiplier": self.noise_multiplier,
            "dp_sample_rate": self.sample_rate,
            "dp_noise_secure": 1.0 if self.source.secure else 0.0,
        }
        return update, out


def accountant_state_path(state_dir: Path, run_id: str) -> Path:
    """Where a client keeps its example-level accountant for the run ``run_id``.

    One file per run, named by a digest of the run id (which comes from the server, so it is
    never used as a path itself): a client restarted into the same run resumes its spending,
    while a new run in the same state folder starts its own accountant instead of inheriting
    the last run's history (each run's budget is its own; the site's total over runs is the
    site ledger's, :mod:`privacy.ledger.site_ledger`).
    """
    return run_keyed_path(state_dir, "privacy_accountant", ".json", run_id)
