"""A client's DP before release: clip + noise (client level), own accountant (example level)."""

from __future__ import annotations

from collections import OrderedDict
from hashlib import sha256
from pathlib import Path

import numpy as np
import pytest

from fl_secure.config import config_from_dict
from fl_secure.errors import PrivacyError
from privacy.client_round import ClientPrivacy
from privacy.dp.calibration import epsilon_for
from privacy.dp.client_level import update_norm
from privacy.dp.noise import SeededGaussian


def test_client_level_release_clips_noises_and_keeps_metrics_home() -> None:
    # Prepare: z = 0.5, C = 2, local placement; an update of norm 50
    cfg = config_from_dict(
        {"privacy": {"unit": "client", "noise_multiplier": 0.5, "clip_norm": 2.0}}
    )
    privacy = ClientPrivacy(cfg, num_examples=100, source=SeededGaussian(1))
    update = OrderedDict(w=np.full((50_000,), 50 / np.sqrt(50_000), np.float32))
    # Execute
    out, metrics = privacy.release(
        update, {"train_loss": 1.2, "train_accuracy": 0.7, "local_steps": 10.0}, trained=True
    )
    # Assert: each coordinate is the clipped one, C / sqrt(d) = 0.0089 (unclipped: 0.22),
    # plus noise of std z C = 1: the mean over d coordinates is within 5 standard errors
    d = update["w"].size
    out64 = out["w"].astype(np.float64)
    assert abs(out64.mean() - 2.0 / np.sqrt(d)) < 5 * 1.0 / np.sqrt(d)
    assert out64.std() == pytest.approx(0.5 * 2.0, rel=0.02)
    assert update_norm(out) > 100  # noise of norm ~ sqrt(d): the signal is not released bare
    assert metrics == {}  # not even the schedule: epochs x N / batch tells N (site_figures)


def test_example_level_accountant_persists_and_stops_at_the_budget(tmp_path: Path) -> None:
    # Prepare: 640 images, batch 32 (q = 0.05), 1 epoch = 20 steps per round, z = 1.0
    table = {
        "train": {"rounds": 10, "local_epochs": 1, "batch_size": 32},
        "privacy": {"unit": "example", "noise_multiplier": 1.0, "target_epsilon": 2.2},
    }
    cfg = config_from_dict(table)
    privacy = ClientPrivacy(cfg, num_examples=640, state_dir=tmp_path, source=SeededGaussian(0))
    assert (privacy.sample_rate, privacy.steps_per_round) == (0.05, 20)
    one_round = epsilon_for(accountant="prv", noise_multiplier=1.0, sample_rate=0.05,
                            steps=20, delta=1e-5)  # fmt: skip
    two_rounds = epsilon_for(accountant="prv", noise_multiplier=1.0, sample_rate=0.05,
                             steps=40, delta=1e-5)  # fmt: skip
    assert one_round <= 2.2 < two_rounds  # so exactly one round fits the budget
    zero = OrderedDict(w=np.zeros(3, np.float32))
    # Execute: one round, then a restarted client (same state folder)
    assert privacy.may_train()
    _, metrics = privacy.release(zero, {"local_steps": 20.0, "train_loss": 3.0}, trained=True)
    restarted = ClientPrivacy(cfg, num_examples=640, state_dir=tmp_path)
    # Assert: the accountant survived the restart; another round would pass the budget
    assert metrics["dp_epsilon"] == pytest.approx(one_round, rel=1e-6)
    assert "train_loss" not in metrics
    assert restarted.epsilon() == pytest.approx(one_round, rel=1e-6)
    assert not restarted.may_train()
    _, idle = restarted.release(zero, {}, trained=False)
    assert idle["dp_steps"] == 0.0 and idle["dp_epsilon"] == pytest.approx(one_round, rel=1e-6)


