"""Client-level DP in the round loop: ledger before release, epsilon per round, budget, resume."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fl_secure.config import PrivacyConfig
from fl_secure.errors import PrivacyError
from fl_secure.messages import LocalTraining, TaskKind, UpdateHeader
from fl_secure.runs import RunDir
from privacy.dp.calibration import epsilon_for
from privacy.dp.noise import SeededGaussian
from privacy.dp.rounding import up_to_places
from privacy.ledger.run_ledger import Ledger
from privacy.server_round import open_server_privacy
from server.coordinator import Coordinator
from server.settings import CoordinatorSettings

from .coordinator_clients import answer_every_task  # type: ignore[import-not-found]

CLIENTS = ("c0", "c1", "c2")


def _coordinator(
    tmp_path: Path,
    privacy_cfg: PrivacyConfig,
    rounds: int,
    round_timeout: float = 100.0,
    training: LocalTraining | None = None,
) -> Coordinator:
    run_dir = RunDir(tmp_path)
    privacy = open_server_privacy(
        privacy_cfg,
        tmp_path / "ledger.sqlite",
        "test-run",
        rounds=rounds,
        population=len(CLIENTS),
        clients_per_round=0,
        sample_rate=0.0,
        source=SeededGaussian(0),
    )
    settings = CoordinatorSettings(
        rounds=rounds,
        min_clients=3,
        round_timeout=round_timeout,
        poll_wait=0.05,
        final_evaluation=False,
        training=training or LocalTraining(),
    )
    initial = OrderedDict([("w", np.zeros((2, 2), np.float32))])
    return Coordinator(
        settings,
        initial,
        enrolled=set(CLIENTS),
        run_dir=run_dir,
        server_step=lambda p, u, r: OrderedDict((k, p[k] + u[k]) for k in p),
        privacy=privacy,
    )


def _submit(
    coord: Coordinator, cid: str, value: float = 10.0, count: int = 1, metrics=None
) -> None:
    """Poll until a task, then upload ``value`` in every coordinate claiming ``count``."""
    while True:
        task = coord.poll(cid, 0)
        if task.kind is TaskKind.TRAIN:
            break
        if task.kind is TaskKind.FINISHED:
            return
    _, params = coord.parameters(cid, task.round, task.nonce)
    update = OrderedDict((k, np.full_like(v, value)) for k, v in params.items())  # 10: norm 20
    header = UpdateHeader(task.round, task.nonce, count, metrics or {}, 1, 16)
    ticket = coord.open_upload(cid, header)
    try:
        coord.commit_upload(ticket, update)
    finally:
        coord.release_upload(ticket)


def _drive(coord: Coordinator, rounds: int, sends=None, metrics=None) -> None:
    """Join every client and run ``rounds`` rounds; ``sends``: client -> (value, count)."""
    for c in CLIENTS:
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    for _ in range(rounds):
        workers = [
            threading.Thread(
                target=_submit,
                args=(coord, c, *(sends or {}).get(c, ())),
                kwargs={"metrics": metrics},
            )
            for c in CLIENTS
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=30)
    driver.join(timeout=30)


def test_central_dp_rounds_write_the_ledger_and_epsilon_per_round(tmp_path: Path) -> None:
    # Prepare: central noise z = 2, C = 1, every client every round (q = 1)
    cfg = PrivacyConfig(unit="client", noise_placement="central", noise_multiplier=2.0)
    coord = _coordinator(tmp_path, cfg, rounds=3)
    # Execute
    _drive(coord, 3)
    # Assert: one client_level entry per round, epsilon = PLD of r rounds (the reference)
    assert coord.status == "completed"
    records = RunDir(tmp_path).read_metrics()
    expected = [
        epsilon_for(accountant="pld", noise_multiplier=2.0, sample_rate=1.0, steps=r, delta=1e-5)
        for r in (1, 2, 3)
    ]
    assert [r["epsilon"] for r in records[1:]] == pytest.approx(expected, rel=1e-9)
    assert records[3]["privacy"]["privacy_unit"] == "client"
    assert records[3]["privacy"]["noise_placement"] == "central"
    with Ledger.read(tmp_path / "ledger.sqlite") as ledger:
        entries = ledger.entries()
        assert ledger.verify().ok
    assert [(e.kind, e.round) for e in entries] == [("client_level", r) for r in (1, 2, 3)]
    assert entries[0].payload["cohort_size"] == 3
    # Each round releases the clipped mean (three updates of norm 20 -> norm 1 each, 0.5 per
    # coordinate, / W = 3 * 3 clients) plus noise of std z C / W = 2/3 per coordinate; three
    # rounds sum to 1.5 per coordinate plus noise of std 2/3 sqrt(3) = 1.15. Unclipped: 30;
    # without the noise: exactly 1.5.
    noise = coord.params["w"].astype(np.float64) - 1.5
    assert np.abs(noise).max() < 6 * (2 / 3) * np.sqrt(3)
    assert np.abs(noise).max() > 0.01  # 4 coordinates all within 0.01 of 0: p < 1e-7
    summary = coord.privacy.summary() if coord.privacy else {}
    assert summary["epsilon"] == pytest.approx(expected[-1])
    assert summary["noise_secure"] is False  # the test injected a seeded generator


def test_small_budget_stops_early_within_the_target(tmp_path: Path) -> None:
    # Prepare: a target between the epsilon of 2 and of 3 rounds
    # (local noise: integers on a grid, accounted by their zCDP bound)
    kwargs = {"accountant": "pld", "noise_multiplier": 3.0, "sample_rate": 1.0, "delta": 1e-5}
    eps2 = epsilon_for(**kwargs, steps=2, noise="discrete_gaussian")  # type: ignore[arg-type]
    eps3 = epsilon_for(**kwargs, steps=3, noise="discrete_gaussian")  # type: ignore[arg-type]
    target = (eps2 + eps3) / 2
    cfg = PrivacyConfig(
        unit="client", noise_placement="local", noise_multiplier=3.0, target_epsilon=target
    )
    coord = _coordinator(tmp_path, cfg, rounds=10)
    # Execute
    _drive(coord, 3)
    # Assert: stopped after round 2 with epsilon <= target, and says why
    assert coord.status == "budget_exhausted"
    assert coord.completed_round == 2
    assert "privacy budget reached: round 3 would bring" in coord.stop_reason
    # the epsilon spent is stated rounded up (4 decimals), never to the nearest
    assert coord.stop_reason.endswith(f"with epsilon {math.ceil(eps2 * 1e4) / 1e4:.4f}")
    assert tuple(up_to_places(x, 4) for x in (2.75334, 2.7533, 0.0)) == (
        "2.7534",
        "2.7533",
        "0.0000",
    )
    assert coord.privacy is not None
    assert coord.privacy.epsilon == pytest.approx(eps2) and coord.privacy.epsilon <= target
    with Ledger.read(tmp_path / "ledger.sqlite") as ledger:
        kinds = [(e.kind, e.round) for e in ledger.entries()]
    assert kinds == [("client_level", 1), ("client_level", 2), ("note", 3)]


def _crash_after_round_3_checkpoint(tmp_path: Path) -> PrivacyConfig:
    """Two rounds done, then a crash after round 3's checkpoint, before its ledger entry."""
    cfg = PrivacyConfig(unit="client", noise_placement="central", noise_multiplier=2.0)
    coord = _coordinator(tmp_path, cfg, rounds=2)
    _drive(coord, 2)
    assert coord.privacy is not None
    rows = coord.privacy.round_entries(3, 3, {})
    coord.store.save(3, coord.params, {"status": "running", "privacy_rows": rows})
    coord.privacy.ledger.close()
    return cfg


