"""Build the server side of a run from its config: initial parameters, evaluator, coordinator."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fl_secure.algorithms import Strategy, get_strategy
from fl_secure.algorithms.fedaffect import (
    FedAffect,
    build_fedaffect_model,
    make_expression_evaluator,
)
from fl_secure.checkpoints import CheckpointStore
from fl_secure.config import Config, config_fingerprint, config_to_toml
from fl_secure.data.manifest import data_manifest
from fl_secure.data.plan import FederatedData, plan_federation
from fl_secure.errors import ConfigError, PrivacyError
from fl_secure.messages import Tensors, TensorSpec
from fl_secure.runs import RunDir, atomic_write_bytes, read_json_object
from fl_secure.tls.identity import load_signing_registry
from fl_secure.training import (
    build_model,
    evaluate_verification,
    get_tensors,
    local_training,
    set_tensors,
)
from privacy.client_level import ClientLevelPlan, client_noise_std
from privacy.noise import NoiseSource, seeded_source
from privacy.session import ServerPrivacy, client_level_plan, open_server_privacy
from server.coordinator import Coordinator
from server.settings import CoordinatorSettings

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
    if config.algorithm.name == "fedaffect":
        return make_expression_evaluator(
            config.model, config.algorithm, config.data.image_size, config.run.seed, plan.held_out
        )
    model = build_model(config.model, 1, config.data.image_size, config.run.seed)
    backbone = model.backbone

    def evaluate(params: Tensors) -> dict[str, float]:
        prefix = "backbone."
        set_tensors(
            backbone,
            type(params)((k[len(prefix) :], v) for k, v in params.items() if k.startswith(prefix)),
        )
        return evaluate_verification(backbone, plan.held_out, roc_points=True)

    return evaluate


def _first_data_manifest(run_dir: RunDir, config: Config) -> dict[str, Any]:
    """The data manifest of the run's first start (a resume keeps it, and notes a change).

    The report states it: the data the run trained on, hashed when it started, not what the
    folder holds when the report is written.
    """
    now = data_manifest(dataclasses.asdict(config.data), seed=config.run.seed)
    previous = run_dir.path / "partition.json"
    if not previous.is_file():
        return now
    recorded = read_json_object(previous, "the run's partition record").get("data_manifest")
    if not isinstance(recorded, dict):
        return now
    if recorded.get("kind") != now.get("kind"):  # hashed by an earlier release: not comparable
        log.info("the run's data manifest was recorded as %r; kept", recorded.get("kind"))
        return recorded
    if recorded.get("sha256") != now.get("sha256"):
        log.warning(
            "the data differ from those the run started with (manifest %s, now %s)",
            recorded.get("sha256"),
            now.get("sha256"),
        )
        changes = list(recorded.get("changed_on_resume", []))
        return {**recorded, "changed_on_resume": [*changes, now]}
    return recorded


def starts_of(record: Mapping[str, Any]) -> list[str]:
    """The server's starts on a run (first, then resumes), from its ``partition.json`` record."""
    starts = record.get("starts")
    return [s for s in starts if isinstance(s, str)] if isinstance(starts, list) else []


def _recorded_starts(run_dir: RunDir) -> list[str]:
    """The server's starts on this run so far, as ``partition.json`` records them."""
    previous = run_dir.path / "partition.json"
    if not previous.is_file():
        return []
    return starts_of(read_json_object(previous, "the run's partition record"))


