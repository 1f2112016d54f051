"""`fl-secure server`: a start that fails leaves no run directory behind."""

from __future__ import annotations

import socket
from pathlib import Path

from fl_secure.cli import main
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
    base = ["server", "--config", config, *TINY, "--certs", str(tmp_path / "certs"),
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
