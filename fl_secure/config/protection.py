"""The ``[privacy]`` and ``[secure_aggregation]`` sections: differential privacy, masked sums."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fl_secure.config.values import (
    DPSGD_UNITS,
    MAX_TIMEOUT,
    MIN_NOISE_MULTIPLIER,
    TIMEOUT_RANGE,
    AccountantName,
    ClippingEngine,
    NoisePlacement,
    PrivacyUnit,
    SecAggScheme,
    check,
)
from fl_secure.errors import ConfigError


@dataclass(frozen=True)
class PrivacyConfig:
    """Differential privacy of the run: who is protected, how much noise, which budget.

    ``unit = "client"``: DP-FedAvg on the shared parameters' updates (a whole client's data
    is the protected record; AdaFedFR Algorithm 1 lines 23-26). ``unit = "example"``:
    DP-SGD with Opacus inside each client (one face image is the protected record).
    ``unit = "identity"``: DP-SGD inside each client over identities (one person, all their
    images at the site, is the protected record; :mod:`privacy.dp.identity_dpsgd`).

    ``clipping`` (example unit) chooses how the per-example clipped gradient sum is computed:
    ``book-keeping`` (:mod:`privacy.dp.bookkeeping`: ghost norms and one clipped weight gradient
    per layer, no per-example gradients stored) or ``opacus`` (Opacus' hooks materialise
    every per-example gradient). Both give the same update up to float rounding; ``auto``
    takes book-keeping when every trainable layer is supported, else Opacus.
    """

    unit: PrivacyUnit = "none"  # none, client (DP-FedAvg), example or identity (DP-SGD)
    noise_placement: NoisePlacement = "local"  # client unit: local, distributed or central
    clip_norm: float = 1.0  # C: update (client), per-example or per-identity gradient L2 bound
    noise_multiplier: float = 0.0  # z (noise std = z * C); 0 = calibrate to target_epsilon
    target_epsilon: float = 0.0  # budget: training stops before passing it (0 = no budget)
    delta: float = 1e-5
    accountant: AccountantName = ""  # "" = pld for client level, prv for example/identity
    # example/identity unit: Poisson rate per step of each image / identity (0 = batch_size /
    # the site's images: batch_size images a step in expectation, for either unit)
    sample_rate: float = 0.0
    max_physical_batch_size: int = 64  # example/identity unit: images per forward pass
    clipping: ClippingEngine = "auto"  # example unit: per-example clipping engine (see below)
    secure_rng: bool = True  # DP noise from a CSPRNG; false only for reproducible tests

    def __post_init__(self) -> None:
        """Check ranges and combinations."""
        check(self.clip_norm > 0, "privacy.clip_norm", "a number > 0")
        check(
            self.noise_multiplier == 0 or MIN_NOISE_MULTIPLIER <= self.noise_multiplier < math.inf,
            "privacy.noise_multiplier",
            f"0 (calibrate to target_epsilon) or a finite number >= {MIN_NOISE_MULTIPLIER} (below "
            "it one round alone spends an epsilon above 100)",
        )
        check(self.target_epsilon >= 0, "privacy.target_epsilon", "a number >= 0")
        check(0 < self.delta < 1, "privacy.delta", "a number in (0, 1)")
        check(0 <= self.sample_rate <= 1, "privacy.sample_rate", "a number in [0, 1]")
        check(
            self.max_physical_batch_size >= 1,
            "privacy.max_physical_batch_size",
            "an integer >= 1",
        )
        if self.unit in DPSGD_UNITS and self.noise_placement != "local":
            raise ConfigError(
                f"privacy.noise_placement = {self.noise_placement!r} with privacy.unit = "
                f"{self.unit!r}: DP-SGD adds its noise on each client, in every step; the "
                "placements 'distributed' and 'central' are for client-level DP"
            )
        if self.unit != "none" and self.noise_multiplier == 0 and self.target_epsilon == 0:
            raise ConfigError(
                f"privacy.unit = {self.unit!r} needs privacy.noise_multiplier > 0 or "
                "privacy.target_epsilon > 0 (the noise is then calibrated to the budget)"
            )

    @property
    def enabled(self) -> bool:
        """Whether the run is differentially private."""
        return self.unit != "none"

    @property
    def dpsgd(self) -> bool:
        """Whether each client runs DP-SGD (example or identity unit, local noise)."""
        return self.unit in DPSGD_UNITS

    def accountant_name(self) -> str:
        """The accountant used: configured, or PLD (client level) / PRV (DP-SGD units)."""
        if self.accountant:
            return self.accountant
        return "prv" if self.dpsgd else "pld"


@dataclass(frozen=True)
class SecureAggregationConfig:
    """Secure aggregation: the server learns only the sum of the cohort's updates.

    ``secagg`` is Bonawitz et al. (CCS 2017), every client masks against every other;
    ``secagg+`` is Bell et al. (CCS 2020), each client has ``neighbours`` neighbours in a
    random k-regular graph. ``corrupt_fraction``, ``dropout_fraction``, ``security_bits``
    and ``correctness_bits`` state what the run assumes; SecAgg+'s ``neighbours`` and
    ``threshold`` (0: derived) must meet Bell et al.'s bounds for each cohort size, and
    SecAgg's threshold must exceed the corrupt clients (:mod:`privacy.secagg.parameters`).
    Updates are clipped per coordinate to ``clip_range``, encoded with
    ``scale_bits`` fractional bits and summed mod ``2^modulus_bits`` (a configuration whose sum
    could wrap is refused when the round starts). ``ckks`` encrypts each update with CKKS
    (TenSEAL) under a secret key all clients share (``CERTS/ckks/clients.secret``); the server
    adds ciphertexts and one or two clients decrypt the sum (:mod:`privacy.ckks`), each from the
    clients' signed uploads it checked itself, flooding its output with noise
    (``ckks_flooding_bits``).
    """

    scheme: SecAggScheme = "none"
    neighbours: int = 0  # secagg+: k neighbours per client (0: derived); secagg: all others
    threshold: int = 0  # t of k shares rebuild a secret (0: derived; secagg: a majority)
    corrupt_fraction: float = 0.2  # at most this fraction of a cohort colludes
    dropout_fraction: float = 0.1  # at most this fraction of a cohort drops out
    security_bits: int = 40  # a client's secrets leak with probability <= 2^-security_bits
    correctness_bits: int = 20  # a round aborts for too few neighbours w.p. <= 2^-this
    modulus_bits: int = 32  # arithmetic mod 2^modulus_bits (up to 64; 62 with distributed DP)
    clip_range: float = 1.0  # per-coordinate bound of the fixed-point encoding
    scale_bits: int = 20  # fractional bits: resolution 2^-scale_bits
    stage_timeout: float = 120.0  # seconds for key advertisement, key sharing and unmasking
    # ckks: layers to encrypt, as name prefixes ("backbone.conv1"); empty = every shared layer
    ckks_layers: tuple[str, ...] = ()
    ckks_decryptors: int = 2  # clients that decrypt the sum; with 2 the server compares them
    # ckks: a decryptor floods its output with Gaussian noise 2^bits x the decryption error's
    # bound (statistical distance <= 2^-(bits+1) from an error-free output; privacy.ckks.flooding)
    ckks_flooding_bits: int = 40

    def __post_init__(self) -> None:
        """Check ranges."""
        check(self.neighbours >= 0, "secure_aggregation.neighbours", "an integer >= 0")
        check(self.threshold >= 0, "secure_aggregation.threshold", "an integer >= 0")
        check(
            1 <= self.modulus_bits <= 64, "secure_aggregation.modulus_bits", "an integer in 1..64"
        )
        check(self.clip_range > 0, "secure_aggregation.clip_range", "a number > 0")
        check(0 <= self.scale_bits <= 52, "secure_aggregation.scale_bits", "an integer in 0..52")
        check(
            0 < self.stage_timeout <= MAX_TIMEOUT,
            "secure_aggregation.stage_timeout",
            TIMEOUT_RANGE,
        )
        check(
            0 <= self.corrupt_fraction < 0.5,
            "secure_aggregation.corrupt_fraction",
            "a number in [0, 0.5)",
        )
        check(
            0 <= self.dropout_fraction < 0.5,
            "secure_aggregation.dropout_fraction",
            "a number in [0, 0.5)",
        )
        check(
            1 <= self.security_bits <= 128,
            "secure_aggregation.security_bits",
            "an integer in 1..128",
        )
        check(
            1 <= self.correctness_bits <= 128,
            "secure_aggregation.correctness_bits",
            "an integer in 1..128",
        )
        check(self.ckks_decryptors in (1, 2), "secure_aggregation.ckks_decryptors", "1 or 2")
        check(
            isinstance(self.ckks_flooding_bits, int) and 16 <= self.ckks_flooding_bits <= 128,
            "secure_aggregation.ckks_flooding_bits",
            "an integer in 16..128",
        )
        if self.scheme == "secagg+" and self.neighbours % 2:
            raise ConfigError(
                f"secure_aggregation.neighbours = {self.neighbours}: SecAgg+ needs an even k "
                "(a ring with k/2 neighbours on either side; an odd k has no graph on an odd "
                "cohort, and its chords let dropouts cut the survivors into groups); use "
                f"{self.neighbours + 1}"
            )

    @property
    def enabled(self) -> bool:
        """Whether updates are securely aggregated."""
        return self.scheme != "none"
