"""Run configuration: frozen dataclasses loaded from TOML and validated on load.

Every key is typed; an unknown key, a value of the wrong type, or a value outside the allowed
set stops with a :class:`~fl_secure.errors.ConfigError` that names the key and what is allowed.
``--set section.key=value`` overrides are parsed as TOML values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from fl_secure.errors import ConfigError
from fl_secure.models.heads import DEFAULT_SCALE_MARGIN, HeadKind

DataSource = Literal["synthetic", "folders", "celeba"]
PartitionKind = Literal["equal", "lognormal", "dirichlet", "attribute", "domain"]
AlgorithmName = Literal[
    "fedavg",
    "fedpe",
    "fedgc",
    "fedcos",
    "hfmaml",
    "hfmaml-global",
    "adafedfr",
    "fedaffect",
    "fedfr-public",
    "fedfr",
]
Optimizer = Literal["sgd", "adam"]
LrSchedule = Literal["constant", "cosine"]
PrivacyUnit = Literal["none", "client", "example"]
NoisePlacement = Literal["local", "distributed", "central"]
#: smallest privacy.noise_multiplier: privacy.dp.accountants.accountant.MIN_ACCOUNTED_NOISE, kept
#: here so that reading a config does not import the accountants (a test ties the two)
MIN_NOISE_MULTIPLIER = 0.05
#: The longest timeout a config may set (a week): larger ones overflow the waits' timers
#: and the task's deadline field, and no round should wait that long.
MAX_TIMEOUT = 7 * 24 * 3600.0
_TIMEOUT_RANGE = "seconds in (0, 604800] (up to a week)"
_RUN_NAME = re.compile(r"[^/\\\x00-\x1f\x7f.\s][^/\\\x00-\x1f\x7f]{0,99}")
AccountantName = Literal["", "rdp", "prv", "pld"]
ClippingEngine = Literal["auto", "book-keeping", "opacus"]
SecAggScheme = Literal["none", "secagg", "secagg+", "ckks"]


@dataclass(frozen=True)
class RunConfig:
    """Identity and seed of a run."""

    name: str = "run"  # run directory name under --out (a timestamp is appended)
    seed: int = 0  # seeds data generation, partitions and model initialisation

    def __post_init__(self) -> None:
        _check(
            bool(_RUN_NAME.fullmatch(self.name)),
            "run.name",
            "a plain folder name of 1-100 characters, no '/', '\\' or control characters, not "
            "starting with '.' "
            f"or a space (got {self.name!r}; the run directory goes under --out)",
        )
        _check(0 <= self.seed < 2**63, "run.seed", "an integer in [0, 2**63)")


@dataclass(frozen=True)
class DataConfig:
    """Where the faces come from and how they are split."""

    source: DataSource = "synthetic"
    path: str = ""  # identity folders (source = "folders"), e.g. ../shared/data/orl, or the
    # flat image folder of source = "celeba" (img_align_celeba)
    attributes_file: str = ""  # celeba: list_attr_celeba.txt (identity-level majority attributes)
    identities_file: str = ""  # celeba: identity_CelebA.txt ("filename identity" lines)
    image_size: int = 64  # square side in pixels: 64 (default) or 112
    num_identities: int = 120  # synthetic: identities generated
    images_per_identity: int = 20  # synthetic: images per identity
    max_identities: int = 0  # folders: 0 = all
    min_images_per_identity: int = 2  # folders: identities with fewer images are skipped
    max_images_per_identity: int = 0  # folders: 0 = all
    center_crop: int = 0  # folders: centre-crop to this many pixels before resizing (0 = off)
    held_out_identities: int = 40  # identities held out from all clients (server evaluation)
    test_fraction: float = 0.3  # per-identity fraction of each client's images kept for testing
    # synthetic: multiplier of the expression deformations (1.0 = the default images bit for
    # bit; up to 2.5 makes the 5 expressions learnable, for fedaffect)
    expression_strength: float = 1.0

    def __post_init__(self) -> None:
        """Check ranges."""
        _check(self.image_size in (32, 64, 112), "data.image_size", "one of 32, 64, 112")
        _check(self.num_identities > 1, "data.num_identities", "an integer > 1")
        _check(self.images_per_identity > 1, "data.images_per_identity", "an integer > 1")
        _check(self.held_out_identities >= 0, "data.held_out_identities", "an integer >= 0")
        _check(self.max_identities >= 0, "data.max_identities", "an integer >= 0 (0 = all)")
        _check(self.min_images_per_identity >= 1, "data.min_images_per_identity", "an integer >= 1")
        _check(
            self.max_images_per_identity == 0
            or self.max_images_per_identity >= self.min_images_per_identity,
            "data.max_images_per_identity",
            f"0 (all) or an integer >= data.min_images_per_identity "
            f"({self.min_images_per_identity})",
        )
        _check(self.center_crop >= 0, "data.center_crop", "an integer >= 0 (0 = off)")
        _check(0.0 < self.test_fraction < 1.0, "data.test_fraction", "a number in (0, 1)")
        _check(
            0.0 <= self.expression_strength <= 2.5,
            "data.expression_strength",
            "a number in [0, 2.5]",
        )
        _check(self.source == "synthetic" or bool(self.path), "data.path", "a folder path")
        if self.source == "celeba":
            _check(bool(self.attributes_file), "data.attributes_file", "list_attr_celeba.txt")
            _check(bool(self.identities_file), "data.identities_file", "identity_CelebA.txt")


@dataclass(frozen=True)
class PartitionConfig:
    """How the training identities are spread over clients."""

    kind: PartitionKind = "equal"  # equal, lognormal (HF-MAML Eq. 5) or dirichlet
    num_clients: int = 4
    # lognormal: mu of S_i (HF-MAML: 3). Eq. 5 normalises the S_i, so mu cancels and only
    # sigma shapes the sizes; kept as the paper states it
    mu: float = 3.0
    sigma: float = 3.0  # lognormal: sigma of S_i (HF-MAML: 3)
    alpha: float = 0.5  # dirichlet: concentration (smaller: more skewed)
    clients: tuple[str, ...] = ()  # attribute: one predicate per client, "male=1 & hat=0"
    # clients that join only after training (HF-MAML Sec. IV-A: 15 train + 5 test clients):
    # partitioned with the others, identities disjoint from training, never in a round; with
    # kind = "attribute" the last held_out_clients predicates of `clients` are theirs
    held_out_clients: int = 0
    # domain (FedFR, synthetic data only): client 0 is the labelled source-domain client with
    # this fraction of the training identities; clients 1.. split the rest equally and hold
    # them in the generator's "shifted" domain, as do the held-out identities (the target)
    source_fraction: float = 0.5

    def __post_init__(self) -> None:
        """Check ranges."""
        _check(1 <= self.num_clients <= 1000, "partition.num_clients", "an integer in [1, 1000]")
        _check(0 < self.source_fraction < 1, "partition.source_fraction", "a number in (0, 1)")
        if self.kind == "domain":
            _check(
                self.num_clients >= 2,
                "partition.num_clients",
                "an integer >= 2 with kind = 'domain' (one source client + target clients)",
            )
            _check(
                self.held_out_clients == 0, "partition.held_out_clients", "0 with kind = 'domain'"
            )
        _check(self.sigma > 0, "partition.sigma", "a number > 0")
        _check(self.alpha > 0, "partition.alpha", "a number > 0")
        _check(0 <= self.held_out_clients <= 1000, "partition.held_out_clients", "0..1000")
        if self.kind == "attribute":
            if not all(isinstance(c, str) and c.strip() for c in self.clients):
                raise ConfigError("partition.clients: expected a list of predicate strings")
            if len(self.clients) != self.num_clients + self.held_out_clients:
                raise ConfigError(
                    f"partition.kind = 'attribute' needs one predicate per client: "
                    f"partition.clients has {len(self.clients)}, num_clients + "
                    f"held_out_clients is {self.num_clients + self.held_out_clients}"
                )


@dataclass(frozen=True)
class ModelConfig:
    """Backbone and margin head."""

    backbone: str = "cnn"  # short name: cnn, cnn-small, resnet18, resnet18-bn
    embedding_size: int = 512
    head: HeadKind = "cosface"
    # s and m of the margin head (CosFace m3 / ArcFace m2); unset (0 and -1): the head's own
    # defaults, CosFace s 30, m 0.4 (AdaFedFR) and ArcFace s 8, m 0.5 (HF-MAML)
    scale: float = 0.0
    margin: float = -1.0
    pretrained: str = ""  # local safetensors file with backbone weights ("" = random init)

    def __post_init__(self) -> None:
        """Resolve the head's default scale and margin; check ranges."""
        default_s, default_m = DEFAULT_SCALE_MARGIN.get(self.head, DEFAULT_SCALE_MARGIN["cosface"])
        scale = default_s if self.scale == 0.0 else self.scale
        margin = default_m if self.margin == -1.0 else self.margin
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "margin", margin)
        _check(self.embedding_size > 0, "model.embedding_size", "an integer > 0")
        _check(scale > 0, "model.scale", "a number > 0 (0: the head's default)")
        _check(0 <= margin < 1.5, "model.margin", "a number in [0, 1.5) (-1: the head's default)")


