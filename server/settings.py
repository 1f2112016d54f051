"""What the coordinator needs from the run configuration (:class:`CoordinatorSettings`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fl_secure.messages import LocalTraining, TensorSpec
from server.round import RoundRules

if TYPE_CHECKING:
    from fl_secure.config import SecureAggregationConfig


@dataclass(frozen=True)
class CoordinatorSettings:
    """What the coordinator needs from the run configuration."""

    rounds: int
    min_clients: int
    clients_per_round: int = 0
    sample_rate: float = 0.0
    round_timeout: float = 600.0
    max_retries: int = 2
    max_concurrent_uploads: int = 2
    max_upload_factor: float = 1.05
    upload_idle_timeout: float = 60.0  # an upload silent this long is cancelled
    # bytes/s an upload must deliver over each upload_idle_timeout window (server.uploads)
    upload_min_rate: float = 65536.0
    # seconds a TCP connection may take to finish its TLS handshake (server.app)
    handshake_timeout: float = 10.0
    algorithm: str = "fedpe"
    training: LocalTraining = field(default_factory=LocalTraining)
    algorithm_params: dict[str, float] = field(default_factory=dict)
    run_id: str = ""
    run_config_toml: str = ""
    # SHA-256 of the run's whole resolved config (config_to_toml); every checkpoint records
    # it and a resume refuses a config.toml edited since ("": not checked)
    config_sha256: str = ""
    poll_wait: float = 2.0  # seconds a long poll may wait before answering WAIT
    online_timeout: float = 30.0  # a client not heard of for this long is offline
    final_evaluation: bool = True
    lr_schedule: str = "constant"
    secure_aggregation: SecureAggregationConfig | None = None
    # server-sees-heads (FedGC): the head template of TRAIN uploads and the most rows a
    # client's head may have (server.round.RoundRules, with rounds, training, lr_schedule)
    head_specs: tuple[TensorSpec, ...] = ()
    max_head_rows: int = 0
    # bounded client influence (server.influence): an update's L2 norm bound (0: none) and
    # the factor of its attempt's median norm over which it is dropped (0: off); an update's
    # weight cap (0: none) and the factor of the clients' median stated count (0: off)
    max_update_norm: float = 0.0
    update_norm_factor: float = 10.0
    max_examples: int = 0
    examples_factor: float = 10.0
    # secure_aggregation.scheme = "ckks": the server's CKKS context (no key: it cannot decrypt)
    ckks_public_context: bytes = b""

    @property
    def secure(self) -> bool:
        """Whether training rounds are securely aggregated (SecAgg, SecAgg+ or CKKS)."""
        return self.secure_aggregation is not None and self.secure_aggregation.enabled

    def round_rules(self) -> RoundRules:
        """The rules every round follows (:class:`server.round.RoundRules`)."""
        return RoundRules(
            rounds=self.rounds,
            training=self.training,
            lr_schedule=self.lr_schedule,
            head_specs=self.head_specs,
            max_head_rows=self.max_head_rows,
        )
