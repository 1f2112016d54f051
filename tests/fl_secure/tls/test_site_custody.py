"""Key custody at a site: ``fl-secure client`` refuses a folder with another party's key.

The attack: the operator copies the whole ``certs init`` tree, or a site folder with a
neighbour's keys, to a site. That site can then sign key advertisements in the neighbour's
name that verify against the CA-signed registry (``_forge_advert`` of the server-side test
does exactly that with a folder's keys), or connect as the neighbour. Before the check the
client started on such a folder without a word.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from client.custody import check_site_folder
from fl_secure.app.cli import main
from fl_secure.errors import TlsError
from fl_secure.tls import init_certificates


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    init_certificates(tmp_path / "certs", clients=3)
    return tmp_path / "certs"


def test_a_site_folder_from_certs_init_and_one_from_certs_request_pass(
    certs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for site in ("client-0", "client-1", "client-2"):
        check_site_folder(certs / "sites" / site, site)
    assert main(["certs", "request", "--id", "hospital-a", "--out", str(tmp_path / "h")]) == 0
    capsys.readouterr()
    check_site_folder(tmp_path / "h", "hospital-a")  # keys made at the site, not yet signed


@pytest.mark.parametrize(
    ("planted", "named"),
    [
        ("clients/client-1.sign.key", "site 'client-1''s signing private key"),
        ("clients/client-1.key", "site 'client-1''s TLS private key"),
        ("backup/neighbour.pem", "signing private key of site 'client-1'"),  # renamed
        ("old.key", "not 'client-0''s own"),  # another site's TLS key, renamed
        ("ca.key", "CA's private key"),
        ("keys/authority.pem", "CA's private key"),  # the CA key renamed
        ("server.key", "server's private key"),
    ],
)
def test_a_site_folder_with_another_partys_key_is_refused_naming_the_file(
    certs: Path, planted: str, named: str
) -> None:
    # Prepare: client-0's folder, and one key of another party put into it
    site = certs / "sites" / "client-0"
    source = {
        "clients/client-1.sign.key": certs / "sites/client-1/clients/client-1.sign.key",
        "clients/client-1.key": certs / "sites/client-1/clients/client-1.key",
        "backup/neighbour.pem": certs / "sites/client-1/clients/client-1.sign.key",
        "old.key": certs / "sites/client-2/clients/client-2.key",
        "ca.key": certs / "ca/ca.key",
        "keys/authority.pem": certs / "ca/ca.key",
        "server.key": certs / "server/server.key",
    }[planted]
    (site / planted).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, site / planted)
    # Execute / Verify
    with pytest.raises(TlsError) as caught:
        check_site_folder(site, "client-0")
    assert named in str(caught.value) and str(site / planted) in str(caught.value)


def test_the_whole_init_folder_is_refused_naming_the_sites_own(certs: Path) -> None:
    with pytest.raises(TlsError, match="pass " + str(certs / "sites" / "client-0")):
        check_site_folder(certs, "client-0")


@pytest.mark.timeout(60)  # without the check the client retries the address for 600 s
def test_fl_secure_client_refuses_before_dialling_the_server(
    certs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the address is unreachable: an error about it would mean the check did not run first
    shutil.copy(certs / "ca/ca.key", certs / "sites/client-0/ca.key")
    code = main(["client", "--server", "127.0.0.1:9", "--id", "client-0",
                 "--certs", str(certs / "sites/client-0")])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "CA's private key" in err, err