def test_resume_writes_a_checkpointed_rounds_lost_entry_once(tmp_path: Path) -> None:
    # Prepare: two rounds done; then simulate a crash after round 3's checkpoint was saved
    # but before its ledger entry was synced
    cfg = _crash_after_round_3_checkpoint(tmp_path)
    # Execute: resume twice (a second crash right after resuming)
    for _ in range(2):
        again = _coordinator(tmp_path, cfg, rounds=5)
        assert again.resume() == 3
        assert again.privacy is not None
        again.privacy.ledger.close()
    # Assert: round 3 counted exactly once; epsilon of 3 rounds
    with Ledger.read(tmp_path / "ledger.sqlite") as ledger:
        rounds = [e.round for e in ledger.entries() if e.kind == "client_level"]
        last = ledger.last("client_level")
    assert rounds == [1, 2, 3]
    assert last is not None
    expected = epsilon_for(
        accountant="pld", noise_multiplier=2.0, sample_rate=1.0, steps=3, delta=1e-5
    )
    assert last.payload["epsilon"] == pytest.approx(expected)


def test_resume_refuses_a_tampered_ledger(tmp_path: Path) -> None:
    import sqlite3

    cfg = PrivacyConfig(unit="client", noise_placement="central", noise_multiplier=2.0)
    coord = _coordinator(tmp_path, cfg, rounds=2)
    _drive(coord, 2)
    assert coord.privacy is not None
    coord.privacy.ledger.close()
    with sqlite3.connect(tmp_path / "ledger.sqlite") as conn:
        conn.execute(
            "UPDATE entries SET payload = replace(payload, '\"cohort_size\":3', "
            "'\"cohort_size\":30') WHERE seq = 1"
        )
    again = _coordinator(tmp_path, cfg, rounds=5)
    with pytest.raises(Exception, match="fails verification"):
        again.resume()


def test_resume_writes_nothing_on_a_ledger_that_does_not_match(tmp_path: Path) -> None:
    import sqlite3

    cfg = _crash_after_round_3_checkpoint(tmp_path)
    ledger_path = tmp_path / "ledger.sqlite"
    # the ledger deleted: refused, and no fresh ledger holding only round 3 is left behind
    ledger_path.rename(tmp_path / "kept.sqlite")
    with pytest.raises(PrivacyError, match="completed 3 rounds but its privacy ledger"):
        _coordinator(tmp_path, cfg, rounds=5).resume()
    assert not ledger_path.exists()
    # a ledger that lost round 1 and 2's entries (a valid, empty chain of this run): refused
    # before round 3's lost entry is written
    (tmp_path / "kept.sqlite").rename(ledger_path)
    with sqlite3.connect(ledger_path) as conn:
        conn.execute("DELETE FROM entries")
    before = ledger_path.read_bytes()
    with pytest.raises(PrivacyError, match="accounts 1 client-level rounds but the run comple"):
        _coordinator(tmp_path, cfg, rounds=5).resume()
    with Ledger.read(ledger_path) as ledger:
        assert ledger.entries() == []
    assert ledger_path.read_bytes() == before


def _two_client_config(backbone: str, privacy: dict[str, Any]) -> Any:
    """A tiny synthetic two-client config for starting a server (no training)."""
    from fl_secure.config import config_from_dict

    return config_from_dict(
        {
            "data": {"image_size": 32, "num_identities": 12, "images_per_identity": 4,
                     "held_out_identities": 2},
            "partition": {"num_clients": 2},
            "server": {"min_clients": 2},
            "model": {"backbone": backbone, "embedding_size": 16},
            "privacy": privacy,
        }
    )  # fmt: skip


