"""``fl-secure audit`` on tiny synthetic runs: the acceptance of issue 7, run to run.

The non-private runs are made by the in-process simulation (:mod:`fl_secure.app.simulated_run`); the
client-level DP run needs the real path (the simulation refuses DP), so it is a tiny embedded
``fl-secure train`` (server + 3 client processes, plaintext loopback gRPC, central noise,
epsilon 1) of the same config. Every run shares data, plan and seed, so the audit attacks the
same 10 targets with the same judge in every design.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from audits.canary import clopper_pearson_interval
from audits.mechanism import Mechanism, audit_mechanism, mechanism_of_run
from audits.observations import choose_targets, held_heads, load_run, observations
from audits.run_audit import AuditSettings, audit_run, findings, summary_lines, table_rows
from fl_secure.app.cli import main
from fl_secure.app.simulated_run import write_simulated_run
from fl_secure.checkpoints import CheckpointStore
from fl_secure.config import config_from_dict
from fl_secure.errors import CheckpointError, ConfigError
from fl_secure.runs import RunDir
from privacy.dp.calibration import calibrate_noise

TINY = """
[run]
name = "audit-{algorithm}"
seed = 0
[data]
source = "synthetic"
image_size = 32
num_identities = 36
images_per_identity = 12
held_out_identities = 12
test_fraction = 0.25
[partition]
kind = "equal"
num_clients = 3
[model]
backbone = "cnn-small"
embedding_size = 64
head = "cosface"
scale = 30.0
margin = 0.35
[algorithm]
name = "{algorithm}"
[train]
rounds = 8
local_epochs = 2
batch_size = 16
optimizer = "adam"
lr = 0.003
lr_schedule = "cosine"
[server]
min_clients = 3
round_timeout = 120.0
"""

DP = """
[privacy]
unit = "client"
noise_placement = "central"
clip_norm = 1.0
target_epsilon = 1.0
delta = 1e-5
secure_rng = false
"""

SETTINGS = AuditSettings(targets=10, steps=200)


def _audited(base: Path, algorithm: str) -> dict[str, Any]:
    config = config_from_dict(tomllib.loads(TINY.format(algorithm=algorithm)))
    return audit_run(write_simulated_run(config, base), SETTINGS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    base = tmp_path_factory.mktemp("audit-runs")
    return {a: _audited(base, a) for a in ("fedavg", "fedpe", "fedgc")}


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("audit-dp")
    path = base / "dp.toml"
    path.write_text(TINY.format(algorithm="fedavg") + DP)
    done = subprocess.run(
        [sys.executable, "-m", "fl_secure.app.cli", "train", "--config", str(path),
         "--out", str(base / "runs"), "--insecure", "--json", "--quiet"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = Path(json.loads(done.stdout.strip().splitlines()[-1])["run_dir"])
    return audit_run(run_dir, SETTINGS)


def _best(results: dict[str, Any], party: str) -> dict[str, Any]:
    view = results["attacks"]["inversion"][party]
    best: dict[str, Any] = view[view["best"]]
    return best


def test_global_head_reconstructions_are_identified(runs: dict[str, dict[str, Any]]) -> None:
    results = runs["fedavg"]
    server = results["attacks"]["inversion"]["server"]
    assert server["best"] == "head_row"  # the view holds every target's class embedding
    best = server["head_row"]
    assert best["chance_top1"] == pytest.approx(0.1)
    assert best["top1"] >= 5 * best["chance_top1"]  # measured 0.8 (8x chance)
    assert best["top1_ci95"][0] > best["chance_top1"]  # not luck: 95% interval above chance
    # the faces are closer to their own target than to the others (measured 0.45 vs 1.35)
    assert best["knn_distance"] < best["chance_knn_distance"]
    assert best["ssim"] > best["chance_ssim"]
    # the curious client holds the same global model and head: the same attack and result
    assert _best(results, "curious_client")["top1"] == best["top1"]
    templates = results["attacks"]["templates"]["server"]
    assert templates["top1"] >= 0.8  # measured 0.9; chance 0.1
    run = Path(results["run"])
    assert json.loads((run / "audit" / "results.json").read_text()) == results
    assert (run / "audit" / best["grid"]).stat().st_size > 1000  # synthetic faces: grid written
    assert results["exposure"] == "global-head" and results["targets"]["count"] == 10
    assert "honest-but-curious" in results["threat_model"]["server"]


def test_private_embeddings_leave_only_surrogates_near_chance(
    runs: dict[str, dict[str, Any]],
) -> None:
    results = runs["fedpe"]
    for party in ("server", "curious_client"):
        view = results["attacks"]["inversion"][party]
        assert "head_row" not in view
        for surrogate in ("surrogate_public_mean", "surrogate_random"):
            assert view[surrogate]["top1"] <= 2 * view[surrogate]["chance_top1"]  # measured 0.2
            # no nearer its target than the other targets (measured within 0.08; a global
            # head's row gets 0.9 nearer)
            gap = abs(view[surrogate]["knn_distance"] - view[surrogate]["chance_knn_distance"])
            assert gap < 0.25
        assert results["attacks"]["templates"][party]["applicable"] is False
    assert all(v["head_rows_of_targets"] == 0 for v in results["views"])
    # ... and so no inversion or template finding; one client's update still gives its input
    # away to the server that sees it (no secure aggregation in this run)
    codes = {f["code"] for f in findings(results)}
    assert codes == {"audit-update-leaks"}
    flagged = {f["code"] for f in findings(runs["fedavg"])}
    assert {"audit-inversion-identifies", "audit-templates-identify"} <= flagged
    # the head-row attack on the global-head run beats every surrogate here
    fedavg_best = _best(runs["fedavg"], "server")
    assert fedavg_best["knn_distance"] < _best(results, "server")["knn_distance"]


def test_fedgc_server_view_is_attacked_with_its_copy_of_the_heads(
    runs: dict[str, dict[str, Any]],
) -> None:
    results = runs["fedgc"]
    server = results["attacks"]["inversion"]["server"]
    curious = results["attacks"]["inversion"]["curious_client"]
    assert server["best"] == "head_row"
    assert "server's copy" in server["head_row"]["target_direction"]
    assert "head_row" not in curious  # heads go back to their owner only
    # reported as measured; measured 0.8 for the server vs 0.2 for the curious client
    assert server["head_row"]["top1"] > _best(results, "curious_client")["top1"]
    views = {v["party"]: v for v in results["views"]}
    assert views["server"]["head_rows_of_targets"] == 10
    assert views["curious_client"]["head_rows_of_targets"] == 0


def test_leakage_single_client_update_exact_and_the_sum_spans_the_inputs(
    runs: dict[str, dict[str, Any]],
) -> None:
    leak = runs["fedpe"]["attacks"]["leakage"]["server"]
    single = leak["single_client_one_image"]
    assert single["clients"] == 3
    assert single["mean_one_minus_cosine_to_truth"] < 1e-5  # exact up to float error
    assert single["top1"] > single["chance"]  # measured 0.67-1.00 vs 1/24
    assert single["top1_ci95"] == list(clopper_pearson_interval(round(single["top1"] * 3), 3))
    summed = leak["secure_sum_one_image_each"]
    # A sum does not hide its inputs: a class row is dominated by the one client whose
    # identity it is (the others' softmax terms on it are small), so the row gives that
    # input away (measured cosine 0.997 here, 0.9999 on a FedAvg SecAgg run)
    assert 0.9 < summed["max_cosine_to_a_single_input"] <= 1.0 + 1e-6
    # The sum of three one-image updates has rank 3: its row space is their span
    assert summed["rank"] == summed["images"] == 3
    assert summed["participant_precision"] == max(summed["by_attack"].values())
    assert 0.0 <= summed["exact_inputs"] <= 1.0
    per_client = leak["single_client_batch_16"]  # one client's batch: both attacks
    assert per_client["participant_precision"] == max(per_client["by_attack"].values())
    batch = leak["secure_sum_batch_16"]  # flagged when every identity took part
    assert ("uninformative" in batch) == (batch["chance"] == 1.0)
    assert runs["fedpe"]["attacks"]["leakage"]["curious_client"]["applicable"] is False


def test_canary_non_private_run_gives_a_clear_lower_bound(
    runs: dict[str, dict[str, Any]],
) -> None:
    canary = runs["fedavg"]["attacks"]["canary"]
    assert canary["accountant_epsilon"] is None
    assert canary["at_audit_cap"] is True  # said as such: a larger audit could show more
    assert canary["epsilon_lower_bound"] == canary["clopper_pearson"]["max_epsilon_lower_bound"]
    # the cap of 500 + 500 error-free trials when each of the two bounds is taken at alpha/2
    # = 0.025 (the larger of the two then holds at 95%), each error rate bounded at 0.0125:
    # ln((1 - delta - p) / p) with p = 1 - 0.0125 ** (1 / 500)
    p = 1 - 0.0125 ** (1 / 500)
    cap = math.log((1 - 1e-5 - p) / p)
    assert canary["epsilon_lower_bound"] == pytest.approx(cap, rel=1e-6)  # 4.733
    assert any("the most this audit's size can show" in x for x in summary_lines(runs["fedavg"]))
    assert canary["one_run"]["correct"] == canary["one_run"]["guesses"] == 200


def test_client_level_dp_lowers_global_head_success_and_stays_under_the_accountant(
    runs: dict[str, dict[str, Any]], dp_run: dict[str, Any]
) -> None:
    assert dp_run["privacy_unit"] == "client" and dp_run["epsilon"] <= 1.0
    private = _best(dp_run, "server")
    plain = _best(runs["fedavg"], "server")
    assert dp_run["targets"]["identities"] == runs["fedavg"]["targets"]["identities"]
    assert private["top1"] < plain["top1"]  # measured 0.2 vs 0.8
    assert private["top1"] <= 3 * private["chance_top1"]
    canary = dp_run["attacks"]["canary"]
    assert canary["mechanism"]["noise_placement"] == "central"
    assert canary["mechanism"]["noise_multiplier"] > 5  # calibrated for epsilon 1 in 8 rounds
    assert canary["epsilon_lower_bound"] <= canary["accountant_epsilon"]  # measured 0.24
    assert canary["exceeds_accountant"] is False and canary["at_audit_cap"] is False
    assert "audit-exceeds-accountant" not in {f["code"] for f in findings(dp_run)}
    # were the bound above the accountant's, the audit would say the guarantee is broken
    broken = {**dp_run, "attacks": {"canary": {**canary, "exceeds_accountant": True}}}
    (finding,) = findings(broken)
    assert finding["code"] == "audit-exceeds-accountant"
    assert f"{canary['accountant_epsilon']:.3f}" in finding["message"]
    rows = table_rows(dp_run)
    assert {r["party"] for r in rows} == {"server", "curious_client"}


@pytest.mark.parametrize("placement", ["central", "distributed", "local"])
@pytest.mark.parametrize("epsilon", [1.0, 8.0])
def test_mechanism_audit_never_exceeds_the_accountant(placement: str, epsilon: float) -> None:
    z = calibrate_noise(target_epsilon=epsilon, sample_rate=1.0, steps=8, delta=1e-5)
    mech = Mechanism(z, 1.0, 3.0, placement, 8, 1.0, 3, 3, 1e-5, epsilon)
    found = audit_mechanism(mech, seed=1)
    assert found["epsilon_lower_bound"] <= epsilon
    if epsilon == 8.0 and placement != "local":  # local noise is sqrt(3) x what is accounted
        assert found["epsilon_lower_bound"] > 1.0  # the audit is not vacuous (measured 3.2-3.4)
    # 1000 trials can show at most 4.73: epsilon 1 is tested, epsilon 8 cannot be, and the
    # audit says so instead of "not exceeded"
    assert found["can_test_accountant"] is (epsilon == 1.0)
    assert found["exceeds_accountant"] is (False if epsilon == 1.0 else None)


def test_a_mechanism_with_less_noise_than_it_claims_is_flagged() -> None:
    # Prepare: the noise of epsilon 1, divided by 4 (a broken mechanism claiming epsilon 1)
    z = calibrate_noise(target_epsilon=1.0, sample_rate=1.0, steps=8, delta=1e-5)
    mech = Mechanism(z / 4, 1.0, 3.0, "central", 8, 1.0, 0, 3, 1e-5, 1.0)
    # Execute
    found = audit_mechanism(mech, seed=1)
    # Assert: the bound passes the claim (measured 1.8), and the finding says so
    assert found["can_test_accountant"] is True and found["exceeds_accountant"] is True
    assert found["epsilon_lower_bound"] > 1.0
    codes = {f["code"] for f in findings({"attacks": {"canary": found}})}
    assert codes == {"audit-exceeds-accountant"}


def test_the_audit_sizes_itself_to_test_the_claim() -> None:
    from audits.mechanism import MAX_AUTO_TRIALS, audit_size, trials_to_test

    # Prepare: claims of epsilon 8 (one round), 1 and none; one of 12
    z = calibrate_noise(target_epsilon=8.0, sample_rate=1.0, steps=1, delta=1e-5)
    eight = Mechanism(z, 1.0, 3.0, "central", 1, 1.0, 0, 3, 1e-5, 8.0)
    # Execute / Assert: 1.25 x the fewest trials that can show more than 8 (26130)
    n = audit_size(eight)
    assert n == 32_664 and n > trials_to_test(8.0, 1e-5, 0.025) == 26_130
    assert audit_mechanism(eight, canaries=n, trials=n, seed=3)["can_test_accountant"] is True
    assert audit_size(dataclasses.replace(eight, accountant_epsilon=1.0)) == 1000
    assert audit_size(dataclasses.replace(eight, accountant_epsilon=None)) == 1000
    # no audit up to the cap can test 12: the cap, and the audit says it cannot test
    twelve = dataclasses.replace(eight, accountant_epsilon=12.0)
    assert audit_size(twelve) == MAX_AUTO_TRIALS
    capped = audit_mechanism(twelve, canaries=MAX_AUTO_TRIALS, trials=MAX_AUTO_TRIALS, seed=3)
    assert capped["can_test_accountant"] is False
    assert capped["largest_bound_this_audit_can_show"] == pytest.approx(8.83, abs=0.01)


def test_an_audit_sized_for_epsilon_8_can_refute_a_mechanism_without_noise() -> None:
    from audits.mechanism import trials_to_test

    # Prepare: a claim of epsilon 8 (one round) that 1000 trials cannot test; the size the
    # audit names
    z = calibrate_noise(target_epsilon=8.0, sample_rate=1.0, steps=1, delta=1e-5)
    honest = Mechanism(z, 1.0, 3.0, "central", 1, 1.0, 0, 3, 1e-5, 8.0)
    small = audit_mechanism(honest, seed=1)
    assert small["can_test_accountant"] is False and small["trials_to_test_accountant"] > 20_000
    (finding,) = findings({"attacks": {"canary": small}})
    assert finding["code"] == "audit-cannot-test-accountant"
    assert f"--canary-trials {small['trials_to_test_accountant']}" in finding["message"]
    n = trials_to_test(8.0, 1e-5, 0.025)
    assert n == small["trials_to_test_accountant"]
    # Execute: that many trials, on the honest mechanism and on one with almost no noise
    fair = audit_mechanism(honest, canaries=n, trials=n, seed=2)
    broken = audit_mechanism(dataclasses.replace(honest, noise_multiplier=z / 1000), canaries=n,
                             trials=n, seed=2)  # fmt: skip
    # Assert: the sized audit can test the claim; it passes the honest mechanism and refutes
    # the broken one
    assert fair["can_test_accountant"] is True and fair["exceeds_accountant"] is False
    assert fair["trials_to_test_accountant"] is None
    assert fair["trials_to_test_accountant_more_than"] is None
    assert small["trials_to_test_accountant_more_than"] is None
    assert broken["exceeds_accountant"] is True and broken["epsilon_lower_bound"] > 8.0


def test_the_trials_that_test_a_claim_follow_the_closed_form_of_a_perfect_attack() -> None:
    from audits.mechanism import _perfect_bound, perfect_attack_epsilon, trials_to_test

    # the closed form 1 - (alpha / 2) ** (1 / h) is the exact Clopper-Pearson bound
    for n in (2, 14, 1000, 26_130, 60_000, 1_000_000):
        assert perfect_attack_epsilon(n, 1e-5, 0.025) == pytest.approx(
            _perfect_bound(n, 1e-5, 0.025), rel=1e-12, abs=1e-12
        )
    # the fewest: n trials can show more than epsilon, n - 2 cannot, far beyond 2^63 / 2
    for epsilon in (0.5, 8.0, 20.0, 25.0):
        n = trials_to_test(epsilon, 1e-5, 0.025)
        assert n is not None and n % 2 == 0
        assert perfect_attack_epsilon(n, 1e-5, 0.025) > epsilon
        assert perfect_attack_epsilon(n - 2, 1e-5, 0.025) <= epsilon
    assert trials_to_test(20.0, 1e-5, 0.025) == 4_252_056_142  # (as the doubling search found)
    # 10^12 trials show at most 25.46: a larger claim, or an infinite one, names no count
    assert perfect_attack_epsilon(1e12, 1e-5, 0.025) == pytest.approx(25.46, abs=0.01)
    for epsilon in (26.0, 42.5, 54.4, math.inf):
        assert trials_to_test(epsilon, 1e-5, 0.025) is None
    assert trials_to_test(12.0, 1e-5, 0.025, limit=1_000_000) is None  # needs 1,426,412


@pytest.mark.parametrize("epsilon", [54.38, math.inf])
def test_a_claim_no_practical_audit_can_test_is_reported_not_a_crash(epsilon: float) -> None:
    from audits.mechanism import MAX_TRIALS_TO_TEST

    # Prepare: z 0.2 over 2 rounds, the accountant's epsilon 54.4 (PLD), or no bound at all
    summary = _summary("central", "none", 0.2, epsilon) | {"rounds_completed": 2}
    mech = mechanism_of_run(summary, num_clients=3, min_clients=3, rounds=2)
    # Execute
    found = audit_mechanism(mech, canaries=1000, trials=1000, seed=0)
    # Assert: the audit cannot test it and says that no audit up to the limit can
    assert found["can_test_accountant"] is False and found["exceeds_accountant"] is None
    assert found["trials_to_test_accountant"] is None
    assert found["trials_to_test_accountant_more_than"] == MAX_TRIALS_TO_TEST == 10**12
    (finding,) = findings({"attacks": {"canary": found}})
    assert finding["code"] == "audit-cannot-test-accountant"
    assert "--canary-trials" not in finding["message"]
    if math.isfinite(epsilon):
        assert "no audit of up to 1,000,000,000,000 trials can" in finding["message"]
    else:
        assert "no audit can: an infinite epsilon bounds nothing" in finding["message"]
    assert any(line.startswith("finding [audit-cannot") for line in summary_lines(
        {"attacks": {"canary": found}}
    ))  # fmt: skip


@pytest.mark.parametrize(("placement", "honest"), [("central", 0), ("distributed", 3)])
def test_under_client_sampling_the_one_run_audit_ranks_by_the_likelihood_ratio(
    placement: str, honest: int
) -> None:
    import torch

    from audits.canary import one_run_audit
    from audits.mechanism import canary_scores

    # Prepare: epsilon 8 over 200 rounds at q = 0.02 (each round's ratio is a mixture)
    z = calibrate_noise(target_epsilon=8.0, sample_rate=0.02, steps=200, delta=1e-5)
    mech = Mechanism(z, 1.0, 3.0, placement, 200, 0.02, honest, 3, 1e-5, 8.0)
    for seed in range(3):
        included = np.random.default_rng(seed).random(1000) < 0.5
        bounds = []
        # Execute: the same releases, scored by their sum and by the log-likelihood ratio
        for mixture in (False, True):
            scores, _ = canary_scores(mech, included, seed=seed + 10, mixture=mixture)
            bound = one_run_audit(torch.from_numpy(scores), torch.from_numpy(included),
                                  k_plus=100, k_minus=100, delta=1e-5, alpha=0.025)  # fmt: skip
            bounds.append(bound.epsilon)
        # Assert: the ratio's bound is well above the sum's (measured 1.18-1.37 against
        # 0.36-0.75), and still below the accountant's
        assert bounds[1] > bounds[0] + 0.3 and bounds[1] <= 8.0, bounds


@pytest.mark.parametrize("placement", ["central", "distributed", "local"])
def test_canaries_built_one_at_a_time_release_exactly_the_dense_batch(placement: str) -> None:
    from audits.mechanism import OneHotCanaries, release_round
    from privacy.dp.noise import SeededGaussian

    # Prepare: 40 of 300 coordinates carry a canary of norm 2C
    mech = Mechanism(1.3, 1.0, 5.0, placement, 1, 1.0, 3, 3, 1e-5, 3.0)
    rows = np.sort(np.random.default_rng(0).choice(300, 40, replace=False))
    dense = np.zeros((40, 300))
    dense[np.arange(40), rows] = 2.0
    # Execute
    lazy = release_round(mech, OneHotCanaries(rows, 300, 2.0), SeededGaussian(5))
    eager = release_round(mech, dense, SeededGaussian(5))
    # Assert: bit-identical releases (the same updates, in the same order, same noise)
    np.testing.assert_array_equal(lazy, eager)


def test_a_central_noise_round_without_a_sampled_canary_still_releases() -> None:
    from audits.mechanism import release_round
    from privacy.dp.noise import SeededGaussian

    # central noise: no honest noise shares (honest_clients 0), and no canary this round
    mech = Mechanism(1.0, 1.0, 5.0, "central", 1, 0.005, 0, 3, 1e-5, 3.0)
    out = release_round(mech, np.zeros((0, 4000)), SeededGaussian(0))
    assert out.shape == (4000,)
    assert np.std(out) == pytest.approx(1.0 * 1.0 / 5.0, rel=0.05)  # z C / W


def test_cli_audit_writes_json(runs: dict[str, dict[str, Any]], capsys) -> None:
    run = runs["fedgc"]["run"]
    grids = sorted(p.name for p in (Path(run) / "audit").glob("*.png"))
    assert grids, "the full audit wrote inversion grids"
    code = main(["audit", "--run", run, "--attack", "templates,canary", "--json", "--quiet"])
    assert code == 0
    # results.json now holds no inversion: its grids went with the results they belonged to
    assert sorted((Path(run) / "audit").glob("*.png")) == []
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(printed["attacks"]) == {"templates", "canary"}
    assert printed["attacks"]["templates"]["server"]["top1"] >= 0.5  # FedGC's server: templates
    assert main(["audit", "--run", run, "--attack", "pixels"]) == 2
    with pytest.raises(ConfigError):
        AuditSettings(targets=1)


def test_cli_audit_prints_every_attack_beside_chance(
    runs: dict[str, dict[str, Any]], capsys
) -> None:
    run = runs["fedavg"]["run"]
    assert main(["audit", "--run", run, "--attack", "templates,leakage", "--quiet"]) == 0
    out = capsys.readouterr().out
    saved = json.loads((Path(run) / "audit" / "results.json").read_text())
    templates = saved["attacks"]["templates"]["server"]
    low, high = templates["top1_ci95"]
    assert (
        f"server: head templates identified, top-1 {templates['top1']:.2f} [{low:.2f}, "
        f"{high:.2f}] (chance {templates['chance']:.2f})" in out
    )
    assert "finding [audit-templates-identify]: The class embeddings" in out
    summed = saved["attacks"]["leakage"]["server"]["secure_sum_one_image_each"]
    assert "sum of 3 one-image updates (rank 3) -> participants named " in out
    exact, chance = summed["exact_inputs"], summed["chance"]
    assert f"from the exact inputs {exact:.2f}; chance {chance:.2f})" in out
    assert "curious_client: update leakage: this party receives no client's update" in out
    assert out.index("server: head") < out.index("curious_client: head")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--targets", "1"], "--targets = 1: need --targets >= 2"),
        (["--steps", "0"], "--steps = 0: need --steps >= 1"),
        (["--seed", "-1"], "--seed = -1: need --seed >= 0"),
        (["--attack", ","], "--attack names no attack; allowed: inversion, templates, leakage"),
        (["--attack", "pixels,canary,gan"], "unknown attack gan, pixels; allowed: inversion"),
    ],
)
def test_audit_settings_name_the_value_that_is_wrong(
    args: list[str], message: str, tmp_path: Path, capsys
) -> None:
    assert main(["audit", "--run", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_audit_refuses_a_run_another_process_holds(
    runs: dict[str, dict[str, Any]], capsys
) -> None:
    # Prepare: a server (here: this process) holds the audited run while training it
    from fl_secure.runs import RunDir

    run = RunDir(Path(runs["fedpe"]["run"]))
    before = (run.path / "audit" / "results.json").read_bytes()
    # Execute
    with run.held():
        code = main(["audit", "--run", str(run.path), "--attack", "templates", "--quiet"])
        err = capsys.readouterr().err
    # Assert: refused with the holder's pid, the earlier results untouched; once the run is
    # free the audit runs
    assert code == 2 and f"is in use by another fl-secure process (pid {os.getpid()})" in err
    assert (run.path / "audit" / "results.json").read_bytes() == before
    assert main(["audit", "--run", str(run.path), "--attack", "templates", "--quiet"]) == 0


def test_an_audit_of_a_folder_that_is_not_a_run_leaves_no_lock_file(tmp_path: Path, capsys) -> None:
    assert main(["audit", "--run", str(tmp_path), "--quiet"]) == 2
    assert "is not a run directory (no config.toml)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _trained_already(run: Path, monkeypatch, tmp_path: Path) -> str:
    """A config for `train` whose training returns ``run`` (no second training); its path."""
    config = tmp_path / "config.toml"
    config.write_text(TINY.format(algorithm="fedavg"))
    trained = SimpleNamespace(summary=json.loads((run / "summary.json").read_text()), run_dir=run)
    monkeypatch.setattr("server.embedded.run_embedded", lambda *a, **k: trained)
    return str(config)


def test_train_with_audit_prints_what_audit_prints(
    runs: dict[str, dict[str, Any]], capsys, monkeypatch, tmp_path: Path
) -> None:
    # Prepare: `train --audit` whose training returns an existing run (no second training).
    run = Path(runs["fedavg"]["run"])
    config = _trained_already(run, monkeypatch, tmp_path)
    # Execute
    assert main(["train", "--config", config, "--audit"]) == 0
    # Assert: every line of the audit's summary, from the results it wrote
    out = capsys.readouterr().out
    lines = summary_lines(json.loads((run / "audit" / "results.json").read_text()))
    assert len(lines) >= 6  # inversion x 2 parties, templates, leakage, canary
    for line in lines:
        assert line in out


def test_train_with_audit_and_report_in_json_mode_runs_both(
    runs: dict[str, dict[str, Any]], capsys, monkeypatch, tmp_path: Path
) -> None:
    # Prepare: as above, `train --audit --report --json` on an existing run; with --json the
    # audit and report used to be skipped without a word
    run = Path(runs["fedavg"]["run"])
    config = _trained_already(run, monkeypatch, tmp_path)
    # Execute
    assert main(["train", "--config", config, "--audit", "--report", "--json", "--quiet"]) == 0
    # Assert: one JSON object naming what the audit and report wrote, with the findings
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    printed = json.loads(lines[0])
    results = json.loads(Path(printed["audit"]).read_text())
    assert printed["audit_findings"] == findings(results)
    assert "audit-templates-identify" in {f["code"] for f in printed["audit_findings"]}
    assert Path(printed["report"]).name == "report.html" and Path(printed["report"]).is_file()
    assert printed["run_dir"] == str(run)
    # the pooled baseline has nobody to attack: refused by name, before training
    assert main(["train", "--config", config, "--centralized", "--audit"]) == 2
    assert "--audit needs a federated run" in capsys.readouterr().err


def test_a_fedaffect_run_is_refused_by_name_before_any_work(tmp_path: Path, capsys) -> None:
    # Prepare: a run directory whose config names FedAffect (no identity head to attack);
    # it is audited, trained with --audit, and resumed with --audit.
    config = (Path(__file__).parents[2] / "examples" / "fedaffect.toml").read_text()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text(config)
    (tmp_path / "config.toml").write_text(config)

    # Execute
    audited = main(["audit", "--run", str(tmp_path / "run")])
    audit_err = capsys.readouterr().err
    trained = main(["train", "--config", str(tmp_path / "config.toml"), "--audit",
                    "--out", str(tmp_path / "out")])  # fmt: skip
    train_err = capsys.readouterr().err
    resumed = main(["train", "--resume", str(tmp_path / "run"), "--audit"])
    resume_err = capsys.readouterr().err

    # Assert: exit 2, the algorithm named, nothing trained or written.
    assert audited == 2 and trained == 2 and resumed == 2
    for err in (audit_err, train_err, resume_err):
        assert "does not support algorithm.name = 'fedaffect'" in err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.toml"]


# ------------------------------------------------- whose heads the server holds (FedGC)


@pytest.fixture(scope="module")
def fedgc_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-round simulated FedGC run: the server holds every client's head."""
    config = config_from_dict(tomllib.loads(TINY.format(algorithm="fedgc")))
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, rounds=1))
    return write_simulated_run(config, tmp_path_factory.mktemp("fedgc"))