@dataclass(frozen=True)
class AlgorithmConfig:
    """Federated algorithm."""

    name: AlgorithmName = "fedpe"
    # hfmaml: its step sizes are these two (plain SGD steps, Eq. 1-2), constant over the
    # rounds; train.lr, train.optimizer and train.lr_schedule do not apply to HF-MAML
    alpha: float = 0.01  # hfmaml: inner step (Eq. 2)
    beta: float = 0.1  # hfmaml: outer step (Eq. 1)
    delta: float = 0.001  # hfmaml: finite-difference width (Eq. 3)
    embedding_reg: float = 0.0  # hfmaml: C of the embedding regularization (Eq. 4)
    # fedgc/fedcos: lambda, the regularizer's learning-rate multiplier (FedGC Algorithm 1
    # line 13; 20 is the best of its Table 2); `lambda` is a Python keyword
    reg_lambda: float = 20.0
    num_negatives: int = 10  # adafedfr: k of the top-k negatives (Eq. 6; paper Table 4)
    # adafedfr: the server's public set, synthetic identities disjoint from the run's (Eq. 4)
    public_identities: int = 50
    public_images_per_identity: int = 10
    # fedaffect (FedAffect slides, Algorithm 1): each client labels this many training images
    # per expression, the rest are unlabelled; also the held-out support images per expression
    labels_per_class: int = 4
    n_way: int = 5  # fedaffect: classes per few-shot episode (N; capped at what a client has)
    k_shot: int = 2  # fedaffect: support images per class and episode (K)
    n_query: int = 2  # fedaffect: query images per class and episode (needs K + Q labelled)
    nt_xent_tau: float = 0.5  # fedaffect: NT-Xent temperature (LocalReprLearn, lines 26-27)
    projection_dim: int = 64  # fedaffect: output size of the private projection head p
    relation_hidden: int = 64  # fedaffect: hidden width of the relation module g
    use_unlabelled: bool = True  # fedaffect: false = no LocalReprLearn (the ablation)
    # fedfr: lambda of the domain constraint loss on the source client (FedFR Eq. 3; the
    # paper's FedFR-L value), 0 = off
    dcl_lambda: float = 0.01
    # fedfr: C-FINCH's distance threshold d as a cosine distance 1 - cos (inf = FINCH); the
    # default is the paper's FedFR-L d = 0.9 read as a Euclidean distance of unit features
    cfinch_threshold: float = 0.405

    def __post_init__(self) -> None:
        """Check ranges."""
        _check(self.reg_lambda >= 0, "algorithm.reg_lambda", "a number >= 0")
        _check(self.num_negatives >= 1, "algorithm.num_negatives", "an integer >= 1")
        _check(self.public_identities >= 1, "algorithm.public_identities", "an integer >= 1")
        _check(
            self.public_images_per_identity >= 1,
            "algorithm.public_images_per_identity",
            "an integer >= 1",
        )
        _check(self.alpha >= 0, "algorithm.alpha", "a number >= 0")
        _check(self.beta > 0, "algorithm.beta", "a number > 0")
        _check(self.delta > 0, "algorithm.delta", "a number > 0")
        _check(self.embedding_reg >= 0, "algorithm.embedding_reg", "a number >= 0")
        if self.embedding_reg > 0 and self.name not in ("hfmaml", "hfmaml-global"):
            raise ConfigError(
                f"algorithm.embedding_reg = {self.embedding_reg:g} (HF-MAML Eq. 4) is implemented "
                f"by hfmaml and hfmaml-global only; {self.name} would ignore it"
            )
        _check(self.labels_per_class >= 1, "algorithm.labels_per_class", "an integer >= 1")
        _check(2 <= self.n_way <= 5, "algorithm.n_way", "an integer in [2, 5] (5 expressions)")
        _check(self.k_shot >= 1, "algorithm.k_shot", "an integer >= 1")
        _check(self.n_query >= 1, "algorithm.n_query", "an integer >= 1")
        _check(self.nt_xent_tau > 0, "algorithm.nt_xent_tau", "a number > 0")
        _check(self.projection_dim >= 1, "algorithm.projection_dim", "an integer >= 1")
        _check(self.relation_hidden >= 1, "algorithm.relation_hidden", "an integer >= 1")
        _check(
            math.isfinite(self.dcl_lambda) and self.dcl_lambda >= 0,
            "algorithm.dcl_lambda",
            "a finite number >= 0",
        )
        _check(self.cfinch_threshold > 0, "algorithm.cfinch_threshold", "a number > 0 (or inf)")