def test_example_level_dp_refuses_a_batchnorm_backbone_before_training(tmp_path: Path) -> None:
    from fl_secure.errors import ConfigError
    from server.bootstrap import build_server

    config = _two_client_config("resnet18-bn", {"unit": "example", "noise_multiplier": 1.0})
    with pytest.raises(ConfigError, match=r"resnet18-bn.*BatchNorm.*GroupNorm backbone"):
        build_server(config, RunDir(tmp_path), enrolled={"client-0", "client-1"})


def test_a_fixed_noise_that_cannot_pay_for_one_round_is_refused_before_the_run(
    tmp_path: Path,
) -> None:
    from fl_secure.errors import ConfigError
    from privacy.dp.calibration import epsilon_for
    from server.bootstrap import build_server

    privacy = {"unit": "client", "noise_multiplier": 0.5, "target_epsilon": 1.0}
    config = _two_client_config("cnn-small", privacy)
    one_round = epsilon_for(accountant="pld", noise_multiplier=0.5, sample_rate=1.0, steps=1,
                            delta=1e-5, noise="discrete_gaussian")  # fmt: skip
    assert one_round > 1.0
    with pytest.raises(ConfigError, match=f"round 1 alone spends epsilon {one_round:.4g}"):
        build_server(config, RunDir(tmp_path), enrolled={"client-0", "client-1"})
    enough = _two_client_config("cnn-small", {**privacy, "noise_multiplier": 8.0})
    assert build_server(enough, RunDir(tmp_path / "ok"), enrolled={"client-0", "client-1"})


def test_a_bad_private_config_leaves_no_run_directory(tmp_path: Path) -> None:
    # local noise under secure aggregation with a fixed-point range too small for it
    from fl_secure.config import load_config
    from fl_secure.errors import ConfigError
    from server.embedded import run_embedded

    root = Path(__file__).resolve().parents[2]
    config = load_config(root / "examples" / "quickstart.toml", ["privacy.noise_placement=local"])
    with pytest.raises(ConfigError, match="clip_range = 1 would clip the noisy updates"):
        run_embedded(config, out=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_a_distributed_noise_sum_that_could_wrap_is_refused_before_round_1(
    tmp_path: Path,
) -> None:
    # The quickstart's distributed discrete Gaussian with a 24-bit modulus: the fixed-point
    # range fits (4 x 2^20 < 2^23) but the noisy integer sum of the cohort does not
    from fl_secure.config import load_config
    from fl_secure.errors import ConfigError
    from server.embedded import run_embedded

    root = Path(__file__).resolve().parents[2]
    config = load_config(
        root / "examples" / "quickstart.toml", ["secure_aggregation.modulus_bits=24"]
    )
    assert config.privacy.noise_placement == "distributed"
    with pytest.raises(ConfigError, match="'distributed': a cohort of 4 noisy sums could wrap"):
        run_embedded(config, out=tmp_path / "runs")
    assert list((tmp_path / "runs").iterdir()) == []  # the run folder it had made is gone


def test_a_run_renamed_before_its_first_checkpoint_keeps_its_ledgers_id(tmp_path: Path) -> None:
    # Prepare: a DP run's server started (its ledger made, named after the folder), then the
    # process died before round 1 and the folder was renamed
    from server.bootstrap import build_server

    config = _two_client_config(
        "cnn-small", {"unit": "client", "noise_multiplier": 1.0, "noise_placement": "central"}
    )
    enrolled = {"client-0", "client-1"}
    first = tmp_path / "tiny-20261125"
    first.mkdir()
    side = build_server(config, RunDir(first), enrolled=enrolled)
    assert side.coordinator.settings.run_id == "tiny-20261125"
    first.rename(tmp_path / "archived")
    # Execute: the renamed folder's server starts again
    again = build_server(config, RunDir(tmp_path / "archived"), enrolled=enrolled)
    # Assert: the run keeps the id its ledger holds (no "another run's ledger" refusal)
    assert again.coordinator.settings.run_id == "tiny-20261125"
    with Ledger.read(tmp_path / "archived" / "ledger.sqlite") as ledger:
        assert ledger.run_id == "tiny-20261125" and ledger.verify().ok


def _grown(tmp_path: Path, population: int) -> Any:
    cfg = PrivacyConfig(
        unit="client", noise_placement="central", noise_multiplier=1.5, delta=1e-5,
        secure_rng=False,
    )  # fmt: skip
    return open_server_privacy(
        cfg, tmp_path / "ledger.sqlite", "grow", rounds=4, population=population,
        clients_per_round=2, sample_rate=0.0, source=SeededGaussian(0),
    )  # fmt: skip


def _account(privacy: Any, round_: int) -> dict[str, Any]:
    return privacy.commit(round_, privacy.round_entries(round_, 2, {"c0": {}, "c1": {}}))


def test_a_run_resumed_with_more_sites_composes_each_rounds_own_population(
    tmp_path: Path,
) -> None:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    # Prepare: two rounds with cohorts of 2 out of 3 enrolled clients
    first = _grown(tmp_path, 3)
    for r in (1, 2):
        _account(first, r)
    first.ledger.close()
    # Execute: the server restarts with a fourth site enrolled; round 3 draws 2 of 4
    again = _grown(tmp_path, 4)
    again.resume(2, [])
    _account(again, 3)
    # Assert: the ledger's epsilon is dp_accounting's composition of the rounds as they ran
    # (replace-one, sampling without replacement; the noise over the sensitivity 2C)

    def swor(population: int) -> dp_accounting.DpEvent:
        return dp_accounting.SampledWithoutReplacementDpEvent(
            population, 2, dp_accounting.GaussianDpEvent(1.5 / 2)
        )

    reference = rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    reference.compose(dp_accounting.ComposedDpEvent([swor(3), swor(3), swor(4)]))
    with Ledger.read(tmp_path / "ledger.sqlite") as ledger:
        rows = [e.payload for e in ledger.entries() if e.kind == "client_level"]
    assert [r["population"] for r in rows] == [3, 3, 4]
    assert rows[-1]["epsilon"] == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)