def _copy_with_heads(
    run: Path, dest: Path, heads: Callable[[dict[str, Any]], dict[str, Any]]
) -> Path:
    """``run`` copied to ``dest`` with its final checkpoint's client heads replaced."""
    shutil.copytree(run, dest)
    store = CheckpointStore(RunDir(dest).checkpoints)
    last = store.latest()
    assert last is not None and last.client_tensors
    store.save(last.round, last.parameters, {"status": "completed"},
               client_tensors=heads(last.client_tensors))  # fmt: skip
    return dest


def _copy_with_summary(run: Path, dest: Path, **changes: Any) -> Path:
    """``run`` copied to ``dest`` with keys of its summary.json set (``None``: removed)."""
    shutil.copytree(run, dest)
    summary = json.loads((dest / "summary.json").read_text())
    for key, value in changes.items():
        if value is None:
            summary.pop(key, None)
        else:
            summary[key] = value
    (dest / "summary.json").write_text(json.dumps(summary))
    return dest


def test_the_summary_pairs_each_client_id_with_its_share_of_the_plan(fedgc_run: Path) -> None:
    run = load_run(fedgc_run)
    assert run.summary["client_plan"] == {"client-0": 0, "client-1": 1, "client-2": 2}
    assert run.client_ids == ["client-0", "client-1", "client-2"]
    assert held_heads(run) == [0, 1, 2]