@dataclass(frozen=True)
class TrainConfig:
    """Rounds and local optimisation."""

    rounds: int = 10
    local_epochs: int = 1
    local_steps: int = 0  # > 0: this many batches per round instead of epochs
    batch_size: int = 32
    optimizer: Optimizer = "sgd"  # sgd (momentum) or adam; state is reset every round
    lr: float = 0.1
    lr_schedule: LrSchedule = "constant"  # cosine: lr * (1 + cos(pi * (r - 1) / rounds)) / 2
    momentum: float = 0.9
    weight_decay: float = 5e-4
    threads: int = 1  # torch threads per client process

    def __post_init__(self) -> None:
        """Check ranges."""
        _check(self.rounds >= 1, "train.rounds", "an integer >= 1")
        _check(self.local_epochs >= 1, "train.local_epochs", "an integer >= 1")
        _check(self.local_steps >= 0, "train.local_steps", "an integer >= 0")
        _check(self.batch_size >= 1, "train.batch_size", "an integer >= 1")
        _check(self.lr > 0, "train.lr", "a number > 0")
        _check(0 <= self.momentum < 1, "train.momentum", "a number in [0, 1)")
        _check(self.weight_decay >= 0, "train.weight_decay", "a number >= 0")
        _check(self.threads >= 1, "train.threads", "an integer >= 1")