def test_a_resume_that_would_change_the_sampling_scheme_is_refused(tmp_path: Path) -> None:
    # Prepare: clients_per_round = 2 of 2 enrolled: every client each round (Poisson, q = 1)
    first = _grown(tmp_path, 2)
    for r in (1, 2):
        _account(first, r)
    first.ledger.close()
    before = (tmp_path / "ledger.sqlite").read_bytes()
    # Execute: a third site enrolled makes the cohorts fixed-size (2 of 3)
    again = _grown(tmp_path, 3)
    with pytest.raises(PrivacyError) as caught:
        again.resume(2, [])
    again.ledger.close()
    # Assert: refused at start (not after a round trained), naming both schemes; the ledger
    # is untouched
    assert str(caught.value) == (
        "the ledger accounts its rounds with Poisson-sampled cohorts of 2 enrolled clients; "
        "with the 3 enrolled now, server.clients_per_round makes them fixed-size, which no "
        "accountant composes with those (add/remove vs replace-one adjacency): resume with "
        "the clients the run started with, or start a new run"
    )
    assert (tmp_path / "ledger.sqlite").read_bytes() == before


@pytest.mark.parametrize("placement", ["local", "central"])
def test_updates_the_server_saw_in_a_failed_attempt_are_counted(
    tmp_path: Path, placement: str
) -> None:
    # Prepare: client-level DP without secure aggregation, z = 2; in round 1's first attempt
    # only two of the three clients send (the attempt fails), then all three
    cfg = PrivacyConfig(unit="client", noise_placement=placement, noise_multiplier=2.0)
    coord = _coordinator(tmp_path, cfg, rounds=1, round_timeout=1.0)
    for c in CLIENTS:
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    # Execute
    for senders in (CLIENTS[:2], CLIENTS):
        workers = [threading.Thread(target=_submit, args=(coord, c)) for c in senders]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=30)
        time.sleep(1.5)  # past the first attempt's deadline (round_timeout 1 s)
    driver.join(timeout=30)
    assert [e["attempt"] for e in coord.events if e.get("round") == 1] == [0, 1]
    # Assert: with local noise (the guarantee covers the server's view) the two updates of
    # the failed attempt are a release, composed like a round: epsilon of 2 releases, not 1;
    # central noise trusts the server with them
    assert coord.status == "completed", coord.stop_reason
    with Ledger.read(tmp_path / "ledger.sqlite") as ledger:
        entries = ledger.entries()

    def eps(steps: int) -> float:
        return epsilon_for(
            accountant="pld", noise_multiplier=2.0, sample_rate=1.0, steps=steps, delta=1e-5,
            noise="gaussian" if placement == "central" else "discrete_gaussian",
        )  # fmt: skip

    if placement == "central":
        assert [(e.kind, e.round) for e in entries] == [("client_level", 1)]
        assert entries[0].payload["epsilon"] == pytest.approx(eps(1), rel=1e-9)
        return
    assert [(e.kind, e.round) for e in entries] == [("discarded_sum", 1), ("client_level", 1)]
    assert entries[0].payload["updates"] == 2 and entries[0].payload["attempt"] == 0
    assert entries[0].payload["epsilon"] == pytest.approx(eps(1), rel=1e-9)
    assert entries[1].payload["epsilon"] == pytest.approx(eps(2), rel=1e-9)
    assert coord.privacy is not None and coord.privacy.summary()["discarded_sums_accounted"] == 1


def test_a_round_refused_as_diverged_counts_the_sum_the_server_saw(tmp_path: Path) -> None:
    from fl_secure.evaluation import DegenerateEmbeddings

    # Prepare: local noise z = 2 (the guarantee covers the server's view); round 2's new
    # model is finite but its held-out embeddings overflow (the evaluator's 3rd call: the
    # 1st scores the initial model)
    cfg = PrivacyConfig(unit="client", noise_placement="local", noise_multiplier=2.0)
    coord = _coordinator(tmp_path, cfg, rounds=3)
    scored: list[int] = []

    def evaluator(params: Any) -> dict[str, float]:
        scored.append(len(scored))
        if len(scored) == 3:
            raise DegenerateEmbeddings("embedding rows [0, 1] are zero or not finite")
        return {"tar": 0.5}

    coord.evaluator = evaluator
    # Execute
    _drive(coord, 2)
    # Assert: the run stops at round 2, round 1's model stays the run's model, and the sum
    # the server saw in round 2 is composed like a round (epsilon of 2 releases)
    assert coord.status == "aborted"
    assert "round 2: the new global model's held-out embeddings" in coord.stop_reason
    assert "counted in epsilon like a round" in coord.stop_reason
    assert coord.store.latest().round == 1
    assert coord.privacy is not None
    coord.privacy.ledger.close()

    def eps(steps: int) -> float:
        return epsilon_for(
            accountant="pld", noise_multiplier=2.0, sample_rate=1.0, steps=steps, delta=1e-5,
            noise="discrete_gaussian",
        )  # fmt: skip

    with Ledger.read(tmp_path / "ledger.sqlite") as ledger:
        assert ledger.verify().ok
        entries = ledger.entries()
    kinds = [(e.kind, e.round) for e in entries]
    assert kinds == [("client_level", 1), ("discarded_sum", 2), ("note", 2)]
    assert entries[1].payload["epsilon"] == pytest.approx(eps(2), rel=1e-9)
    assert entries[1].payload["updates"] == 3
    aborted = [r for r in RunDir(tmp_path).read_metrics() if r.get("kind") == "aborted"]
    assert [(r["round"], r["attempt"]) for r in aborted] == [(2, 0)]
    assert "held-out embeddings" in aborted[0]["reason"]
    # a restarted server resumes after round 1 with both releases counted
    again = _coordinator(tmp_path, cfg, rounds=3)
    assert again.resume() == 1
    assert again.privacy is not None
    assert again.privacy.epsilon == pytest.approx(eps(2), rel=1e-9)
    again.privacy.ledger.close()