def test_example_level_accountant_is_kept_per_run(tmp_path: Path) -> None:
    # Prepare: one round of 20 steps at q = 0.05, z = 1 in run "a"
    table = {
        "train": {"rounds": 10, "local_epochs": 1, "batch_size": 32},
        "privacy": {"unit": "example", "noise_multiplier": 1.0, "target_epsilon": 2.2},
    }
    cfg = config_from_dict(table)
    one_round = epsilon_for(accountant="prv", noise_multiplier=1.0, sample_rate=0.05,
                            steps=20, delta=1e-5)  # fmt: skip
    zero = OrderedDict(w=np.zeros(3, np.float32))
    run_a = ClientPrivacy(cfg, num_examples=640, state_dir=tmp_path, run_id="a")
    run_a.release(zero, {"local_steps": 20.0}, trained=True)
    # Execute: a new run "b" in the same folder, and run "a" restarted
    run_b = ClientPrivacy(cfg, num_examples=640, state_dir=tmp_path, run_id="b")
    resumed = ClientPrivacy(cfg, num_examples=640, state_dir=tmp_path, run_id="a")
    # Assert: "b" starts from nothing and may train; "a" resumes its round and may not
    assert run_b.epsilon() == 0.0 and run_b.may_train()
    assert resumed.epsilon() == pytest.approx(one_round, rel=1e-6)
    assert not resumed.may_train()
    assert run_a.state_path is not None and run_a.state_path != run_b.state_path
    # named by a digest, not by the server's string: a run id is never a path
    assert run_a.state_path.name == f"privacy_accountant-{sha256(b'a').hexdigest()[:16]}.json"
    sneaky = ClientPrivacy(cfg, num_examples=640, state_dir=tmp_path, run_id="../../x")
    assert sneaky.state_path is not None and sneaky.state_path.parent == tmp_path
    # a file of run "a" copied over run "b"'s name is refused, not taken as b's spending
    assert run_b.state_path is not None
    run_b.state_path.write_bytes(run_a.state_path.read_bytes())
    with pytest.raises(PrivacyError, match="belongs to run 'a', not 'b'"):
        ClientPrivacy(cfg, num_examples=640, state_dir=tmp_path, run_id="b")
    # the same run resumed under another accountant names both
    rdp = config_from_dict({**table, "privacy": {**table["privacy"], "accountant": "rdp"}})
    with pytest.raises(PrivacyError, match="does not fit this run.*'rdp'"):
        ClientPrivacy(rdp, num_examples=640, state_dir=tmp_path, run_id="a")


def test_a_state_from_before_per_run_accountants_is_adopted(tmp_path: Path) -> None:
    # Prepare: a client of an earlier version spent one round of run "a" into the unkeyed
    # privacy_accountant.json (no run id), then was upgraded in the middle of the run
    table = {
        "train": {"rounds": 10, "local_epochs": 1, "batch_size": 32},
        "privacy": {"unit": "example", "noise_multiplier": 1.0, "target_epsilon": 2.2},
    }
    cfg = config_from_dict(table)
    old = ClientPrivacy(cfg, num_examples=640, state_dir=tmp_path)  # run id "": unkeyed
    old.release(OrderedDict(w=np.zeros(3, np.float32)), {"local_steps": 20.0}, trained=True)
    assert old.state_path == tmp_path / "privacy_accountant.json"
    # Execute
    upgraded = ClientPrivacy(cfg, num_examples=640, state_dir=tmp_path, run_id="a")
    # Assert: its spending is not forgotten (the run's budget fits one round only)
    assert old.epsilon() > 0
    assert upgraded.epsilon() == pytest.approx(old.epsilon(), rel=1e-9)
    assert not upgraded.may_train()
    assert upgraded.state_path is not None and upgraded.state_path.exists()
    # adopted once: a later run starts afresh, and the old file is kept under another name
    assert ClientPrivacy(cfg, num_examples=640, state_dir=tmp_path, run_id="b").epsilon() == 0
    assert (tmp_path / "privacy_accountant.json.adopted").exists()
    # one written by another accountant is not this run's: left alone, not adopted
    (tmp_path / "privacy_accountant.json.adopted").rename(tmp_path / "privacy_accountant.json")
    rdp = config_from_dict({**table, "privacy": {**table["privacy"], "accountant": "rdp"}})
    other = ClientPrivacy(rdp, num_examples=640, state_dir=tmp_path, run_id="c")
    assert other.epsilon() == 0.0 and (tmp_path / "privacy_accountant.json").exists()


def test_example_level_calibrates_to_the_target_over_the_planned_rounds() -> None:
    cfg = config_from_dict(
        {
            "train": {"rounds": 5, "local_epochs": 1, "batch_size": 32},
            "privacy": {"unit": "example", "target_epsilon": 4.0},
        }
    )
    privacy = ClientPrivacy(cfg, num_examples=640)
    total = epsilon_for(accountant="prv", noise_multiplier=privacy.noise_multiplier,
                        sample_rate=0.05, steps=5 * 20, delta=1e-5)  # fmt: skip
    assert 0.99 * 4.0 <= total <= 4.0