@dataclass(frozen=True)
class EvalConfig:
    """Client-side evaluation after training (HF-MAML paper, Sec. IV-C and Fig. 1-2).

    "Untuned" scores the final global backbone as it is; "tuned" first fine-tunes a copy of
    the client's model (global backbone + its head) for ``tune_steps`` local batches.
    """

    tune_steps: int = 5  # batches of local fine-tuning (the paper: 5); 0 = untuned only
    tune_lr: float = 0.0  # learning rate of the fine-tuning (0 = train.lr)

    def __post_init__(self) -> None:
        """Check ranges."""
        _check(self.tune_steps >= 0, "eval.tune_steps", "an integer >= 0")
        _check(self.tune_lr >= 0, "eval.tune_lr", "a number >= 0 (0 = train.lr)")


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
    # rows a client's uploaded head may have (FedGC: one per identity it trains on); 0 = the
    # identities of the server's own data plan, right for the embedded mode; a standalone
    # server whose sites bring their own data sets it to their largest identity count
    max_head_rows: int = 0

    def __post_init__(self) -> None:
        """Check ranges."""
        _check(self.min_clients >= 1, "server.min_clients", "an integer >= 1")
        _check(self.max_head_rows >= 0, "server.max_head_rows", "an integer >= 0")
        _check(self.clients_per_round >= 0, "server.clients_per_round", "an integer >= 0")
        _check(0 <= self.sample_rate <= 1, "server.sample_rate", "a number in [0, 1]")
        _check(0 < self.round_timeout <= MAX_TIMEOUT, "server.round_timeout", _TIMEOUT_RANGE)
        _check(self.max_retries >= 0, "server.max_retries", "an integer >= 0")
        _check(self.max_concurrent_uploads >= 1, "server.max_concurrent_uploads", "an integer >= 1")
        _check(self.max_upload_factor >= 1, "server.max_upload_factor", "a number >= 1")
        _check(
            0 < self.upload_idle_timeout <= MAX_TIMEOUT,
            "server.upload_idle_timeout",
            _TIMEOUT_RANGE,
        )