def test_heads_of_clients_the_run_does_not_pair_with_a_share_are_refused(
    fedgc_run: Path, tmp_path: Path
) -> None:
    renamed = _copy_with_heads(
        fedgc_run, tmp_path / "renamed", lambda h: {f"site-{c}": t for c, t in h.items()}
    )
    with pytest.raises(CheckpointError, match=r"heads of clients \['site-client-0'.*cannot tell"):
        load_run(renamed)


def test_targets_come_from_the_clients_whose_heads_the_server_holds(
    fedgc_run: Path, tmp_path: Path
) -> None:
    # Prepare: client-2 was never sampled, so the server holds no head of it
    partial = _copy_with_heads(
        fedgc_run, tmp_path / "partial", lambda h: {c: t for c, t in h.items() if c != "client-2"}
    )
    run = load_run(partial)
    # Execute
    targets = choose_targets(run, 10)
    server = observations(run, targets)[0]
    # Assert: every target is client-1's, and the server's view holds each one's row
    assert held_heads(run) == [0, 1]
    assert all(run.owner(t) == 1 for t in targets)
    assert sorted(server.head_rows) == targets
    full = load_run(fedgc_run)
    assert {full.owner(t) for t in choose_targets(full, 10)} == {1, 2}


def test_an_identity_split_over_sites_by_its_attributes_is_one_target(tmp_path: Path) -> None:
    import torch

    from audits.run_audit import target_data

    # Prepare: an attribute partition splits identities by per-image attributes, so clients
    # 1 (hat=0) and 2 (hat=1 & glasses=0) hold images of the same identities
    raw = tomllib.loads(TINY.format(algorithm="fedavg"))
    raw["partition"] = {
        "kind": "attribute",
        "num_clients": 3,
        "clients": ["glasses=1 & hat=1", "hat=0", "hat=1 & glasses=0"],
    }
    raw["train"] |= {"rounds": 1, "local_epochs": 1}  # fmt: skip
    run = load_run(write_simulated_run(config_from_dict(raw), tmp_path))
    own = set(run.client_identities(0).tolist())
    shared = set(run.client_identities(1).tolist()) & set(run.client_identities(2).tolist())
    assert {6, 7, 8} <= shared - own
    # Execute
    targets = choose_targets(run, 6)
    tg = target_data(run, targets)
    # Assert: round-robin over [5, 6, 7, 8, 9, ...] and [6, 7, 8, 16, ...], each identity
    # once; every target is a label with images of it, all of them
    assert targets == [5, 6, 7, 8, 9, 16]
    assert torch.bincount(tg.private.labels, minlength=6).min() > 0
    assert len(tg.private) == sum(
        int(np.isin(c.train.labels.numpy(), targets).sum()) for c in run.plan.clients
    )
    assert sorted(set(tg.gallery.labels.tolist())) == list(range(6))
    found = audit_run(run.path, AuditSettings(attacks=("templates",), targets=6))
    assert found["targets"]["identities"] == targets
    # a repeated target is refused by name instead of leaving a label without images
    with pytest.raises(ValueError, match=r"target identities \[6\] are named more than once"):
        target_data(run, [5, 6, 6, 9])


