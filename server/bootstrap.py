"""Bring up the server side of a run from its config: initial parameters, evaluator, coordinator.

The initial shared parameters come from the same seed as the clients' models; the run's
privacy session (ledger, accountant, calibrated client-level noise) is opened before anything
is released; the config sent to clients carries the noise the server calibrated. The checks
that need no run directory are :mod:`server.preflight`; the run directory's own records are
:mod:`server.run_files`.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fl_secure.algorithms import Strategy, check_config, get_strategy, strategy_class
from fl_secure.algorithms.fedaffect import (
    FedAffect,
    build_fedaffect_model,
    make_expression_evaluator,
)
from fl_secure.config import Config, config_fingerprint, config_sections_to_toml
from fl_secure.data.plan import FederatedData, plan_federation
from fl_secure.data.types import FaceDataset
from fl_secure.errors import ConfigError, PrivacyError
from fl_secure.tls.identity import load_signing_registry
from fl_secure.tls.layout import server_bundle
from fl_secure.training import (
    build_run_model,
    evaluate_verification,
    get_tensors,
    held_out_features,
    set_tensors,
)
from privacy.dp.noise import NoiseSource, seeded_source
from privacy.ledger.signed_head import HeadSigner
from privacy.server_round import ServerPrivacy, open_server_privacy
from server.coordinator import Coordinator
from server.custody import check_server_folder
from server.preflight import check_dpsgd_model, check_encoding_range
from server.round import round_rules
from server.run_files import recorded_run_id, write_partition_record
from server.settings import CoordinatorSettings

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from fl_secure.messages import Tensors
    from fl_secure.runs import RunDir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSide:
    """What the server holds: the coordinator and the data plan it evaluates with."""

    coordinator: Coordinator
    strategy: Strategy
    plan: FederatedData


def make_evaluator(config: Config, plan: FederatedData) -> Callable[[Tensors], dict[str, float]]:
    """Verification of the global backbone on the held-out identities.

    FedAffect: expression accuracy of the global encoder and relation module instead.
    """
    if strategy_class(config.algorithm.name).evaluates_expressions:
        return make_expression_evaluator(
            config.model, config.algorithm, config.data.image_size, config.run.seed, plan.held_out
        )
    model = build_run_model(config, 1)
    backbone = model.backbone
    held_out: list[FaceDataset] = []  # the trunk's features, once, if train.trainable froze it

    def evaluate(params: Tensors) -> dict[str, float]:
        prefix = "backbone."
        set_tensors(
            backbone,
            type(params)((k[len(prefix) :], v) for k, v in params.items() if k.startswith(prefix)),
        )
        if not held_out:
            held_out.append(held_out_features(backbone, plan.held_out))
        return evaluate_verification(backbone, held_out[0], roc_points=True)

    return evaluate


def build_server(
    config: Config,
    run_dir: RunDir,
    *,
    enrolled: set[str],
    plan: FederatedData | None = None,
    evaluate: bool = True,
    noise: NoiseSource | None = None,
    cert_dir: Path | None = None,
) -> ServerSide:
    """Initial shared parameters (same seed as the clients), evaluator and coordinator.

    ``cert_dir`` is the server's folder (``server/`` of a whole ``certs init`` folder); one
    that holds a client's private key or the CKKS secret is refused (:mod:`server.custody`).
    """
    check_config(config)
    if cert_dir is not None:
        cert_dir = server_bundle(cert_dir)
        check_server_folder(cert_dir)
    strategy = get_strategy(
        config.algorithm.name, config.algorithm, head=config.model.head, scale=config.model.scale
    )
    plan = plan or plan_federation(config)
    write_partition_record(run_dir, config, plan)
    classes = len(plan.train_identities) if strategy.shares_head else 1
    model = build_run_model(config, classes)
    if isinstance(strategy, FedAffect):  # shared: encoder f and relation module g
        model = build_fedaffect_model(
            config.model, config.algorithm, config.data.image_size, config.run.seed
        )
    initial = get_tensors(model, strategy.shared_names(model))
    # the schedule, and the head template server-sees-heads uploads end with (FedGC)
    rules = round_rules(config, strategy, model, plan)
    check_dpsgd_model(config, model)  # refuse before any client trains, not in round 1
    s = config.server
    run_id = recorded_run_id(run_dir) or run_dir.path.name or secrets.token_hex(4)
    privacy = open_server_privacy(
        config.privacy,
        run_dir.path / "ledger.sqlite",
        run_id,
        rounds=config.train.rounds,
        population=len(enrolled),
        clients_per_round=s.clients_per_round,
        sample_rate=s.sample_rate,
        source=noise or _noise_source(config, "server"),
        min_survivors=s.min_clients,
        # the ledger's signing key lives with the server's TLS key, not in the run folder
        # (an embedded or --insecure run keeps it in RUN_DIR/certs)
        signer=HeadSigner.load_or_create(cert_dir or run_dir.certs)
        if config.privacy.enabled
        else None,
    )
    over = privacy.first_round_over_budget() if privacy is not None else None
    if over is not None:
        raise ConfigError(
            f"privacy.noise_multiplier = {config.privacy.noise_multiplier:g} cannot pay for a "
            f"single round within privacy.target_epsilon = {config.privacy.target_epsilon:g}: "
            f"round 1 alone spends epsilon {over:.4g} (delta {config.privacy.delta:g}); raise "
            "the noise multiplier, or leave it at 0 to calibrate it to the target"
        )
    check_encoding_range(config, privacy, sum(a.size for a in initial.values()), len(enrolled))
    sent = _config_for_clients(config, privacy)
    registry = _signing_registry(config, cert_dir, enrolled)
    ckks_public = _ckks_public_context(config, cert_dir)
    settings = CoordinatorSettings(
        rounds=rules.rounds,
        min_clients=s.min_clients,
        clients_per_round=s.clients_per_round,
        sample_rate=s.sample_rate,
        round_timeout=s.round_timeout,
        max_retries=s.max_retries,
        max_concurrent_uploads=s.max_concurrent_uploads,
        upload_idle_timeout=s.upload_idle_timeout,
        upload_min_rate=s.upload_min_rate,
        handshake_timeout=s.handshake_timeout,
        max_upload_factor=s.max_upload_factor,
        max_update_norm=s.max_update_norm,
        update_norm_factor=s.update_norm_factor,
        max_examples=s.max_examples,
        examples_factor=s.examples_factor,
        algorithm=strategy.name,
        training=rules.training,
        lr_schedule=rules.lr_schedule,
        secure_aggregation=config.secure_aggregation,
        run_id=run_id,
        run_config_toml=config_sections_to_toml(sent),  # what clients read, no more
        config_sha256=config_fingerprint(config),
        head_specs=rules.head_specs,
        max_head_rows=rules.max_head_rows,
        ckks_public_context=ckks_public,
    )
    coordinator = Coordinator(
        settings,
        initial,
        enrolled=enrolled,
        run_dir=run_dir,
        server_step=strategy.server_update,
        evaluator=make_evaluator(config, plan) if evaluate and len(plan.held_out) else None,
        privacy=privacy,
        signing_registry=registry,
        head_step=strategy.server_heads if strategy.uploads_head else None,
        broadcast=strategy.broadcaster(config),
    )
    return ServerSide(coordinator=coordinator, strategy=strategy, plan=plan)


def _signing_registry(
    config: Config, cert_dir: Path | None, enrolled: set[str]
) -> dict[str, Ed25519PublicKey]:
    """The CA-signed client signing keys, needed under secure aggregation.

    SecAgg/SecAgg+ key advertisements and CKKS uploads are signed with them.
    """
    if config.secure_aggregation.scheme == "none":
        return {}
    if cert_dir is None:
        raise ConfigError(
            "secure aggregation needs the certificate folder (signing_keys.json signed by the "
            "CA); it cannot run with --insecure"
        )
    registry = load_signing_registry(cert_dir)
    missing = sorted(enrolled - set(registry))
    if missing:
        raise ConfigError(
            f"enrolled clients {missing} have no signing key in {cert_dir}/signing_keys.json; "
            "re-issue their certificates with `fl-secure certs`"
        )
    return registry


def _ckks_public_context(config: Config, cert_dir: Path | None) -> bytes:
    """The server's CKKS context (parameters only) when the scheme is ``ckks``."""
    if config.secure_aggregation.scheme != "ckks":
        return b""
    if cert_dir is None:
        raise ConfigError("secure_aggregation.scheme = 'ckks' cannot run with --insecure")
    # deferred: privacy.ckks imports tenseal, which only CKKS runs need
    from privacy.ckks.context import load_context
    from privacy.ckks.flooding import flooding_std
    from privacy.ckks.keys import load_public_context

    try:
        public = load_public_context(cert_dir)
        # a scale too small for the decryptors' noise flooding: refused now, not every round
        flooding_std(
            load_context(public, what="the public context"),
            summed=max(2, config.server.min_clients),
            ciphertexts=1,
            bits=config.secure_aggregation.ckks_flooding_bits,
        )
    except PrivacyError as exc:
        raise ConfigError(str(exc)) from exc
    return public