@dataclass(frozen=True)
class PrivacyConfig:
    """Differential privacy of the run: who is protected, how much noise, which budget.

    ``unit = "client"``: DP-FedAvg on the shared parameters' updates (a whole client's data
    is the protected record; AdaFedFR Algorithm 1 lines 23-26). ``unit = "example"``:
    DP-SGD with Opacus inside each client (one face image is the protected record).

    ``clipping`` (example unit) chooses how the per-example clipped gradient sum is computed:
    ``book-keeping`` (:mod:`privacy.dp.bookkeeping`: ghost norms and one clipped weight gradient
    per layer, no per-example gradients stored) or ``opacus`` (Opacus' hooks materialise
    every per-example gradient). Both give the same update up to float rounding; ``auto``
    takes book-keeping when every trainable layer is supported, else Opacus.
    """

    unit: PrivacyUnit = "none"  # none, client (DP-FedAvg) or example (DP-SGD on clients)
    noise_placement: NoisePlacement = "local"  # client unit: local, distributed or central
    clip_norm: float = 1.0  # C: update L2 bound (client) or per-example gradient bound (example)
    noise_multiplier: float = 0.0  # z (noise std = z * C); 0 = calibrate to target_epsilon
    target_epsilon: float = 0.0  # budget: training stops before passing it (0 = no budget)
    delta: float = 1e-5
    accountant: AccountantName = ""  # "" = pld for client level, prv for example level
    sample_rate: float = 0.0  # example unit: Poisson rate per step (0 = batch_size / examples)
    max_physical_batch_size: int = 64  # example unit: memory bound of DP-SGD
    clipping: ClippingEngine = "auto"  # example unit: per-example clipping engine (see below)
    secure_rng: bool = True  # DP noise from a CSPRNG; false only for reproducible tests

    def __post_init__(self) -> None:
        """Check ranges and combinations."""
        _check(self.clip_norm > 0, "privacy.clip_norm", "a number > 0")
        _check(
            self.noise_multiplier == 0 or MIN_NOISE_MULTIPLIER <= self.noise_multiplier < math.inf,
            "privacy.noise_multiplier",
            f"0 (calibrate to target_epsilon) or a finite number >= {MIN_NOISE_MULTIPLIER} (below "
            "it one round alone spends an epsilon above 100)",
        )
        _check(self.target_epsilon >= 0, "privacy.target_epsilon", "a number >= 0")
        _check(0 < self.delta < 1, "privacy.delta", "a number in (0, 1)")
        _check(0 <= self.sample_rate <= 1, "privacy.sample_rate", "a number in [0, 1]")
        _check(
            self.max_physical_batch_size >= 1,
            "privacy.max_physical_batch_size",
            "an integer >= 1",
        )
        if self.unit == "example" and self.noise_placement != "local":
            raise ConfigError(
                f"privacy.noise_placement = {self.noise_placement!r} with privacy.unit = "
                "'example': DP-SGD adds its noise on each client, in every step; the "
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

    def accountant_name(self) -> str:
        """The accountant used: configured, or PLD (client level) / PRV (example level)."""
        if self.accountant:
            return self.accountant
        return "prv" if self.unit == "example" else "pld"


@dataclass(frozen=True)
class SecureAggregationConfig:
    """Secure aggregation: the server learns only the sum of the cohort's updates.

    ``secagg`` is Bonawitz et al. (CCS 2017), every client masks against every other;
    ``secagg+`` is Bell et al. (CCS 2020), each client has ``neighbours`` neighbours in a
    random k-regular graph. Updates are clipped per coordinate to ``clip_range``, encoded with
    ``scale_bits`` fractional bits and summed mod ``2^modulus_bits`` (a configuration whose sum
    could wrap is refused when the round starts). ``ckks`` encrypts each update with CKKS
    (TenSEAL) under a secret key all clients share (``CERTS/ckks/clients.secret``); the server
    adds ciphertexts and one or two clients decrypt the sum (:mod:`privacy.ckks.server_round`).
    """

    scheme: SecAggScheme = "none"
    neighbours: int = 0  # secagg+: k neighbours per client (0 with secagg: all others)
    threshold: int = 0  # t of k shares rebuild a secret (0 = the smallest majority k//2 + 1)
    modulus_bits: int = 32  # arithmetic mod 2^modulus_bits (up to 64; 62 with distributed DP)
    clip_range: float = 1.0  # per-coordinate bound of the fixed-point encoding
    scale_bits: int = 20  # fractional bits: resolution 2^-scale_bits
    stage_timeout: float = 120.0  # seconds for key advertisement, key sharing and unmasking
    # ckks: layers to encrypt, as name prefixes ("backbone.conv1"); empty = every shared layer
    ckks_layers: tuple[str, ...] = ()
    ckks_decryptors: int = 2  # clients that decrypt the sum; with 2 the server compares them

    def __post_init__(self) -> None:
        """Check ranges."""
        _check(self.neighbours >= 0, "secure_aggregation.neighbours", "an integer >= 0")
        _check(self.threshold >= 0, "secure_aggregation.threshold", "an integer >= 0")
        _check(
            1 <= self.modulus_bits <= 64, "secure_aggregation.modulus_bits", "an integer in 1..64"
        )
        _check(self.clip_range > 0, "secure_aggregation.clip_range", "a number > 0")
        _check(0 <= self.scale_bits <= 52, "secure_aggregation.scale_bits", "an integer in 0..52")
        _check(
            0 < self.stage_timeout <= MAX_TIMEOUT,
            "secure_aggregation.stage_timeout",
            _TIMEOUT_RANGE,
        )
        _check(self.ckks_decryptors in (1, 2), "secure_aggregation.ckks_decryptors", "1 or 2")
        if self.scheme == "secagg+" and self.neighbours == 0:
            raise ConfigError(
                "secure_aggregation.scheme = 'secagg+' needs secure_aggregation.neighbours > 0 "
                "(the k of its k-regular graph); 'secagg' connects every pair of clients"
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

    def __post_init__(self) -> None:
        """Cross-section checks."""
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
        if self.algorithm.name in ("fedgc", "fedcos"):
            _check_server_sees_heads(self)
        if self.algorithm.name == "fedaffect" and self.privacy.unit == "example":
            raise ConfigError(
                "algorithm.name = 'fedaffect' cannot run with privacy.unit = 'example': NT-Xent "
                "couples the images of a minibatch, so DP-SGD's per-example clipping would not "
                "bound one image's influence; use privacy.unit = 'client' (DP-FedAvg) or 'none'"
            )
        if self.algorithm.name == "fedfr" and self.privacy.unit == "example":
            raise ConfigError(
                "algorithm.name = 'fedfr' cannot run with privacy.unit = 'example': a target "
                "client's pseudo labels come from clustering all its images (C-FINCH), so one "
                "image can change the labels of others and DP-SGD's per-example guarantee does "
                "not cover it; use privacy.unit = 'client' (DP-FedAvg) or 'none'"
            )
        if self.partition.kind == "domain" and self.data.source != "synthetic":
            raise ConfigError(
                "partition.kind = 'domain' needs data.source = 'synthetic': the target domain "
                "is the synthetic generator's 'shifted' domain"
            )
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


def _check_server_sees_heads(config: Config) -> None:
    """FedGC/FedCos upload each client's class embeddings in the clear (by design)."""
    name = config.algorithm.name
    if config.secure_aggregation.enabled:
        raise ConfigError(
            f"algorithm.name = {name!r} cannot run with secure_aggregation.scheme = "
            f"{config.secure_aggregation.scheme!r}: the server must see each client's class "
            "embeddings to apply the FedGC correction, which secure aggregation exists to hide; "
            "set secure_aggregation.scheme = 'none' or use fedpe"
        )
    if config.privacy.unit == "client":
        raise ConfigError(
            f"algorithm.name = {name!r} cannot run with privacy.unit = 'client': the uploaded "
            "class embeddings would be an unclipped, un-noised per-client release outside the "
            "client-level guarantee; use privacy.unit = 'example' (DP-SGD covers the "
            "embeddings) or 'none', or fedpe"
        )


# The one float key where TOML's ``inf`` means something (C-FINCH without a threshold is
# FINCH); every other float rejects inf and nan when the file is read, so a check such as
# ``lr > 0`` never has to think about them.
_INFINITY_ALLOWED = frozenset({"algorithm.cfinch_threshold"})


def _check(ok: bool, key: str, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: invalid value; allowed: {allowed}")


T = TypeVar("T")


def _convert(value: Any, hint: Any, key: str) -> Any:
    origin = get_origin(hint)
    if origin is Literal:
        allowed = get_args(hint)
        if value not in allowed:
            raise ConfigError(
                f"{key} = {value!r} is not allowed; allowed: {', '.join(map(repr, allowed))}"
            )
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r}: expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {value!r}: expected an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} = {value!r}: expected a number")
        number = float(value)
        if math.isnan(number) or (math.isinf(number) and key not in _INFINITY_ALLOWED):
            raise ConfigError(f"{key} = {value!r}: expected a finite number")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r}: expected a string")
        return value
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} = {value!r}: expected a list")
        item = get_args(hint)[0] if get_args(hint) else Any
        if item is Any:
            return tuple(value)
        return tuple(_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is types.UnionType:
        return value
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if not isinstance(value, dict):
            raise ConfigError(f"[{key}] must be a table")
        return _build(hint, value, key)
    raise ConfigError(f"{key}: unsupported type {hint}")  # pragma: no cover


def _build(cls: type[T], table: dict[str, Any], prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(table) - names)
    if unknown:
        where = f"[{prefix}]" if prefix else "the top level"
        raise ConfigError(
            f"unknown key {', '.join(unknown)} in {where}; allowed: {', '.join(sorted(names))}"
        )
    kwargs = {
        name: _convert(value, hints[name], f"{prefix}.{name}" if prefix else name)
        for name, value in table.items()
    }
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``section.key=value`` (value in TOML syntax; bare words are strings)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    path, raw = text.split("=", 1)
    keys = [k.strip() for k in path.strip().split(".")]
    if not all(keys):
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return keys, value


def config_from_dict(
    table: dict[str, Any],
    overrides: list[str] | tuple[str, ...] = (),
    *,
    override_base: Path | None = None,
) -> Config:
    """Build a validated :class:`Config` from a TOML table and ``--set`` overrides.

    ``override_base``: the folder relative file paths given with ``--set`` are taken from
    (the current directory, where the user typed them); ``None`` leaves them as given.
    """
    merged: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in table.items()}
    for text in overrides:
        keys, value = parse_override(text)
        if override_base is not None and tuple(keys) in _PATH_KEYS and isinstance(value, str):
            value = _resolve(value, override_base)
        node = merged
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {key} is not a table")
        node[keys[-1]] = value
    return _build(Config, merged)


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load and validate a TOML configuration file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        table = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p} is not a UTF-8 text file (TOML is UTF-8): {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc}") from exc
    # Relative data and weight paths: from the config file's folder when written in the file,
    # from the current directory when given with --set.
    base = p.resolve().parent
    for section, key in _PATH_KEYS:
        node = table.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str):
            node[key] = _resolve(node[key], base)
    return config_from_dict(table, overrides, override_base=Path.cwd())


_PATH_KEYS = (
    ("data", "path"),
    ("data", "attributes_file"),
    ("data", "identities_file"),
    ("model", "pretrained"),
)


def _resolve(value: str, base: Path) -> str:
    return str((base / value).resolve()) if value and not Path(value).is_absolute() else value


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # a TOML basic string: JSON's escapes, and DEL, which TOML bans
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def config_to_toml(config: Config) -> str:
    """Resolved configuration as TOML text (what a run directory's config.toml holds)."""
    lines: list[str] = []
    for section in fields(config):
        lines.append(f"[{section.name}]")
        sub = getattr(config, section.name)
        for f in fields(sub):
            lines.append(f"{f.name} = {_toml_value(getattr(sub, f.name))}")
        lines.append("")
    return "\n".join(lines)


def config_fingerprint(config: Config) -> str:
    """SHA-256 of the resolved config (its :func:`config_to_toml` text).

    Comments, key order and formatting of a config file do not change it; any value does.
    Checkpoints record it, so a resume can tell that config.toml was edited in between.
    """
    return hashlib.sha256(config_to_toml(config).encode()).hexdigest()