def _noised_before_the_server(tmp_path: Path, placement: str = "local") -> Any:
    cfg = PrivacyConfig(
        unit="client", noise_placement=placement, noise_multiplier=1.5, delta=1e-5,
        secure_rng=False,
    )  # fmt: skip
    return open_server_privacy(
        cfg, tmp_path / "ledger.sqlite", "discard", rounds=5, population=3,
        clients_per_round=0, sample_rate=0.0, source=SeededGaussian(0),
    )  # fmt: skip


def test_a_sum_the_server_saw_and_discarded_is_composed_like_a_round(tmp_path: Path) -> None:
    from fl_secure.app.report.ledger import _epsilon_by_round

    # Prepare: local noise (the guarantee covers the server's view), rounds 1 and 2 done
    first = _noised_before_the_server(tmp_path)
    for r in (1, 2):
        _account(first, r)
    # Execute: round 3's sum is unmasked, then discarded (a faulty client); the run stops,
    # and a restarted server resumes from round 2's checkpoint and runs round 3 again
    assert first.discard_sum(3, 3, 3, 0, "round 3: the sum is corrupted") is True
    first.ledger.close()
    again = _noised_before_the_server(tmp_path)
    again.resume(2, [])
    resumed_epsilon = again.epsilon
    summary = again.summary()
    _account(again, 3)
    again.ledger.close()

    # Assert: the discarded sum counts like a round (zCDP composition of 3,
    # then 4 full-participation Gaussian releases); the rounds accounted stay the rounds run
    def eps(steps: int) -> float:
        return epsilon_for(
            accountant="pld", noise_multiplier=1.5, sample_rate=1.0, steps=steps, delta=1e-5,
            noise="discrete_gaussian",
        )  # fmt: skip

    with Ledger.read(tmp_path / "ledger.sqlite") as ledger:
        assert ledger.verify().ok
        entries = ledger.entries()
    kinds = [(e.kind, e.round) for e in entries]
    assert kinds == [
        ("client_level", 1), ("client_level", 2), ("discarded_sum", 3), ("client_level", 3)
    ]  # fmt: skip
    assert entries[2].payload["epsilon"] == pytest.approx(eps(3), rel=1e-9)
    assert resumed_epsilon == pytest.approx(eps(3), rel=1e-9)
    assert entries[3].payload["epsilon"] == pytest.approx(eps(4), rel=1e-9)
    assert summary["rounds_accounted"] == 2 and summary["discarded_sums_accounted"] == 1
    by_round = _epsilon_by_round(entries)
    assert [r.get("discarded_sum", False) for r in by_round] == [False, False, True, False]
    # central noise trusts the server with the sum: nothing to count
    (tmp_path / "central").mkdir()
    central = _noised_before_the_server(tmp_path / "central", "central")
    assert central.discard_sum(1, 3, 3, 0, "x") is False
    assert central.ledger.entries() == []


def test_an_attempt_in_flight_when_the_server_died_is_counted_at_resume(tmp_path: Path) -> None:
    # Prepare: local noise; round 1 committed; round 2's tasks went out (the marker is
    # written first), and the server process was killed before round 2's ledger entry
    first = _noised_before_the_server(tmp_path)
    first.begin_release(1, 0, 3)
    _account(first, 1)
    assert not first.inflight_path.exists()  # the commit settles the marker
    first.begin_release(2, 0, 3)
    marker = first.inflight_path
    assert marker.exists() and marker.parent == tmp_path
    first.ledger.close()  # (kill -9: nothing else runs)
    # Execute: a restarted server resumes from round 1's checkpoint and runs round 2 again
    again = _noised_before_the_server(tmp_path)
    again.resume(1, [])
    resumed = again.epsilon
    _account(again, 2)
    again.ledger.close()

    # Assert: the attempt in flight counts like a round (the clients released it; the
    # server may have seen it): zCDP composition of 2, then 3 discrete Gaussian releases
    def eps(steps: int) -> float:
        return epsilon_for(
            accountant="pld", noise_multiplier=1.5, sample_rate=1.0, steps=steps, delta=1e-5,
            noise="discrete_gaussian",
        )  # fmt: skip

    with Ledger.read(tmp_path / "ledger.sqlite") as ledger:
        entries = ledger.entries()
    assert [(e.kind, e.round) for e in entries] == [
        ("client_level", 1), ("discarded_sum", 2), ("client_level", 2)
    ]  # fmt: skip
    assert "server process ended" in str(entries[1].payload["message"])
    assert resumed == pytest.approx(eps(2), rel=1e-9)
    assert entries[2].payload["epsilon"] == pytest.approx(eps(3), rel=1e-9)
    assert not marker.exists()
    # a marker of the round the checkpoint already holds is no release to add
    (tmp_path / "done").mkdir()
    done = _noised_before_the_server(tmp_path / "done")
    _account(done, 1)
    done.begin_release(1, 0, 3)  # (killed after the commit, before the marker went)
    done.ledger.close()
    done = _noised_before_the_server(tmp_path / "done")
    done.resume(1, [])
    assert [e.kind for e in done.ledger.entries()] == ["client_level"]
    # a damaged marker is named, not guessed at
    done.begin_release(2, 0, 3)
    done.inflight_path.write_text("{")
    done.ledger.close()
    with pytest.raises(PrivacyError, match="in-flight marker .* is damaged"):
        _noised_before_the_server(tmp_path / "done").resume(1, [])
    # central noise trusts the server with what it sees: no marker
    (tmp_path / "central").mkdir()
    central = _noised_before_the_server(tmp_path / "central", "central")
    central.begin_release(1, 0, 3)
    assert not central.inflight_path.exists()