def _noise_source(config: Config, party: str) -> NoiseSource | None:
    """``None`` (the CSPRNG) unless ``privacy.secure_rng = false`` asks for reproducible noise."""
    if config.privacy.secure_rng:
        return None
    log.warning("privacy.secure_rng = false: DP noise is reproducible, NOT cryptographic")
    return seeded_source(config.run.seed, party)


def _config_for_clients(config: Config, privacy: ServerPrivacy | None) -> Config:
    """The run config clients receive: with the client-level noise the server calibrated.

    Only the sections and keys a client reads are sent
    (:data:`fl_secure.config.to_toml.CLIENT_KEYS`): never the server's data paths.
    """
    if privacy is None or privacy.plan is None:
        return config
    p = privacy.plan
    log.info(
        "client-level DP: z = %.4f%s, C = %g, q = %.4f (%s), placement %s, %s accountant",
        p.noise_multiplier,
        f" (calibrated to epsilon {p.target_epsilon:g} over {p.rounds} rounds)"
        if p.calibrated
        else "",
        p.clip_norm,
        p.sample_rate,
        p.sampling,
        p.placement,
        p.accountant,
    )
    return dataclasses.replace(
        config, privacy=dataclasses.replace(config.privacy, noise_multiplier=p.noise_multiplier)
    )