def test_a_head_whose_rows_do_not_fit_its_clients_share_is_refused(
    fedgc_run: Path, tmp_path: Path
) -> None:
    def one_row_short(heads: dict[str, Any]) -> dict[str, Any]:
        return {
            c: {n: (a[:-1] if c == "client-1" else a) for n, a in t.items()}
            for c, t in heads.items()
        }

    short = _copy_with_heads(fedgc_run, tmp_path / "short", one_row_short)
    with pytest.raises(CheckpointError, match=r"client-1's head has \d+ rows, .*share 1"):
        held_heads(load_run(short))


def test_a_run_that_does_not_pair_clients_with_shares_is_refused(
    fedgc_run: Path, tmp_path: Path
) -> None:
    # a standalone fl-secure server: sites name themselves, may hold their own data
    standalone = _copy_with_summary(
        fedgc_run, tmp_path / "standalone", client_plan=None, client_train_sizes=None
    )
    with pytest.raises(CheckpointError, match="does not record which client trained on which"):
        load_run(standalone)
    # written before client_plan was recorded, by an embedded run: the plan's ids
    older = _copy_with_summary(fedgc_run, tmp_path / "older", client_plan=None)
    assert load_run(older).client_ids == ["client-0", "client-1", "client-2"]


def _summary(placement: str, scheme: str, z: float, epsilon: float) -> dict[str, Any]:
    return {
        "privacy_unit": "client",
        "noise_placement": placement,
        "epsilon": epsilon,
        "delta": 1e-5,
        "rounds_completed": 8,
        "privacy": {"noise_multiplier": z, "clip_norm": 1.0, "aggregate_denominator": 3.0},
        "secure_aggregation": {"scheme": scheme},
    }


