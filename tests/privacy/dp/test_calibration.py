"""Stateless epsilon, noise calibration and the ``privacy`` command line."""

from __future__ import annotations

import argparse
import json

import pytest

from fl_secure.app.cli.privacy import add_parser
from fl_secure.errors import PrivacyError
from privacy.dp.calibration import calibrate_noise, epsilon_for

DELTA = 1e-5


def test_epsilon_for_matches_accountant_figure() -> None:
    eps = epsilon_for(
        accountant="pld", noise_multiplier=4.0, sample_rate=0.01, steps=10_000, delta=DELTA
    )
    assert eps == pytest.approx(0.947, abs=0.01)


@pytest.mark.parametrize("accountant", ["rdp", "prv", "pld"])
@pytest.mark.parametrize(("target", "q", "t"), [(2.0, 0.02, 300), (0.5, 1.0, 5)])
def test_calibrate_round_trips_within_one_percent(
    accountant: str, target: float, q: float, t: int
) -> None:
    # Execute
    z = calibrate_noise(
        target_epsilon=target, sample_rate=q, steps=t, delta=DELTA, accountant=accountant
    )

    # Assert: meets the target, is within 1% below it, and 1% less noise would not do.
    def eps(noise: float) -> float:
        return epsilon_for(
            accountant=accountant, noise_multiplier=noise, sample_rate=q, steps=t, delta=DELTA
        )

    assert 0.99 * target <= eps(z) <= target
    assert eps(z * 0.99) > target


def test_calibrate_fixed_size_with_pld() -> None:
    z = calibrate_noise(
        target_epsilon=3.0,
        sample_rate=0.1,
        steps=50,
        delta=DELTA,
        sampling="fixed_size",
        population=100,
    )
    eps = epsilon_for(
        accountant="pld",
        noise_multiplier=z,
        sample_rate=0.1,
        steps=50,
        delta=DELTA,
        sampling="fixed_size",
        population=100,
    )
    assert 0.99 * 3.0 <= eps <= 3.0


def test_calibrate_impossible_targets() -> None:
    with pytest.raises(PrivacyError, match="unreachable"):
        calibrate_noise(target_epsilon=1e-4, sample_rate=1.0, steps=1, delta=DELTA)
    with pytest.raises(PrivacyError, match="target_epsilon"):
        calibrate_noise(target_epsilon=0.0, sample_rate=0.1, steps=1, delta=DELTA)
    with pytest.raises(PrivacyError, match="no meaningful protection"):
        calibrate_noise(
            target_epsilon=1e6, sample_rate=0.001, steps=1, delta=DELTA, accountant="rdp"
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fl-secure")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


EPSILON_ARGS = ["privacy", "epsilon", "--noise-multiplier", "4", "--sample-rate", "0.01"]


def test_cli_epsilon_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*EPSILON_ARGS, "--steps", "10000", "--delta", "1e-5", "--accountant", "pld"]
    args = _parser().parse_args([*argv, "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["epsilon"] == pytest.approx(0.947, abs=0.01)
    assert out["adjacency"] == "add/remove"
    expected = {"delta", "noise_multiplier", "accountant", "sample_rate", "steps", "sampling"}
    assert expected <= out.keys()
    assert (out["accountant"], out["steps"], out["sampling"]) == ("pld", 10_000, "poisson")


def test_cli_human_output_states_adjacency(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*EPSILON_ARGS, "--steps", "10", "--delta", "1e-5", "--accountant", "pld"]
    args = _parser().parse_args([*argv, "--sampling", "fixed_size", "--population", "1000"])
    assert args.func(args) == 0
    assert "replace-one adjacency" in capsys.readouterr().out


def test_cli_calibrate_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["privacy", "calibrate", "--target-epsilon", "2", "--sample-rate", "0.02"]
    args = _parser().parse_args([*argv, "--steps", "300", "--delta", "1e-5", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["accountant"] == "pld"
    assert 1.98 <= out["epsilon"] <= 2.0
    assert out["noise_multiplier"] > 0


def test_cli_rdp_fixed_size_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*EPSILON_ARGS, "--steps", "10", "--delta", "1e-5", "--accountant", "rdp"]
    args = _parser().parse_args([*argv, "--sampling", "fixed_size", "--population", "1000"])
    assert args.func(args) == 2
    assert "'pld'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--sample-rate", "0"),
        ("--sample-rate", "1.5"),
        ("--noise-multiplier", "0"),
        ("--steps", "0"),
        ("--delta", "1"),
    ],
)
def test_cli_validation_names_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    values = {
        "--noise-multiplier": "1",
        "--sample-rate": "0.1",
        "--steps": "10",
        "--delta": "1e-5",
        flag: value,
    }
    argv = ["privacy", "epsilon", "--accountant", "rdp"]
    for key, val in values.items():
        argv += [key, val]
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)
    assert f"{flag} must be" in capsys.readouterr().err


def test_a_schedule_with_no_guarantee_is_refused_before_pld_builds_its_grid(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # z = 1 on every example for 10^8 steps: RDP bounds epsilon by 5.5e7; PLD would take
    # hundreds of GB to say so exactly
    argv = [
        "privacy",
        "epsilon",
        "--noise-multiplier",
        "1",
        "--sample-rate",
        "1",
        "--delta",
        "1e-5",
    ]
    args = _parser().parse_args([*argv, "--steps", "100000000", "--accountant", "pld"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "epsilon > 1000 (RDP bound 5.5e+07): no guarantee at all" in err
    rdp = epsilon_for(accountant="rdp", noise_multiplier=1.0, sample_rate=1.0,
                      steps=100_000_000, delta=DELTA)  # fmt: skip
    assert rdp == pytest.approx(5.5e7, rel=1e-3)
    # calibration still finds the noise such schedules need
    z = calibrate_noise(target_epsilon=8.0, sample_rate=1.0, steps=100_000, delta=DELTA)
    assert epsilon_for(accountant="pld", noise_multiplier=z, sample_rate=1.0,
                       steps=100_000, delta=DELTA) <= 8.0  # fmt: skip
