"""What `fl-secure train` prints at the end of a run."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from fl_secure.app.cli.runs import print_summary


@pytest.mark.parametrize(
    ("initial", "label"),
    [("pretrained (model.pretrained)", "initial, pretrained"), (None, "untrained")],
)
def test_round_zero_is_named_for_what_it_was(
    initial: str | None, label: str, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = {
        "status": "completed",
        "tar_at_far_1e-2": 0.25,
        "untrained": {"tar_at_far_1e-2": 0.5},
    }
    if initial is not None:
        summary["initial_model"] = initial
    assert print_summary(summary, Path("run"), as_json=False) == 0
    assert f"tar_at_far_1e-2: 0.2500   ({label}: 0.5000)" in capsys.readouterr().out


def test_a_headline_the_run_scored_nan_prints_as_n_a(capsys: pytest.CaptureFixture[str]) -> None:
    # a NaN score is null in summary.json (strict JSON); the end-of-run lines still print
    summary = {"status": "completed", "tar_at_far_1e-2": None, "rank1": 0.5, "untrained": {}}
    assert print_summary(summary, Path("run"), as_json=False) == 0
    out = capsys.readouterr().out
    assert "tar_at_far_1e-2: n/a" in out and "rank1: 0.5000" in out


def test_fedaffect_prints_expression_accuracy_beside_the_majority_class(
    capsys: pytest.CaptureFixture[str],
) -> None:
    held = {"expression_accuracy": 0.35357, "expression_majority": 0.35357}
    summary: dict[str, object] = {"status": "completed", "held_out": held}
    summary["untrained"] = {"expression_accuracy": 0.2}
    assert print_summary(summary, Path("run"), as_json=False) == 0
    out = capsys.readouterr().out
    assert "expression accuracy: 0.3536   (always the most frequent expression: 0.3536)" in out
    assert "(untrained: 0.2000)" in out and "no better than always answering" in out


def _private(**extra: object) -> dict[str, object]:
    return {
        "status": "completed", "privacy_unit": "client", "epsilon": 7.96871, "delta": 1e-5,
        "accountant": "pld", "noise_placement": "central", "num_clients": 3,
        "privacy": {"adjacency": "add/remove"}, **extra,
    }  # fmt: skip


def test_the_stated_epsilon_is_rounded_up(capsys: pytest.CaptureFixture[str]) -> None:
    assert print_summary(_private(), Path("run"), as_json=False) == 0
    out = capsys.readouterr().out
    assert "privacy: (7.9688, 1e-05)-DP at the client level" in out  # 7.96871, never 7.9687
    assert "warning: delta" not in out


@pytest.mark.parametrize(
    ("extra", "expected"),
    [({"delta": 0.5}, "delta = 0.5 is not below 1/N for N = 3 clients"),
     ({"delta": 0.05, "privacy_unit": "example", "client_train_sizes": [72, 90]},
      "delta = 0.05 is not below 1/N for N = 72 training images (smallest client)")],
)  # fmt: skip
def test_a_delta_not_below_one_over_n_is_warned_of(
    extra: dict[str, object], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert print_summary(_private(**extra), Path("run"), as_json=False) == 0
    assert f"warning: {expected}" in capsys.readouterr().out


def test_training_warns_of_such_a_delta_before_it_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from fl_secure.app.cli import main

    config = tmp_path / "c.toml"
    config.write_text(
        "[partition]\nnum_clients = 3\n[server]\nmin_clients = 3\n"
        '[privacy]\nunit = "client"\nnoise_multiplier = 1.0\ndelta = 0.5\n'
    )
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # --out cannot be made: the run stops right after the checks
    with caplog.at_level("WARNING"):
        main(["train", "--config", str(config), "--out", str(blocker / "runs"), "--quiet"])
    assert "privacy.delta = 0.5 is not below 1/N for the N = 3 clients" in caplog.text


def test_a_server_whose_certificate_folder_holds_the_ca_key_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from fl_secure.app.cli import main
    from fl_secure.tls import init_certificates

    paths = init_certificates(tmp_path / "certs", clients=2)
    shutil.copy(paths.ca_key, paths.server_dir / "ca.key")  # the CA key beside the server's
    config = tmp_path / "c.toml"
    config.write_text("[partition]\nnum_clients = 2\n[server]\nmin_clients = 2\n")
    with caplog.at_level("WARNING"):  # a bad address stops it right after the checks
        code = main(["server", "--certs", str(paths.server_dir), "--config", str(config),
                     "--address", "no-port-here"])  # fmt: skip
    assert code != 0
    assert "holds the CA key" in caplog.text and "keep ca.key offline" in caplog.text


def test_the_traceback_hint_names_where_minus_v_goes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import fl_secure.app.experiment
    from fl_secure.app.cli import main

    def unreadable(path: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(fl_secure.app.experiment, "load_experiment", unreadable)
    # the hint's form works: -v before the command shows the traceback
    with pytest.raises(PermissionError):
        main(["-v", "experiment", "--config", "grid.toml"])
    assert main(["experiment", "--config", "grid.toml"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "fl-secure: error: Permission denied: grid.toml (`fl-secure -v experiment ...` shows "
        "the traceback)\n"
    )
    with pytest.raises(SystemExit):  # after the command -v is not an option of it
        main(["experiment", "--config", "grid.toml", "-v"])


def test_the_sites_own_epsilon_against_the_server_is_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fl_secure.config import config_from_dict
    from privacy.dp.zcdp import composed_rho, zcdp_epsilon
    from privacy.ledger.site_ledger import SiteLedger

    # Prepare: two embedded sites' ledgers; client-1 released 3 updates at z = 1.1 (local
    # noise), client-0 one
    config = config_from_dict({"privacy": {"unit": "client", "noise_multiplier": 1.1}})
    for client, rounds in (("client-0", 1), ("client-1", 3)):
        site = SiteLedger(tmp_path / "clients" / client)
        for r in range(1, rounds + 1):
            site.record(config, "run", r, bytes([r]) * 16)
    # Execute
    assert print_summary(_private(), tmp_path, as_json=False) == 0

    # Assert: the larger site's figure (three releases), rounded up; local noise is integer
    # noise, so its figure is the zCDP bound (no amplification)
    def up(x: float) -> str:
        return f"{math.ceil(x * 1e4) / 1e4:.4f}"

    eps = zcdp_epsilon(composed_rho([1.1] * 3), 1e-5)
    image = zcdp_epsilon(composed_rho([1.1 / 2] * 3), 1e-5)  # sensitivity 2 C
    out = capsys.readouterr().out
    assert (
        f"each site against the server (its own ledger, no sampling amplification): "
        f"epsilon <= {up(eps)}; {up(eps)} if the other sites collude; one training image: "
        f"epsilon <= {up(image)}, {up(image)} (fl-secure privacy site" in out
    )
    # a release without noise against the server (central placement): unbounded, no crash
    central = config_from_dict(
        {"privacy": {"unit": "client", "noise_placement": "central", "noise_multiplier": 1.0}}
    )
    SiteLedger(tmp_path / "clients" / "client-0").record(central, "run", 2, b"\x09" * 16)
    assert print_summary(_private(), tmp_path, as_json=False) == 0
    assert "epsilon <= unbounded; unbounded if the other sites collude" in (capsys.readouterr().out)


def test_the_summary_line_states_start_final_and_epsilon(
    capsys: pytest.CaptureFixture[str],
) -> None:
    summary: dict[str, object] = {
        "status": "completed",
        "tar_at_far_1e-2": 0.7125,
        "untrained": {"tar_at_far_1e-2": 0.694},
        "initial_model": "pretrained (model.pretrained = dlib-resnet)",
        "privacy_unit": "example",
        "epsilon": 7.98765,
        "delta": 1e-5,
        "accountant": "prv",
        "noise_placement": "local",
    }
    print_summary(summary, Path("run"), as_json=False)
    out = capsys.readouterr().out
    expected = (
        "summary: held-out TAR@FAR=1e-2 0.6940 (initial, pretrained) -> 0.7125, epsilon 7.9877 "
        "(delta 1e-05, example level)"
    )
    assert expected in out
    del summary["privacy_unit"], summary["epsilon"]
    print_summary(summary, Path("run"), as_json=False)
    assert "-> 0.7125, no differential privacy" in capsys.readouterr().out