@pytest.mark.parametrize(
    ("placement", "scheme", "contributors"),
    [("local", "none", 1), ("local", "secagg", 3), ("distributed", "secagg+", 3),
     ("central", "none", 0)],
)  # fmt: skip
def test_canaries_face_the_noise_of_the_fewest_honest_clients_a_round_has(
    placement: str, scheme: str, contributors: int
) -> None:
    # Prepare: 10 enrolled clients, rounds of at least 3
    z = calibrate_noise(target_epsilon=8.0, sample_rate=1.0, steps=8, delta=1e-5)
    summary = _summary(placement, scheme, z, 8.0)
    # Execute
    mech = mechanism_of_run(summary, num_clients=10, min_clients=3, rounds=8)
    found = audit_mechanism(mech, seed=1)
    # Assert: noise shares of the fewest honest clients, not of all 10 enrolled ones
    assert mech.honest_clients == contributors
    assert found["epsilon_lower_bound"] <= 8.0
    if contributors <= 1 or placement == "distributed":  # z C on the canary, as accounted
        assert found["epsilon_lower_bound"] > 1.0  # not vacuous (10 shares gave 0.3)


@pytest.mark.parametrize(
    ("encrypted", "contributors"),
    [(["backbone.embedding"], 1), (["backbone.stages", "head"], 1), ("all", 3), (None, 3)],
)  # fmt: skip
def test_a_ckks_run_that_encrypts_some_layers_shows_each_clients_noise_share_alone(
    encrypted: Any, contributors: int
) -> None:
    from audits.mechanism import release_std

    # Prepare: local noise under CKKS; ckks_layers encrypts a subset (or every layer: "all",
    # or a summary written without encrypted_layers)
    z = calibrate_noise(target_epsilon=8.0, sample_rate=1.0, steps=8, delta=1e-5)
    summary = _summary("local", "ckks", z, 8.0)
    if encrypted is not None:
        summary["secure_aggregation"]["encrypted_layers"] = encrypted
    # Execute
    mech = mechanism_of_run(summary, num_clients=10, min_clients=3, rounds=8)
    # Assert: the layers left in the clear reach the server one client at a time, so a
    # canary there carries one share z C; the encrypted sum carries min_clients of them
    assert mech.honest_clients == contributors
    assert release_std(mech) == pytest.approx(math.sqrt(contributors) * z * 1.0 / 3.0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("privacy.noise_multiplier", None, "privacy.noise_multiplier is missing (expected a"),
        ("privacy.clip_norm", None, "privacy.clip_norm is missing (expected a number"),
        ("privacy.clip_norm", "1.0", "privacy.clip_norm is '1.0', not a number"),
        ("privacy.aggregate_denominator", True, "privacy.aggregate_denominator is True, not a"),
        ("epsilon", None, "epsilon is missing (expected a number; a client-level DP run"),
        ("noise_placement", None, "noise_placement is None, not one of central, local, distr"),
        ("privacy", [], "privacy is [], not an object"),
    ],
)  # fmt: skip
def test_a_summary_without_a_privacy_field_is_refused_by_name(
    field: str, value: Any, message: str
) -> None:
    # Prepare: a client-level DP summary with one field removed (None) or damaged
    summary = _summary("central", "none", 1.0, 8.0)
    *parents, key = field.split(".")
    node = summary[parents[0]] if parents else summary
    if value is None:
        del node[key]
    else:
        node[key] = value
    # Execute / Assert: CheckpointError naming the file and the field, not a KeyError
    with pytest.raises(CheckpointError, match=re.escape(f"RUN/summary.json is damaged: {message}")):
        mechanism_of_run(summary, num_clients=3, min_clients=3, rounds=8,
                         source="RUN/summary.json")  # fmt: skip