def test_a_failed_attempt_is_not_counted_again_when_the_retry_dies(tmp_path: Path) -> None:
    # Prepare: local noise, three updates needed; two arrive in attempt 0, which then fails
    # (counted: the server saw them), and the server process dies while attempt 1 waits
    cfg = PrivacyConfig(unit="client", noise_placement="local", noise_multiplier=1.5)
    coord = _coordinator(tmp_path, cfg, rounds=2, round_timeout=1.0)
    for c in CLIENTS:
        coord.join(c, 10)

    class Killed(BaseException):
        pass

    waits = 0
    real_wait = coord.membership.wait_for_clients

    def wait(needed: int) -> list[str]:
        nonlocal waits
        waits += 1
        if waits == 2:
            assert coord.privacy is not None
            killed_with_marker.append(coord.privacy.inflight_path.exists())
            raise Killed
        return real_wait(needed)

    killed_with_marker: list[bool] = []
    coord.membership.wait_for_clients = wait  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def drive() -> None:
        try:
            coord.run()
        except Killed as exc:
            errors.append(exc)

    driver = threading.Thread(target=drive)
    driver.start()
    senders = [threading.Thread(target=_submit, args=(coord, c)) for c in CLIENTS[:2]]
    for s in senders:
        s.start()
    for s in senders:
        s.join(timeout=30)
    driver.join(timeout=30)
    assert errors and killed_with_marker == [False]  # attempt 0 settled before attempt 1
    assert coord.privacy is not None
    coord.privacy.ledger.close()
    # Execute: a restarted server resumes (no checkpoint yet)
    again = _coordinator(tmp_path, cfg, rounds=2)
    assert again.resume() == 0
    assert again.privacy is not None
    again.privacy.ledger.close()
    # Assert: attempt 0's two updates counted once, nothing for the attempt never started
    with Ledger.read(tmp_path / "ledger.sqlite") as ledger:
        rows = [(e.kind, e.round, e.payload.get("attempt")) for e in ledger.entries()]
    assert rows == [("discarded_sum", 1, 0)]


def test_a_stop_after_plain_updates_arrived_counts_them(tmp_path: Path) -> None:
    # Prepare: local noise without secure aggregation: the server sees each update as it
    # arrives; round 1 completes, then two of round 2's three updates arrive
    cfg = PrivacyConfig(unit="client", noise_placement="local", noise_multiplier=1.5)
    coord = _coordinator(tmp_path, cfg, rounds=3)
    for c in CLIENTS:
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    for number, senders in ((1, CLIENTS), (2, CLIENTS[:2])):
        workers = [threading.Thread(target=_submit, args=(coord, c)) for c in senders]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=30)
        if number == 1:
            deadline = time.monotonic() + 30
            while coord.completed_round < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
    # Execute: the run is stopped (a signal) with round 2 half in
    coord.stop("stopped by a signal")
    driver.join(timeout=30)
    assert coord.privacy is not None
    coord.privacy.ledger.close()
    # Assert: the two updates the server saw count like a round; nothing is left in flight
    assert coord.status == "stopped"
    with Ledger.read(tmp_path / "ledger.sqlite") as ledger:
        entries = ledger.entries()
    assert [(e.kind, e.round) for e in entries] == [("client_level", 1), ("discarded_sum", 2)]
    assert entries[1].payload["updates"] == 2
    assert "stopped after the server had received updates" in str(entries[1].payload["message"])
    assert entries[1].payload["epsilon"] == pytest.approx(
        epsilon_for(
            accountant="pld",
            noise_multiplier=1.5,
            sample_rate=1.0,
            steps=2,
            delta=1e-5,
            noise="discrete_gaussian",
        ),  # fmt: skip
        rel=1e-9,
    )
    assert not coord.privacy.inflight_path.exists()


def _example_session(path: Path, rounds: int = 3):
    from privacy.dp.noise import seeded_source

    cfg = PrivacyConfig(unit="example", noise_multiplier=1.0, delta=1e-5)
    return open_server_privacy(
        cfg, path, "run1", rounds=rounds, population=1, clients_per_round=0, sample_rate=0.0,
        source=seeded_source(0, "s"),
    )  # fmt: skip


def test_example_level_epsilon_is_composed_by_the_server_not_taken_from_the_client(
    tmp_path: Path,
) -> None:
    # Prepare: a client whose accountant restarts every round (no --state-dir) reports one
    # round's epsilon each time: 100 steps at z = 1, q = 0.1
    from privacy.ledger.guarantee import ledger_guarantee

    one = epsilon_for(
        accountant="prv", noise_multiplier=1.0, sample_rate=0.1, steps=100, delta=1e-5
    )
    three = epsilon_for(
        accountant="prv", noise_multiplier=1.0, sample_rate=0.1, steps=300, delta=1e-5
    )
    session = _example_session(tmp_path / "ledger.sqlite")
    session.resume(0, [])
    metrics = {"dp_epsilon": one, "dp_steps": 100.0, "dp_noise_multiplier": 1.0,
               "dp_sample_rate": 0.1}  # fmt: skip
    # Execute
    for r in (1, 2, 3):
        session.commit(r, session.round_entries(r, 1, {"A": metrics}))
    # Assert: the ledger states the composition of its own rows (300 steps), which the
    # budget check and the report use; the client's figure is kept beside it
    assert three > 1.5 * one
    assert ledger_guarantee(session.ledger.entries())[0] == pytest.approx(three, rel=1e-6)
    assert session.metrics()["epsilon"] == pytest.approx(three, rel=1e-6)
    last = session.ledger.last("example_level")
    assert last is not None and last.payload["client_reported_epsilon"] == one