def record_start(run_dir: RunDir) -> None:
    """Add this start (UTC, ISO 8601) to ``partition.json``'s ``starts``: first, then resumes.

    Called once :meth:`~server.coordinator.Coordinator.resume` accepted the run (a refused
    resume never ran), so that the summary and the report state when the run began and each
    time it was resumed, not only the last start.
    """
    from datetime import UTC, datetime

    path = run_dir.path / "partition.json"
    record = read_json_object(path, "the run's partition record")
    record["starts"] = [*starts_of(record), datetime.now(UTC).isoformat(timespec="seconds")]
    atomic_write_bytes(path, (json.dumps(record, indent=1) + "\n").encode())


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
    """Initial shared parameters (same seed as the clients), evaluator and coordinator."""
    strategy = get_strategy(config.algorithm.name, config.algorithm, head=config.model.head)
    plan = plan or plan_federation(config)
    manifest = {
        "kind": config.partition.kind,
        **plan.manifest(),
        "data_manifest": _first_data_manifest(run_dir, config),
        "starts": _recorded_starts(run_dir),  # this start is added once resume() accepts
    }
    atomic_write_bytes(
        run_dir.path / "partition.json", (json.dumps(manifest, indent=1) + "\n").encode()
    )
    classes = len(plan.train_identities) if strategy.shares_head else 1
    model = build_model(config.model, classes, config.data.image_size, config.run.seed)
    if isinstance(strategy, FedAffect):  # shared: encoder f and relation module g
        model = build_fedaffect_model(
            config.model, config.algorithm, config.data.image_size, config.run.seed
        )
    initial = get_tensors(model, strategy.shared_names(model))
    # server-sees-heads (FedGC): uploads end with the client's head, any number of rows
    head_specs = tuple(
        TensorSpec(name, array.dtype, (-1, *array.shape[1:]))
        for name, array in get_tensors(model, strategy.head_names(model)).items()
    )
    if config.privacy.unit == "example":  # refuse before any client trains, not in round 1
        from privacy.dpsgd import validate_model

        try:
            validate_model(model)
        except PrivacyError as exc:
            raise ConfigError(f"model.backbone = {config.model.backbone!r}: {exc}") from exc
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
    )
    over = privacy.first_round_over_budget() if privacy is not None else None
    if over is not None:
        raise ConfigError(
            f"privacy.noise_multiplier = {config.privacy.noise_multiplier:g} cannot pay for a "
            f"single round within privacy.target_epsilon = {config.privacy.target_epsilon:g}: "
            f"round 1 alone spends epsilon {over:.4g} (delta {config.privacy.delta:g}); raise "
            "the noise multiplier, or leave it at 0 to calibrate it to the target"
        )
    _check_encoding_range(config, privacy, sum(a.size for a in initial.values()), len(enrolled))
    sent = _config_for_clients(config, privacy)
    registry = _signing_registry(config, cert_dir, enrolled)
    ckks_public = _ckks_public_context(config, cert_dir)
    settings = CoordinatorSettings(
        rounds=config.train.rounds,
        min_clients=s.min_clients,
        clients_per_round=s.clients_per_round,
        sample_rate=s.sample_rate,
        round_timeout=s.round_timeout,
        max_retries=s.max_retries,
        max_concurrent_uploads=s.max_concurrent_uploads,
        upload_idle_timeout=s.upload_idle_timeout,
        max_upload_factor=s.max_upload_factor,
        algorithm=strategy.name,
        training=local_training(config.train),
        lr_schedule=config.train.lr_schedule,
        secure_aggregation=config.secure_aggregation,
        run_id=run_id,
        run_config_toml=config_to_toml(sent),
        config_sha256=config_fingerprint(config),
        head_specs=head_specs,
        max_head_rows=s.max_head_rows or len(plan.train_identities),
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


#: A noisy coordinate beyond this many standard deviations is clipped by the fixed-point
#: encoding; at 8 sigma that happens with probability ~1e-15 per coordinate.
ENCODING_SIGMAS = 8.0


def preflight(config: Config, population: int) -> None:
    """The checks that need no run directory, so a bad config leaves nothing behind.

    DP-SGD needs a model Opacus can train; client-level noise must be calibratable to the
    budget and fit the secure-aggregation encoding. :func:`build_server` repeats them.
    """
    # an unknown backbone or unusable pretrained weights: refused before a run dir exists
    model = build_model(config.model, 1, config.data.image_size, config.run.seed)
    if (
        config.data.source != "synthetic"
        and config.data.path
        and not Path(config.data.path).exists()
    ):
        raise ConfigError(f"data.path {config.data.path} does not exist")
    _check_secagg_cohort(config, population)
    if config.privacy.unit == "example":
        from privacy.dpsgd import validate_model

        try:
            validate_model(model)
        except PrivacyError as exc:
            raise ConfigError(f"model.backbone = {config.model.backbone!r}: {exc}") from exc
    if config.privacy.unit == "client":
        plan = client_level_plan(
            config.privacy,
            rounds=config.train.rounds,
            population=population,
            clients_per_round=config.server.clients_per_round,
            sample_rate=config.server.sample_rate,
        )
        _check_plan_encoding(config, plan)


def largest_cohort(config: Config, population: int) -> int:
    """The most clients a round of the run can have (``clients_per_round``, or everyone)."""
    return min(config.server.clients_per_round or population, population)


def _check_secagg_cohort(config: Config, population: int) -> None:
    """The threshold and the fixed-point modulus against the largest cohort the run can have.

    The round setup repeats both checks for the actual cohort; here a configuration that
    cannot work is refused before a run directory exists rather than at round 1.
    """
    sa = config.secure_aggregation
    if sa.scheme not in ("secagg", "secagg+"):
        return
    n = largest_cohort(config, population)
    from privacy.secagg import check_modulus
    from privacy.secagg_session import neighbourhood

    try:
        neighbourhood(sa, n)
        check_modulus(n, sa.clip_range, float(2**sa.scale_bits), sa.modulus_bits)
    except PrivacyError as exc:
        raise ConfigError(f"secure_aggregation: {exc}") from exc


def _check_encoding_range(
    config: Config, privacy: ServerPrivacy | None, vector_length: int, population: int
) -> None:
    """Under secure aggregation, clipped + noised updates must fit the encoding's range.

    With distributed noise, the discrete Gaussian of the largest cohort must be as private
    as the accounted Gaussian and its noisy sum must not wrap: checked here for the model's
    ``vector_length`` shared values, so the run stops before round 1 rather than in it.
    """
    if privacy is None or privacy.plan is None:
        return
    p, sa = privacy.plan, config.secure_aggregation
    if p.placement == "distributed" and sa.scheme in ("secagg", "secagg+"):
        from privacy.secagg_session import check_ddg

        n = largest_cohort(config, population)
        ddg = (p.noise_multiplier, p.clip_norm, config.server.min_clients)
        try:
            check_ddg(ddg, sa, n, vector_length)
        except PrivacyError as exc:
            raise ConfigError(f"privacy.noise_placement = 'distributed': {exc}") from exc
    _check_plan_encoding(config, p)


def _check_plan_encoding(config: Config, p: ClientLevelPlan) -> None:
    sa = config.secure_aggregation
    if sa.scheme in ("none", "ckks") or p.placement == "distributed":  # no fixed-point clip
        return
    std = client_noise_std(p.placement, p.noise_multiplier, p.clip_norm, config.server.min_clients)
    needed = p.clip_norm + ENCODING_SIGMAS * std
    if sa.clip_range < needed:
        raise ConfigError(
            f"secure_aggregation.clip_range = {sa.clip_range:g} would clip the noisy updates: "
            f"clip norm {p.clip_norm:g} plus {ENCODING_SIGMAS:g} x the clients' noise std "
            f"{std:.4g} needs at least {needed:.4g} (set secure_aggregation.clip_range = "
            f"{math.ceil(needed)})"
        )


def _signing_registry(
    config: Config, cert_dir: Path | None, enrolled: set[str]
) -> dict[str, Ed25519PublicKey]:
    """The CA-signed client signing keys, needed when updates are masked (SecAgg/SecAgg+)."""
    if config.secure_aggregation.scheme in ("none", "ckks"):
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
    from privacy.ckks_session import load_public_context

    try:
        return load_public_context(cert_dir)
    except PrivacyError as exc:
        raise ConfigError(str(exc)) from exc


def _noise_source(config: Config, party: str) -> NoiseSource | None:
    """``None`` (the CSPRNG) unless ``privacy.secure_rng = false`` asks for reproducible noise."""
    if config.privacy.secure_rng:
        return None
    log.warning("privacy.secure_rng = false: DP noise is reproducible, NOT cryptographic")
    return seeded_source(config.run.seed, party)


def _config_for_clients(config: Config, privacy: ServerPrivacy | None) -> Config:
    """The run config clients receive: with the client-level noise the server calibrated."""
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


def recorded_run_id(run_dir: RunDir) -> str | None:
    """The run id the run recorded (its ledger's), whatever the folder is called now.

    A run's id starts as its folder's name; once a checkpoint (or, before the first one, the
    ledger) records it, a folder that was renamed or moved still resumes as the same run,
    against the same ledger.
    """
    state = CheckpointStore(run_dir.checkpoints).latest_state()
    run_id = state.get("run_id") if state is not None else None
    if isinstance(run_id, str) and run_id:
        return run_id
    # No checkpoint yet, but the server may have made the ledger before it died: the ledger's
    # id is the run's (a folder renamed before round 1 would otherwise refuse its own ledger)
    ledger = run_dir.path / "ledger.sqlite"
    if state is None and ledger.is_file():
        from privacy.ledger import Ledger, LedgerError

        try:
            with Ledger.read(ledger) as held:
                return held.run_id or None
        except LedgerError:
            return None  # opening it for the run names the damage
    return None


def write_config(run_dir: RunDir, config: Config) -> Path:
    """Write the resolved config into the run directory."""
    atomic_write_bytes(run_dir.config, config_to_toml(config).encode())
    return run_dir.config