def test_an_audit_names_the_privacy_field_its_run_summary_lacks(
    fedgc_run: Path, tmp_path: Path
) -> None:
    run = _copy_with_summary(
        fedgc_run, tmp_path / "run", privacy_unit="client", noise_placement="central",
        epsilon=8.0, privacy={"clip_norm": 1.0},
    )  # fmt: skip
    with pytest.raises(CheckpointError) as refused:
        audit_run(run, AuditSettings(attacks=("canary",), canaries=100, trials=100))
    assert str(refused.value) == (
        f"{run / 'summary.json'} is damaged: privacy.noise_multiplier is missing (expected a "
        "number; a client-level DP run states it)"
    )


def test_an_example_level_run_is_not_called_a_run_without_dp() -> None:
    summary = {"privacy_unit": "example", "epsilon": 2.0, "delta": 1e-5, "rounds_completed": 4}
    mech = mechanism_of_run(summary, num_clients=3, min_clients=3, rounds=4)
    found = audit_mechanism(mech, canaries=200, trials=200, seed=0)
    assert found["accountant_epsilon"] is None  # no client-level claim to compare with
    assert found["accountant"].startswith("none at the client level: the run's DP is example")


def test_an_example_level_run_gets_no_leakage_figure_from_an_update_without_dp_sgd(
    fedgc_run: Path, tmp_path: Path
) -> None:
    from audits.run_audit import _leakage

    run = load_run(_copy_with_summary(fedgc_run, tmp_path / "example", privacy_unit="example"))
    server = observations(run, choose_targets(run, 4))[0]
    assert server.updates == "each client's update"
    found = _leakage(run, server, SETTINGS)
    assert found["applicable"] is False and "DP-SGD" in found["why"]