def test_example_level_updates_are_averaged_unweighted_whatever_count_they_claim(
    tmp_path: Path,
) -> None:
    # Prepare: one example-level round; the clients send 1, 2 and 3 per coordinate, c2
    # claiming 7 examples (a weighted mean would be (1 + 2 + 21) / 9 = 2.67)
    cfg = PrivacyConfig(unit="example", noise_multiplier=1.0, delta=1e-5)
    coord = _coordinator(tmp_path, cfg, rounds=1)
    metrics = {"dp_epsilon": 0.5, "dp_steps": 10.0, "dp_noise_multiplier": 1.0,
               "dp_sample_rate": 0.1}  # fmt: skip
    # Execute
    _drive(coord, 1, sends={"c0": (1.0, 1), "c1": (2.0, 1), "c2": (3.0, 7)}, metrics=metrics)
    # Assert: under DP the image count is not a weight (one image more or less is the
    # neighbouring data set at the example level): the mean of 1, 2, 3
    assert coord.status == "completed"
    np.testing.assert_array_equal(coord.params["w"], np.full((2, 2), 2.0, np.float32))


@pytest.mark.parametrize(
    ("change", "message", "local_steps"),
    [
        ({"dp_epsilon": None}, "sent no example-level accounting \\(dp_epsilon\\)", 10),
        ({"dp_steps": -3.0}, "dp_steps = -3, expected an integer in 0..10", 10),
        ({"dp_steps": 1e12}, "dp_steps = 1e\\+12, expected an integer in 0..10", 10),
        ({"dp_steps": 2.5}, "dp_steps = 2.5", 10),
        ({"dp_sample_rate": 2.0}, "dp_sample_rate = 2, expected \\[1e-06, 1\\]", 10),
        ({"dp_noise_multiplier": 0.0}, "dp_noise_multiplier = 0, below the 0.05", 10),
        ({"dp_epsilon": float("nan")}, "dp_epsilon not finite", 10),
        # epochs (local_steps 0): 1 / q steps an epoch; a tiny q once overflowed round(1 / q)
        # and a huge step count made the server's accountant exhaust its memory
        ({"dp_sample_rate": 5e-324}, "dp_sample_rate = 4.94066e-324, expected \\[1e-06", 0),
        (
            {"dp_sample_rate": 1e-6, "dp_steps": 1e17},
            "dp_steps = 1e\\+17, expected an integer in 0..100000 ",
            0,
        ),  # fmt: skip
    ],
)
def test_example_level_figures_the_ledger_cannot_take_are_refused_at_upload(
    tmp_path: Path, change: dict[str, float | None], message: str, local_steps: int
) -> None:
    # Prepare: an example-level round; the task asks for 10 local steps (or 1 epoch)
    from fl_secure.errors import ProtocolError

    cfg = PrivacyConfig(unit="example", noise_multiplier=1.0, delta=1e-5)
    training = LocalTraining(local_steps=local_steps, local_epochs=1)
    coord = _coordinator(tmp_path, cfg, rounds=1, training=training)
    metrics = {"dp_epsilon": 0.5, "dp_steps": 10.0, "dp_noise_multiplier": 1.0,
               "dp_sample_rate": 0.1}  # fmt: skip
    for key, value in change.items():
        if value is None:
            del metrics[key]
        else:
            metrics[key] = value
    for c in CLIENTS:
        coord.join(c, 0)
    driver = threading.Thread(target=coord.run)
    driver.start()
    try:
        while (task := coord.poll("c0", 0)).kind is not TaskKind.TRAIN:
            pass
        header = UpdateHeader(task.round, task.nonce, 1, metrics, 1, 16)
        # Execute / Assert: refused before any tensor is read, naming the figure
        with pytest.raises(ProtocolError, match=f"client c0: {message}|c0 {message}"):
            coord.open_upload("c0", header)
    finally:
        coord.stop("test over")
        driver.join(timeout=30)
    # nothing reached the ledger or a checkpoint
    with Ledger.read(tmp_path / "ledger.sqlite") as ledger:
        assert ledger.entries() == []


def test_example_level_resume_refuses_a_ledger_missing_earlier_rounds(tmp_path: Path) -> None:
    # Prepare: three example-level rounds, then the rows of rounds 1-2 deleted and the chain
    # of what remains still valid (here: nothing remains)
    import sqlite3

    path = tmp_path / "ledger.sqlite"
    session = _example_session(path)
    session.resume(0, [])
    metrics = {"dp_epsilon": 1.0, "dp_steps": 100.0, "dp_noise_multiplier": 1.0,
               "dp_sample_rate": 0.1}  # fmt: skip
    rows = []
    for r in (1, 2, 3):
        rows = session.round_entries(r, 1, {"A": metrics})
        session.commit(r, rows)
    session.ledger.close()
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM entries")  # an empty ledger is a valid chain
    # Execute / Assert: the checkpoint's round-3 rows alone do not make a 3-round record
    with pytest.raises(PrivacyError, match=r"no example-level rows of rounds \[1, 2\]"):
        _example_session(path).resume(3, rows)


