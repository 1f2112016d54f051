"""The ``[run]`` and ``[server]`` sections, and :class:`Config`: the whole run, cross-checked."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fl_secure.config.data import DataConfig, PartitionConfig
from fl_secure.config.learning import AlgorithmConfig, EvalConfig, ModelConfig, TrainConfig
from fl_secure.config.protection import PrivacyConfig, SecureAggregationConfig
from fl_secure.config.values import MAX_TIMEOUT, RUN_NAME, TIMEOUT_RANGE, check
from fl_secure.errors import ConfigError


@dataclass(frozen=True)
class RunConfig:
    """Identity and seed of a run."""

    name: str = "run"  # run directory name under --out (a timestamp is appended)
    # seeds model initialisation, batch order and seeded noise; also data generation and
    # the partition unless partition.seed is set (Config.data_seed)
    seed: int = 0

    def __post_init__(self) -> None:
        check(
            bool(RUN_NAME.fullmatch(self.name)),
            "run.name",
            "a plain folder name of 1-100 characters, no '/', '\\' or control characters, not "
            "starting with '.' "
            f"or a space (got {self.name!r}; the run directory goes under --out)",
        )
        check(0 <= self.seed < 2**63, "run.seed", "an integer in [0, 2**63)")


@dataclass(frozen=True)
class ServerConfig:
    """Coordinator: cohorts, deadlines, limits."""

    address: str = "127.0.0.1:0"  # host:port to listen on (port 0 = any free port)
    min_clients: int = 2  # a round completes only with at least this many updates
    clients_per_round: int = 0  # fixed cohort size (0 = every connected client)
    sample_rate: float = 0.0  # > 0: Poisson cohort sampling with this rate instead
    round_timeout: float = 600.0  # seconds a round waits for its cohort
    max_retries: int = 2  # a round with too few updates is retried this often, then aborted
    max_concurrent_uploads: int = 2  # uploads buffered at once (bounds server memory)
    max_upload_factor: float = 1.05  # an upload may be at most this times the model's size
    # seconds an upload may send nothing before it is cancelled (a stalled client would
    # otherwise hold one of the max_concurrent_uploads slots); uploads also end with the round
    upload_idle_timeout: float = 60.0
    # bytes/s an upload must deliver, measured over windows of upload_idle_timeout seconds:
    # a client that trickles (an empty or 1-byte message every few seconds) is cancelled and
    # named, so a slot is held at most upload_idle_timeout + the upload's size / this rate
    upload_min_rate: float = 65536.0
    # seconds a TCP connection may take to complete its TLS handshake before it is closed
    # (connections that never handshake would otherwise be kept for gRPC's default 120 s)
    handshake_timeout: float = 10.0
    # rows a client's uploaded head may have (FedGC: one per identity it trains on); 0 = the
    # identities of the server's own data plan, right for the embedded mode; a standalone
    # server whose sites bring their own data sets it to their largest identity count
    max_head_rows: int = 0
    # Bounded client influence (plain updates; a masked update is seen only in its sum).
    # An update whose L2 norm (shared tensors) is over max_update_norm is refused (0 = no
    # absolute bound; a non-finite norm always is); one over update_norm_factor times the
    # median norm of its attempt's updates is dropped by name and the round retried without
    # it (0 = off; not under central client-level DP, whose clipping bounds every update).
    max_update_norm: float = 0.0
    update_norm_factor: float = 10.0
    # An update's weight in the mean is its example count, capped: at most what the client
    # stated at join, at most max_examples (0 = no absolute cap), and at most
    # examples_factor times the median count the enrolled clients stated at join (0 = off)
    max_examples: int = 0
    examples_factor: float = 10.0

    def __post_init__(self) -> None:
        """Check ranges."""
        check(self.min_clients >= 1, "server.min_clients", "an integer >= 1")
        check(self.max_head_rows >= 0, "server.max_head_rows", "an integer >= 0")
        check(self.clients_per_round >= 0, "server.clients_per_round", "an integer >= 0")
        check(0 <= self.sample_rate <= 1, "server.sample_rate", "a number in [0, 1]")
        check(0 < self.round_timeout <= MAX_TIMEOUT, "server.round_timeout", TIMEOUT_RANGE)
        check(self.max_retries >= 0, "server.max_retries", "an integer >= 0")
        check(self.max_concurrent_uploads >= 1, "server.max_concurrent_uploads", "an integer >= 1")
        check(self.max_upload_factor >= 1, "server.max_upload_factor", "a number >= 1")
        check(
            math.isfinite(self.max_update_norm) and self.max_update_norm >= 0,
            "server.max_update_norm",
            "a finite number >= 0 (0: no absolute bound on an update's L2 norm)",
        )
        for key, factor in (
            ("update_norm_factor", self.update_norm_factor),
            ("examples_factor", self.examples_factor),
        ):
            check(
                factor == 0 or (math.isfinite(factor) and factor >= 2),
                f"server.{key}",
                "0 (off) or a finite number >= 2 (a smaller factor refuses honest clients "
                "that merely differ from the median)",
            )
        check(self.max_examples >= 0, "server.max_examples", "an integer >= 0 (0: no cap)")
        check(
            0 < self.upload_idle_timeout <= MAX_TIMEOUT,
            "server.upload_idle_timeout",
            TIMEOUT_RANGE,
        )
        check(self.upload_min_rate >= 0, "server.upload_min_rate", "a number >= 0 (bytes/s)")
        check(0 < self.handshake_timeout <= MAX_TIMEOUT, "server.handshake_timeout", TIMEOUT_RANGE)


@dataclass(frozen=True)
class Config:
    """A whole run."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    secure_aggregation: SecureAggregationConfig = field(default_factory=SecureAggregationConfig)

    @property
    def data_seed(self) -> int:
        """The seed of the data and its split: ``partition.seed``, or ``run.seed`` if unset.

        It seeds the synthetic faces, ``data.degrade``'s draws, the held-out identities, the
        partition and each client's train/test split (:func:`fl_secure.data.plan.plan_federation`).
        """
        return self.partition.seed if self.partition.seed >= 0 else self.run.seed

    def __post_init__(self) -> None:
        """Cross-section checks that hold whatever the algorithm.

        What an algorithm itself refuses (FedGC under secure aggregation, FedAffect under
        DP-SGD, ...) is its strategy's to say, above this package:
        :func:`fl_secure.algorithms.registry.check_config`.
        """
        p = self.privacy
        if p.unit == "client" and p.noise_placement == "distributed":
            if not self.secure_aggregation.enabled:
                raise ConfigError(
                    "privacy.noise_placement = 'distributed' needs secure aggregation "
                    "(secure_aggregation.scheme = 'secagg' or 'secagg+'): each client adds only "
                    "a share of the noise, so the server must never see an individual update"
                )
            if self.secure_aggregation.scheme == "ckks":
                raise ConfigError(
                    "privacy.noise_placement = 'distributed' uses the distributed discrete "
                    "Gaussian on integer updates, which needs secure_aggregation.scheme = "
                    "'secagg' or 'secagg+'; with 'ckks' use noise_placement 'local'"
                )
            if self.secure_aggregation.modulus_bits > 62:
                raise ConfigError(
                    f"secure_aggregation.modulus_bits = {self.secure_aggregation.modulus_bits}: "
                    "privacy.noise_placement = 'distributed' does its integer arithmetic in "
                    "62 bits at most; use secure_aggregation.modulus_bits <= 62"
                )
        if p.unit == "client" and p.noise_placement == "central":
            if self.secure_aggregation.scheme == "ckks":
                raise ConfigError(
                    "privacy.noise_placement = 'central' with secure_aggregation.scheme = "
                    "'ckks': the server adds the noise after the sum is decrypted, and the "
                    "decrypting clients (trusted for nothing) would see the un-noised sum of "
                    "the cohort, minus their own update the others' sum; use noise_placement "
                    "'local' with 'ckks'"
                )
        if self.partition.kind == "domain" and self.data.source != "synthetic":
            raise ConfigError(
                "partition.kind = 'domain' needs data.source = 'synthetic': the target domain "
                "is the synthetic generator's 'shifted' domain"
            )
        _check_person_partition(self)
        if self.server.min_clients > self.partition.num_clients:
            raise ConfigError(
                f"server.min_clients = {self.server.min_clients} exceeds "
                f"partition.num_clients = {self.partition.num_clients}"
            )
        s = self.server
        if s.sample_rate == 0 and 0 < s.clients_per_round < s.min_clients:
            raise ConfigError(
                f"server.clients_per_round = {s.clients_per_round} is below server.min_clients "
                f"= {s.min_clients}: no round could ever complete"
            )
        if s.sample_rate > 0 and s.clients_per_round > 0:
            raise ConfigError(
                "server.sample_rate and server.clients_per_round both set: a cohort is either "
                "Poisson-sampled (sample_rate) or of fixed size (clients_per_round); set the "
                "other to 0"
            )


def _check_person_partition(config: Config) -> None:
    """``partition.kind = "person"``: one training identity per client, counted in advance.

    Synthetic data has a known number of identities, so a mismatch is refused here rather than
    when the data is planned; identity folders are counted by the plan.

    Raises:
        ConfigError: the synthetic identities not held out differ from the clients in number,
            or the attribute partition's predicates are set (a person partition has none).
    """
    p, d = config.partition, config.data
    if p.kind != "person":
        return
    if p.clients:
        raise ConfigError("partition.clients: predicates are for kind = 'attribute', not 'person'")
    total = p.num_clients + p.held_out_clients
    if d.source == "synthetic" and d.num_identities - d.held_out_identities != total:
        raise ConfigError(
            f"partition.kind = 'person' gives each client exactly one identity: "
            f"data.num_identities - data.held_out_identities = "
            f"{d.num_identities - d.held_out_identities}, but partition.num_clients + "
            f"partition.held_out_clients = {total}; set data.num_identities = "
            f"{total + d.held_out_identities}"
        )
