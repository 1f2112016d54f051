"""Build a client's trainer once the server has said which model and algorithm the run uses.

The client's data are its own: either its share of the embedded data plan (``plan_index``)
or identity folders on its disk (``data_path``), split per identity into train and test.
"""

from __future__ import annotations

import hashlib
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from client.trainer import LocalTrainer
from fl_secure.algorithms import get_strategy
from fl_secure.algorithms.fedaffect import FedAffect, build_fedaffect_model
from fl_secure.config import Config, DataConfig, config_from_dict
from fl_secure.data.align_report import log_aligned_folder
from fl_secure.data.folders import load_identity_folders
from fl_secure.data.plan import degrade_for_run, plan_federation
from fl_secure.data.splits import stratified_split
from fl_secure.errors import ConfigError
from fl_secure.training import (
    FaceModel,
    build_run_model,
    private_head_seed,
    with_trunk_features,
)
from privacy.client_round import ClientPrivacy
from privacy.dp.identity_dpsgd import number_of_identities
from privacy.dp.noise import seeded_source

if TYPE_CHECKING:
    from fl_secure.data.types import FaceDataset
    from fl_secure.messages import JoinReply


@dataclass(frozen=True)
class ClientDataSource:
    """Where this client's faces come from."""

    local_config: Config | None = None  # embedded: the run config, with ...
    plan_index: int = -1  # ... this client's share of the data plan
    data_path: Path | None = None  # separate machines: identity folders on this client's disk
    test_fraction: float = 0.3


def trainer_factory(
    source: ClientDataSource,
    *,
    state_dir: Path | None,
    threads: int | None = None,
    accept_seeded_noise: bool = False,
) -> Callable[[JoinReply], LocalTrainer]:
    """A callable the client loop runs after joining, with the server's run config.

    ``accept_seeded_noise``: take part in a run whose ``privacy.secure_rng = false``. That
    noise is seeded from ``run.seed`` and the client id, both known to the server, which could
    then subtract it from the update; only the operator's own processes (the embedded mode,
    tests) should accept it.
    """

    def make(reply: JoinReply) -> LocalTrainer:
        try:
            run_config = config_from_dict(tomllib.loads(reply.run_config_toml))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"the server sent an invalid run config: {exc}") from exc
        p = run_config.privacy
        if p.enabled and not p.secure_rng and not accept_seeded_noise:
            raise ConfigError(
                "the run sets privacy.secure_rng = false: this site's DP noise would be seeded "
                "from run.seed and the client id, which the server knows, so it could subtract "
                "the noise; refusing to join (for reproducible tests on your own machine, start "
                "the client with --accept-seeded-noise)"
            )
        torch.set_num_threads(threads or run_config.train.threads)
        strategy = get_strategy(
            run_config.algorithm.name,
            run_config.algorithm,
            head=run_config.model.head,
            scale=run_config.model.scale,
        )
        if source.plan_index >= 0:
            cfg = source.local_config or run_config
            plan = plan_federation(cfg)
            if source.plan_index >= len(plan.clients):
                raise ConfigError(
                    f"--plan-index {source.plan_index} out of range: the plan has "
                    f"{len(plan.clients)} clients"
                )
            share = plan.clients[source.plan_index]
            train, test, identities = share.train, share.test, plan.train_identities
            image_size = cfg.data.image_size
        elif source.data_path is not None:
            if isinstance(strategy, FedAffect):
                raise ConfigError(
                    "fedaffect needs an expression label per image, which identity folders "
                    "(--data DIR) do not carry: run it on the embedded synthetic data"
                )
            if strategy.shares_head:
                raise ConfigError(
                    f"{strategy.name} shares a global head, which needs one label space across "
                    "clients: use the embedded mode, or a private-head algorithm such as fedpe"
                )
            image_size = run_config.data.image_size
            # the run's preprocessing (the model was built for it) and its floor of images
            # per identity; its caps describe the server's own data set, not this site's
            log_aligned_folder(source.data_path, image_size)
            data = load_identity_folders(
                source.data_path,
                image_size=image_size,
                center_crop=run_config.data.center_crop or None,
                min_images_per_identity=run_config.data.min_images_per_identity,
            )
            # the run's target domain (data.degrade), as the server's held-out set has it
            data = degrade_for_run(data, run_config.data, run_config.data_seed)
            fractions = (1.0 - source.test_fraction, source.test_fraction)
            tr, te = stratified_split(data, fractions=fractions, seed=run_config.data_seed)
            train, test = data.subset(tr), data.subset(te)
            identities = np.unique(train.labels.numpy())
        else:
            raise ConfigError("a client needs --data DIR or --config FILE --plan-index N")
        return build_local_trainer(
            run_config,
            train,
            test,
            identities,
            client_id=reply.client_id,
            image_size=image_size,
            state_dir=state_dir,
            run_id=reply.run_id,
        )

    return make


def build_local_trainer(
    run_config: Config,
    train: FaceDataset,
    test: FaceDataset,
    identities: np.ndarray,
    *,
    client_id: str,
    image_size: int,
    state_dir: Path | None = None,
    run_id: str = "",
    model_source: Callable[[int, int | None], FaceModel] | None = None,
) -> LocalTrainer:
    """One client's trainer: model, label space, batch-order seed and DP, from the run config.

    Shared by the gRPC client and the in-process simulation, so both train identically.
    ``model_source(classes, head_seed)``: where the (non-FedAffect) model comes from, a model
    exactly as :func:`build_run_model` builds it (the simulation's workers hand back one
    model reset to that state instead of building one per job); None builds it.
    """
    strategy = get_strategy(
        run_config.algorithm.name,
        run_config.algorithm,
        head=run_config.model.head,
        scale=run_config.model.scale,
    )
    classes = strategy.num_head_classes(len(identities), np.unique(train.labels.numpy()))
    model: FaceModel
    if isinstance(strategy, FedAffect):  # encoder f, relation g (head slot), private p
        model = build_fedaffect_model(
            run_config.model, run_config.algorithm, image_size, run_config.run.seed
        )
    else:
        head_seed = (
            None if strategy.shares_head else private_head_seed(run_config.run.seed, client_id)
        )
        if model_source is not None:
            model = model_source(classes, head_seed)
        else:
            model = build_run_model(run_config, classes, image_size=image_size, head_seed=head_seed)
    local = strategy.local_data(train, test, identities)
    if not strategy.transforms_images:  # train.trainable froze the trunk: embed it once here
        local = with_trunk_features(model.backbone, local)
    # Batch order only (not security-sensitive): derived from the run seed and the client id
    # so that a run can be reproduced.
    digest = hashlib.sha256(f"{run_config.run.seed}:{client_id}".encode()).digest()
    privacy = None
    if run_config.privacy.enabled:
        privacy = ClientPrivacy(
            run_config,
            num_examples=len(local.train),
            # identity level: the records are the identities of the training images' labels
            num_identities=number_of_identities(local.train.labels),
            state_dir=state_dir,
            min_survivors=run_config.server.min_clients,
            run_id=run_id,
            source=None
            if run_config.privacy.secure_rng
            else seeded_source(run_config.run.seed, client_id),
        )
    return LocalTrainer(
        strategy,
        model,
        local,
        state_dir=state_dir,
        seed=int.from_bytes(digest[:8], "little") >> 1,
        privacy=privacy,
        run_id=run_id,
    )


__all__ = ["ClientDataSource", "DataConfig", "trainer_factory"]
