"""The accountant interface: a ledger of DP-SGD events and the epsilon they spend.

Mirrors Opacus' ``IAccountant`` (``opacus/accountants/accountant.py``): state is only the
history of ``(noise_multiplier, sample_rate, num_steps)`` events, the maths lives in the
implementations (one file each) and in the reference libraries they wrap.

Adjacency (neighbouring relation). Poisson-subsampled events are analysed under
**add/remove-one** adjacency: two data sets are neighbours when one is the other plus a
single record (a single *client* for client-level DP, a single *example* for example-level
DP). Fixed-size cohorts drawn without replacement are only analysed by dp_accounting under
**replace-one** adjacency (the data-set size is public and one record is swapped for
another); see :mod:`privacy.dp.accountants.pld`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, get_args

from fl_secure.errors import PrivacyError
from privacy.dp.zcdp import release_rho, zcdp_epsilon

Sampling = Literal["poisson", "fixed_size"]
SAMPLINGS: tuple[str, ...] = get_args(Sampling)

Noise = Literal["gaussian", "discrete_gaussian"]
NOISES: tuple[str, ...] = get_args(Noise)
"""``gaussian``: continuous noise, analysed by each accountant's own (exact) Gaussian analysis;
``discrete_gaussian``: integer noise, accounted by its zCDP bound (:mod:`privacy.dp.zcdp`)."""

MIN_ACCOUNTED_NOISE = 0.05
"""Smallest noise multiplier accounted: below it epsilon is meaningless and PLD/PRV need GBs."""

ADD_REMOVE = "add/remove"
REPLACE_ONE = "replace-one"
ZERO_OUT = "zero-out"
ADJACENCY: dict[str, str] = {"poisson": ADD_REMOVE, "fixed_size": REPLACE_ONE}
"""Adjacency each sampling scheme is analysed under."""


def client_adjacency(sampling: str, placement: str) -> str:
    """Adjacency a client-level guarantee holds under, for a sampling scheme and noise placement.

    With ``local`` or ``distributed`` noise each participant sends its own noise share, so
    removing a client removes its share too: the neighbouring outputs are Gaussians of
    different variances, which the Gaussian accountant does not bound (one round at z = 2,
    five clients, local shares: epsilon 2.94, not 1.99). The accounting is exact under
    **zero-out** adjacency instead (Kairouz et al., "Practical and Private (Deep) Learning
    without Sampling or Shuffling", ICML 2021): the neighbour keeps the
    client, whose update is replaced by zero while its noise share is still sent. Fixed-size
    cohorts (replace-one) keep the cohort's size, and so the noise, in both neighbours.
    """
    if sampling == "poisson" and placement in ("local", "distributed"):
        return ZERO_OUT
    return ADJACENCY[sampling]


@dataclass(frozen=True)
class PrivacyEvent:
    """``num_steps`` identical releases of a subsampled Gaussian mechanism.

    Attributes:
        noise_multiplier: Noise standard deviation divided by the clipping norm.
        sample_rate: Poisson inclusion probability, or cohort / population for fixed size.
        num_steps: How many times the release is repeated.
        sampling: ``"poisson"`` or ``"fixed_size"`` (uniform without replacement).
        population: Number of records sampled from (required for ``"fixed_size"``).
        noise: ``"gaussian"`` or ``"discrete_gaussian"`` (integer noise: its zCDP bound is
            accounted, by whichever accountant, without amplification by sampling).
    """

    noise_multiplier: float
    sample_rate: float
    num_steps: int = 1
    sampling: Sampling = "poisson"
    population: int | None = None
    noise: Noise = "gaussian"

    def __post_init__(self) -> None:
        """Reject values no accountant can analyse."""
        z, q, t = self.noise_multiplier, self.sample_rate, self.num_steps
        if not (math.isfinite(z) and z > 0):
            raise PrivacyError(f"noise_multiplier must be a finite number > 0, got {z!r}")
        if z < MIN_ACCOUNTED_NOISE:
            raise PrivacyError(
                f"noise_multiplier = {z!r} is below {MIN_ACCOUNTED_NOISE}: one release alone "
                "then spends an epsilon above 100 (no meaningful privacy), and the PLD and PRV "
                "accountants' grids grow as 1/z (measured 2 GB at z = 0.05, over 7 GB at 0.01); "
                "use a larger noise multiplier"
            )
        if not (math.isfinite(q) and 0 < q <= 1):
            raise PrivacyError(f"sample_rate must be in (0, 1], got {q!r}")
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise PrivacyError(f"num_steps must be an integer >= 1, got {t!r}")
        if self.sampling not in SAMPLINGS:
            raise PrivacyError(f"sampling must be one of {SAMPLINGS}, got {self.sampling!r}")
        if self.noise not in NOISES:
            raise PrivacyError(f"noise must be one of {NOISES}, got {self.noise!r}")
        if self.sampling == "fixed_size":
            n = self.population
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise PrivacyError(
                    f"fixed_size sampling needs population (an integer >= 1), got {n!r}"
                )
            if abs(q * n - round(q * n)) > 1e-6 * max(1.0, q * n):
                raise PrivacyError(
                    f"fixed_size sampling needs sample_rate * population to be a whole "
                    f"cohort size, got {q!r} * {n} = {q * n!r}"
                )
        elif self.population is not None:
            raise PrivacyError("population is only meaningful with sampling='fixed_size'")

    @property
    def cohort_size(self) -> int:
        """Records per fixed-size cohort (``sample_rate * population``)."""
        if self.population is None:
            raise PrivacyError("cohort_size is only defined for sampling='fixed_size'")
        return round(self.sample_rate * self.population)

    def same_release(self, other: PrivacyEvent) -> bool:
        """Whether ``other`` repeats this release (so the two can be merged)."""
        return (
            self.noise_multiplier == other.noise_multiplier
            and self.sample_rate == other.sample_rate
            and self.sampling == other.sampling
            and self.population == other.population
            and self.noise == other.noise
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrivacyEvent:
        """Inverse of :meth:`to_dict`; validates every field."""
        keys = {"noise_multiplier", "sample_rate", "num_steps", "sampling", "population", "noise"}
        unknown = set(data) - keys
        if unknown:
            raise PrivacyError(f"unknown keys in privacy event: {sorted(unknown)}")
        try:
            return cls(
                noise_multiplier=float(data["noise_multiplier"]),
                sample_rate=float(data["sample_rate"]),
                num_steps=data.get("num_steps", 1),
                sampling=data.get("sampling", "poisson"),
                population=data.get("population"),
                noise=data.get("noise", "gaussian"),
            )
        except KeyError as exc:
            raise PrivacyError(f"privacy event is missing key {exc.args[0]!r}") from exc


def check_delta(delta: float) -> None:
    """Raise :class:`PrivacyError` unless ``0 < delta < 1``."""
    if not (math.isfinite(delta) and 0 < delta < 1):
        raise PrivacyError(f"delta must be in (0, 1), got {delta!r}")


class Accountant(ABC):
    """Ledger of subsampled-Gaussian releases and the (epsilon, delta) they spend.

    Attributes:
        name: Short registry name (``"rdp"``, ``"prv"``, ``"pld"``).
        adjacency: Neighbouring relation of Poisson events (``"add/remove"``).
        samplings: Sampling schemes this accountant can analyse.
        history: The events so far; consecutive identical releases are merged.
    """

    name: ClassVar[str]
    adjacency: ClassVar[str] = ADD_REMOVE
    samplings: ClassVar[frozenset[str]] = frozenset({"poisson"})

    def __init__(self) -> None:
        self.history: list[PrivacyEvent] = []

    def step(
        self,
        *,
        noise_multiplier: float,
        sample_rate: float,
        num_steps: int = 1,
        sampling: Sampling = "poisson",
        population: int | None = None,
        noise: Noise = "gaussian",
    ) -> None:
        """Record ``num_steps`` releases of a subsampled Gaussian mechanism.

        Raises:
            PrivacyError: A value is out of range, or this accountant cannot analyse
                ``sampling`` (the message names the one that can).
        """
        event = PrivacyEvent(
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            num_steps=num_steps,
            sampling=sampling,
            population=population,
            noise=noise,
        )
        self._check_supported(event)
        last = self.history[-1] if self.history else None
        if last is not None and last.same_release(event):
            self.history[-1] = PrivacyEvent(
                noise_multiplier=last.noise_multiplier,
                sample_rate=last.sample_rate,
                num_steps=last.num_steps + event.num_steps,
                sampling=last.sampling,
                population=last.population,
                noise=last.noise,
            )
        else:
            self.history.append(event)

    def _check_supported(self, event: PrivacyEvent) -> None:
        if self.history and self.history[0].noise != event.noise:
            raise PrivacyError(
                f"cannot compose a {event.noise!r} release with {self.history[0].noise!r} "
                "ones in one accountant: integer noise is accounted by its zCDP bound, "
                "continuous noise by the accountant's Gaussian analysis; keep one per ledger"
            )
        if event.noise == "discrete_gaussian":
            return  # zCDP, without amplification: any sampling scheme (zcdp module docstring)
        if event.sampling not in self.samplings:
            raise PrivacyError(
                f"the {self.name!r} accountant cannot analyse sampling={event.sampling!r} "
                f"(Opacus only analyses Poisson subsampling); use the 'pld' accountant, "
                f"which analyses fixed-size cohorts under replace-one adjacency"
            )

    @property
    def ledger_adjacency(self) -> str:
        """Adjacency the current history is analysed under."""
        if self.history:
            return ADJACENCY[self.history[0].sampling]
        return self.adjacency

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta`` (0.0 for an empty history).

        Raises:
            PrivacyError: ``delta`` is not in (0, 1).
        """
        check_delta(delta)
        if not self.history:
            return 0.0
        if self.history[0].noise == "discrete_gaussian":
            return zcdp_epsilon(self.discrete_rho(), delta)
        return float(self._epsilon(delta))

    def discrete_rho(self) -> float:
        """``rho`` (zCDP) of a history of discrete Gaussian releases (:mod:`privacy.dp.zcdp`)."""
        return sum(
            e.num_steps * release_rho(e.noise_multiplier, replace_one=e.sampling == "fixed_size")
            for e in self.history
        )

    @abstractmethod
    def _epsilon(self, delta: float) -> float:
        """Epsilon of the (non-empty, validated) history at a valid ``delta``."""

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable state: the accountant name and the event history."""
        return {"mechanism": self.name, "history": [e.to_dict() for e in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the history with the one in ``state_dict`` (validated).

        Raises:
            PrivacyError: The state belongs to another accountant or is malformed.
        """
        mechanism = state_dict.get("mechanism", self.name)
        if mechanism != self.name:
            raise PrivacyError(
                f"state was written by the {mechanism!r} accountant, not {self.name!r}"
            )
        history = state_dict.get("history")
        if not isinstance(history, list):
            raise PrivacyError("state_dict['history'] must be a list of event dicts")
        events = [PrivacyEvent.from_dict(e) for e in history]
        previous, self.history = self.history, []
        try:
            for e in events:
                self.step(
                    noise_multiplier=e.noise_multiplier,
                    sample_rate=e.sample_rate,
                    num_steps=e.num_steps,
                    sampling=e.sampling,
                    population=e.population,
                    noise=e.noise,
                )
        except PrivacyError:
            self.history = previous
            raise

    @classmethod
    def mechanism(cls) -> str:
        """Registry name of this accountant."""
        return cls.name

    def __len__(self) -> int:
        return len(self.history)