@pytest.mark.parametrize(
    ("encrypted", "server_sees"),
    [(["backbone.stages"], "each client's update"), (["backbone.embedding"], "only the sum"),
     ("all", "only the sum")],
)  # fmt: skip
def test_layers_ckks_leaves_in_the_clear_are_each_clients_update_to_the_server(
    fedgc_run: Path, tmp_path: Path, encrypted: Any, server_sees: str
) -> None:
    sa = {"scheme": "ckks", "encrypted_layers": encrypted}
    run = load_run(_copy_with_summary(fedgc_run, tmp_path / "ckks", secure_aggregation=sa))
    server = observations(run, choose_targets(run, 4))[0]
    assert server.updates == server_sees
    if server_sees != "only the sum":
        assert "backbone.embedding.weight" in " ".join(server.sees)


def test_attacks_without_public_faces_audit_a_run_without_held_out_identities(
    tmp_path: Path,
) -> None:
    # Prepare: a run that holds out no identity, so it has no stand-in for public faces
    raw = tomllib.loads(TINY.format(algorithm="fedavg"))
    raw["data"]["held_out_identities"] = 0
    raw["train"] |= {"rounds": 1, "local_epochs": 1}
    run = write_simulated_run(config_from_dict(raw), tmp_path)
    quick = AuditSettings(attacks=("templates", "canary"), targets=4, canaries=200, trials=200)
    # Execute
    found = audit_run(run, quick)
    # Assert: templates and canary ran (no DP: the canary bound sits at its cap) and the
    # results say that no prior was fitted
    assert found["attacker_prior"]["public_faces"] is None
    assert found["settings"]["prior_components"] is None
    templates = found["attacks"]["templates"]["server"]
    assert templates["applicable"] is True and templates["chance"] == 0.25
    canary = found["attacks"]["canary"]
    assert canary["at_audit_cap"] is True
    assert canary["epsilon_lower_bound"] == canary["largest_bound_this_audit_can_show"] > 0
    # inversion needs the public faces: refused by name
    with pytest.raises(ConfigError, match="no held-out identities: give public faces"):
        audit_run(run, dataclasses.replace(quick, attacks=("inversion",)))


