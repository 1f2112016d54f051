"""`fl-secure server`: a start that fails leaves no run directory behind."""

from __future__ import annotations

import socket
from pathlib import Path

from fl_secure.app.cli import main
from fl_secure.tls import init_certificates

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--set", "data.num_identities=12", "--set", "data.held_out_identities=4",
        "--set", "data.images_per_identity=4", "--set", "data.image_size=32"]  # fmt: skip


def test_a_server_that_cannot_start_leaves_no_run_directory(tmp_path: Path, capsys) -> None:
    # Prepare: enrolled certificates, and a port another process holds
    init_certificates(tmp_path / "certs", clients=4)
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    config = str(ROOT / "examples" / "quickstart.toml")
    base = ["server", "--config", config, *TINY, "--certs", str(tmp_path / "certs" / "server"),
            "--out", str(tmp_path / "runs"), "--quiet"]  # fmt: skip
    try:
        # Execute: the port is taken; then a --port-file in a folder that does not exist
        taken = main([*base, "--address", f"127.0.0.1:{port}"])
        taken_err = capsys.readouterr().err
        no_folder = main([*base, "--address", "127.0.0.1:0",
                          "--port-file", str(tmp_path / "nope" / "port")])  # fmt: skip
        no_folder_err = capsys.readouterr().err
    finally:
        held.close()
    # Assert: both refused by name, exit 2, and no half-made run directory left
    assert taken == 2 and f"could not bind the server to 127.0.0.1:{port}" in taken_err
    assert no_folder == 2 and "--port-file" in no_folder_err and "does not exist" in no_folder_err
    assert list((tmp_path / "runs").glob("*")) == []


def test_a_train_whose_data_plan_does_not_fit_leaves_no_run_directory(
    tmp_path: Path, capsys
) -> None:
    # 8 training identities for 9 clients: found when the server plans the data, after the
    # run directory and the clients' certificates were made
    code = main(["train", "--config", str(ROOT / "examples" / "quickstart.toml"), *TINY,
                 "--set", "partition.num_clients=9", "--out", str(tmp_path / "runs"),
                 "--quiet"])  # fmt: skip
    assert code == 2
    assert "8 training identities cannot be spread over 9 clients" in capsys.readouterr().err
    assert list((tmp_path / "runs").glob("*")) == []


def test_a_run_held_by_one_process_is_refused_to_a_second(tmp_path: Path, capsys) -> None:
    import os

    from fl_secure.config import config_to_toml, load_config
    from fl_secure.runs import RunDir

    # Prepare: a run directory (config only, as after a crash before round 1)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    config = load_config(ROOT / "examples" / "quickstart.toml", TINY[1::2])
    run.config.write_text(config_to_toml(config))
    init_certificates(tmp_path / "certs", clients=4)
    before = sorted(p.name for p in run.path.iterdir())
    # Execute: while this process holds it, train --resume and server --resume try it
    with run.held():
        assert (run.path / ".run.lock").read_text() == str(os.getpid())
        trained = main(["train", "--resume", str(run.path), "--quiet"])
        train_err = capsys.readouterr().err
        served = main(["server", "--resume", str(run.path),
                       "--certs", str(tmp_path / "certs" / "server"),
                       "--address", "127.0.0.1:0", "--quiet"])  # fmt: skip
        serve_err = capsys.readouterr().err
    # Assert: both refused, naming the holder; nothing was written but the lock file
    for code, err in ((trained, train_err), (served, serve_err)):
        assert code == 2 and f"is in use by another fl-secure process (pid {os.getpid()})" in err
    assert sorted(p.name for p in run.path.iterdir()) == sorted([*before, ".run.lock"])
    with run.held():  # released when the holder let go
        pass