def test_a_run_stopped_by_its_budget_can_still_resume(tmp_path: Path) -> None:
    # Prepare: client-level DP whose budget stops the run before some round; the stop is a
    # note under the round that never ran; then the server dies before its summary
    from privacy.dp.noise import seeded_source

    cfg = PrivacyConfig(unit="client", noise_multiplier=3.0, target_epsilon=3.0, delta=1e-5)

    def session():
        return open_server_privacy(
            cfg, tmp_path / "ledger.sqlite", "run1", rounds=100, population=10,
            clients_per_round=0, sample_rate=0.0, source=seeded_source(0, "s"),
        )  # fmt: skip

    first = session()
    first.resume(0, [])
    number, rows = 1, []
    while (why := first.budget_stop(number)) is None:
        rows = first.round_entries(number, 10, {f"c{i}": {} for i in range(10)})
        first.commit(number, rows)
        number += 1
    first.note(number, why)
    first.ledger.close()
    # Execute: resume from the last checkpointed round
    again = session()
    again.resume(number - 1, rows)
    # Assert: the note is not taken for a release; the budget still stops the same round
    assert again.epsilon == pytest.approx(first.epsilon)
    assert again.budget_stop(number) == why


def test_fixed_size_cohorts_under_dp_are_drawn_from_the_enrolled_clients(tmp_path: Path) -> None:
    # Prepare: client-level DP, 2 of 4 enrolled per round (fixed size, inclusion 1/2 in the
    # accountant); only c0 and c1 are online
    from privacy.dp.noise import seeded_source

    cfg = PrivacyConfig(unit="client", noise_multiplier=1.0, delta=1e-5)
    enrolled = {"c0", "c1", "c2", "c3"}
    privacy = open_server_privacy(
        cfg, tmp_path / "ledger.sqlite", "run", rounds=1, population=4, clients_per_round=2,
        sample_rate=0.0, source=seeded_source(0, "s"),
    )  # fmt: skip
    assert privacy.plan is not None and privacy.plan.sampling == "fixed_size"
    settings = CoordinatorSettings(rounds=1, min_clients=1, clients_per_round=2)
    coord = Coordinator(
        settings, OrderedDict([("w", np.zeros(2, np.float32))]), enrolled=enrolled,
        run_dir=RunDir(tmp_path), server_step=lambda p, u, r: p, privacy=privacy,
    )  # fmt: skip
    # Execute: many draws with two clients online
    draws = 4000
    counts = dict.fromkeys(sorted(enrolled), 0)
    for _ in range(draws):
        for c in coord.membership.sample_cohort(["c0", "c1"], TaskKind.TRAIN):
            counts[c] += 1
    # Assert: every enrolled client is in about half the cohorts (k / N), online or not;
    # drawing from the online two would put each in every cohort
    for c, n in counts.items():
        assert abs(n / draws - 0.5) < 4 * np.sqrt(0.25 / draws), (c, n)
    # without DP the cohort stays among the online clients
    plain = Coordinator(
        settings, OrderedDict([("w", np.zeros(2, np.float32))]), enrolled=enrolled,
        run_dir=RunDir(tmp_path / "plain"), server_step=lambda p, u, r: p,
    )  # fmt: skip
    assert plain.membership.sample_cohort(["c0", "c1"], TaskKind.TRAIN) == ["c0", "c1"]


def test_an_offline_member_of_a_dp_cohort_drops_out_at_once(tmp_path: Path) -> None:
    # Prepare: 2 of 4 enrolled per round under client-level DP; c2 and c3 never connect
    from privacy.dp.noise import seeded_source

    cfg = PrivacyConfig(unit="client", noise_placement="central", noise_multiplier=1.0)
    privacy = open_server_privacy(
        cfg, tmp_path / "ledger.sqlite", "run", rounds=2, population=4, clients_per_round=2,
        sample_rate=0.0, source=seeded_source(0, "s"),
    )  # fmt: skip
    settings = CoordinatorSettings(
        rounds=2, min_clients=1, clients_per_round=2, round_timeout=1.0, max_retries=8,
        poll_wait=0.05, final_evaluation=False,
    )  # fmt: skip
    coord = Coordinator(
        settings, OrderedDict([("w", np.zeros((2, 2), np.float32))]),
        enrolled={"c0", "c1", "c2", "c3"}, run_dir=RunDir(tmp_path),
        server_step=lambda p, u, r: OrderedDict((k, p[k] + u[k]) for k in p), privacy=privacy,
    )  # fmt: skip
    # the first draw is the two offline clients (a uniform draw does so 1 time in 6; scripted
    # here so that the test never depends on luck), later draws whatever the real sampler draws
    coord.membership._rng = _FirstDrawIs(["c2", "c3"])
    for c in ("c0", "c1"):
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    workers = [threading.Thread(target=answer_every_task, args=(coord, c)) for c in ("c0", "c1")]
    for w in workers:
        w.start()
    driver.join(timeout=60)
    for w in workers:
        w.join(timeout=10)
    # Assert: cohorts drew offline clients too, and those were failed when drawn, not left
    # pending until the round's deadline
    assert coord.status == "completed", coord.stop_reason
    offline = [(c, e["failed"][c]) for e in coord.events for c in e["cohort"] if c in ("c2", "c3")]
    assert {c for c, _ in offline} >= {"c2", "c3"}, offline
    assert all(why == "offline when the cohort was drawn" for _, why in offline)
    rows = [r for r in privacy.ledger.entries() if r.kind == "client_level"]
    assert [r.payload["attempt"] for r in rows] == [
        next(e["attempt"] for e in reversed(coord.events) if e["round"] == r.round) for r in rows
    ]


class _FirstDrawIs:
    """A cohort sampler whose first ``sample`` is ``first``; later draws use the system CSPRNG."""

    def __init__(self, first: list[str]) -> None:
        import secrets

        self.first: list[str] | None = first
        self.rest = secrets.SystemRandom()

    def sample(self, population: list[str], k: int) -> list[str]:
        if self.first is not None:
            first, self.first = self.first, None
            assert len(first) == k and set(first) <= set(population)
            return first
        return self.rest.sample(population, k)