@pytest.mark.parametrize("unit", ["client", "example", "none"])
def test_dp_keeps_the_example_count_home(unit: str) -> None:
    # Prepare: one client of a tiny synthetic federation (16 of its images are for training)
    from client.trainer_factory import build_local_trainer
    from fl_secure.data.plan import plan_federation
    from fl_secure.messages import LocalTraining

    table: dict[str, object] = {
        "data": {"image_size": 32, "num_identities": 8, "images_per_identity": 6,
                 "held_out_identities": 0},
        "partition": {"num_clients": 2},
        "model": {"backbone": "cnn-small", "embedding_size": 16},
    }  # fmt: skip
    if unit != "none":
        table["privacy"] = {"unit": unit, "noise_multiplier": 1.0}
    config = config_from_dict(table)
    plan = plan_federation(config)
    share = plan.clients[0]
    # Execute
    trainer = build_local_trainer(
        config, share.train, share.test, plan.train_identities, client_id="client-0",
        image_size=32,
    )  # fmt: skip
    _, examples, metrics = trainer.train(
        trainer.shared_parameters(), LocalTraining(local_epochs=1, batch_size=4)
    )
    # Assert: the count sent at join and with updates is the image count without DP, 1 under
    # DP (at the example level one image more or less is the neighbouring data set); so is
    # the schedule, 16 / 4 batches (tests/privacy/test_site_figures.py: every figure sent)
    assert len(share.train) == 16
    assert trainer.num_examples == examples == (16 if unit == "none" else 1)
    assert metrics.get("local_steps") == (4.0 if unit == "none" else None)


def test_the_budget_check_charges_the_steps_the_task_asks_for() -> None:
    # Prepare: planned 20 steps per round (1 epoch of 640 at q = 0.05) fit a 2.2 budget
    from fl_secure.messages import LocalTraining
    from privacy.dp.dpsgd import dpsgd_steps

    table = {
        "train": {"rounds": 10, "local_epochs": 1, "batch_size": 32},
        "privacy": {"unit": "example", "noise_multiplier": 1.0, "target_epsilon": 2.2},
    }
    privacy = ClientPrivacy(config_from_dict(table), num_examples=640, source=SeededGaussian(0))
    planned = LocalTraining(local_epochs=1, batch_size=32)
    greedy = LocalTraining(local_steps=80, batch_size=32)
    assert dpsgd_steps(640, greedy, 0.05) == 80
    eighty = epsilon_for(accountant="prv", noise_multiplier=1.0, sample_rate=0.05,
                         steps=80, delta=1e-5)  # fmt: skip
    assert eighty > 2.2
    # Execute / Assert: the planned task fits; a task of 80 steps does not
    assert privacy.may_train(planned)
    assert not privacy.may_train(greedy)


def test_example_level_plans_the_server_would_refuse_are_refused_before_training() -> None:
    from fl_secure.errors import PrivacyError

    # 100 000 images, batch 32 (q = 3.2e-4), 40 epochs: 125 000 steps a round (server: 1e5)
    long = config_from_dict(
        {"privacy": {"unit": "example", "noise_multiplier": 1.0},
         "train": {"batch_size": 32, "local_epochs": 40, "local_steps": 0}}
    )  # fmt: skip
    with pytest.raises(PrivacyError, match="125000 DP-SGD steps a round .* more than the 100000"):
        ClientPrivacy(long, num_examples=100_000)
    # a batch of 1 in 2 million images: q = 5e-7, below the 1e-6 the server accounts
    tiny = config_from_dict(
        {"privacy": {"unit": "example", "noise_multiplier": 1.0},
         "train": {"batch_size": 1, "local_steps": 10}}
    )  # fmt: skip
    with pytest.raises(PrivacyError, match="q = 5e-07 .* below the 1e-06"):
        ClientPrivacy(tiny, num_examples=2_000_000)
    # a task asking for more steps than that is not trained (the unchanged update goes out)
    from fl_secure.messages import LocalTraining

    ok = ClientPrivacy(tiny, num_examples=1000)
    assert ok.may_train(LocalTraining(local_steps=10)) is True
    assert ok.may_train(LocalTraining(local_steps=100_001)) is False