def test_public_folders_with_one_face_are_refused_by_name(
    fedgc_run: Path, tmp_path: Path, capsys
) -> None:
    from PIL import Image

    # Prepare: --public folders holding a single face (the PCA prior needs two)
    public = tmp_path / "public"
    (public / "p0").mkdir(parents=True)
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(public / "p0" / "0.png")
    run = _copy_with_summary(fedgc_run, tmp_path / "run")
    # Execute
    code = main(["audit", "--run", str(run), "--attack", "inversion", "--public", str(public),
                 "--steps", "1", "--quiet"])  # fmt: skip
    # Assert: a usage error naming the option and the count, not a traceback
    err = capsys.readouterr().err
    assert code == 2
    assert f"--public {public} holds 1 face image(s): the attacker's prior" in err
    assert "Traceback" not in err


def test_a_prior_fitted_on_public_folders_keeps_grids_out_unless_asked(
    fedgc_run: Path, tmp_path: Path
) -> None:
    # Prepare: a synthetic run attacked with a --public folder (identity folders: real faces)
    from PIL import Image

    public = tmp_path / "public"
    rng = np.random.default_rng(0)
    for person in ("p0", "p1", "p2"):
        (public / person).mkdir(parents=True)
        for k in range(4):
            pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(public / person / f"{k}.png")
    quick = AuditSettings(attacks=("inversion",), targets=2, steps=3, restarts=1,
                          prior_components=4, evaluator_epochs=1, public_dir=public)  # fmt: skip
    # Execute
    run = _copy_with_summary(fedgc_run, tmp_path / "run")
    found = audit_run(run, quick)
    # Assert: no grid without --include-images; with it, the grids are written
    assert found["attacker_prior"]["from_real_faces"] is True
    assert sorted((run / "audit").glob("*.png")) == []
    audit_run(run, dataclasses.replace(quick, include_images=True))
    assert sorted((run / "audit").glob("*.png"))
    # and the report leaves them out too, as it does for a run on real faces
    from fl_secure.app.report import write_report

    write_report(run, ["md"])
    assert sorted((run / "report").glob("*.png")) == []
    write_report(run, ["md"], include_images=True)
    assert sorted((run / "report").glob("*.png"))
