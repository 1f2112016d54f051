"""Real processes over gRPC + mTLS: kill -9 the server and resume; kill a client mid-round."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fl_secure.tls import init_certificates
from privacy.dp.calibration import epsilon_for
from privacy.ledger.run_ledger import Ledger

pytestmark = pytest.mark.slow

TINY = """
[run]
name = "tiny"
seed = 3
[data]
source = "synthetic"
image_size = 32
num_identities = 24
images_per_identity = 6
held_out_identities = 6
[partition]
num_clients = 3
[model]
backbone = "cnn-small"
embedding_size = 64
[algorithm]
{algorithm}
[train]
rounds = {rounds}
local_steps = 2
batch_size = 16
lr = 0.05
[server]
min_clients = {min_clients}
round_timeout = {timeout}
max_retries = 1
{privacy}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(*args: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "GRPC_VERBOSITY": "ERROR", "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "fl_secure.app.cli", *args],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=env,
        )


def _wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _rounds(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [ln for ln in path.read_text().splitlines() if ln.endswith("}")]
    records = [json.loads(ln) for ln in lines]
    return [r["round"] for r in records if "kind" not in r]  # completed rounds only


class Federation:
    def __init__(
        self,
        tmp: Path,
        *,
        rounds: int,
        min_clients: int,
        timeout: float,
        privacy: str = "",
        algorithm: str = 'name = "fedpe"',
    ) -> None:
        self.tmp = tmp
        self.config = tmp / "tiny.toml"
        self.config.write_text(
            TINY.format(
                rounds=rounds,
                min_clients=min_clients,
                timeout=timeout,
                privacy=privacy,
                algorithm=algorithm,
            )
        )
        self.certs = tmp / "certs"
        init_certificates(self.certs, clients=3)
        self.port = _free_port()
        self.out = tmp / "runs"
        self.clients: list[subprocess.Popen[bytes]] = []
        self.server: subprocess.Popen[bytes] | None = None

    def start_server(self, *extra: str) -> None:
        served = self.certs / "server"  # the server's own folder: no client secret
        args = ["server", "--certs", str(served), "--address", f"localhost:{self.port}"]
        if "--resume" not in extra:
            args += ["--config", str(self.config), "--out", str(self.out)]
        self.server = _cli(*args, *extra, log=self.tmp / "server.log")

    def start_clients(self) -> None:
        for i in range(3):
            self.clients.append(
                _cli(
                    "client",
                    "--server",
                    f"localhost:{self.port}",
                    "--id",
                    f"client-{i}",
                    "--certs",
                    str(self.certs / "sites" / f"client-{i}"),  # its own keys only
                    "--config",
                    str(self.config),
                    "--plan-index",
                    str(i),
                    "--state-dir",
                    str(self.tmp / f"state-{i}"),
                    log=self.tmp / f"client-{i}.log",
                )
            )

    @property
    def run_dir(self) -> Path:
        runs = sorted(self.out.glob("tiny-*"))
        return runs[0] if runs else self.out / "missing"

    def stop(self) -> None:
        for p in [*self.clients, self.server]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.tmp.glob("*.log"))


@pytest.fixture
def federation(tmp_path: Path):
    feds: list[Federation] = []

    def make(**kw) -> Federation:
        fed = Federation(tmp_path, **kw)
        feds.append(fed)
        return fed

    yield make
    for fed in feds:
        fed.stop()


def test_kill_9_server_then_resume(federation) -> None:
    # Prepare: a standalone server and three client processes.
    privacy = '[privacy]\nunit = "client"\nnoise_placement = "central"\nnoise_multiplier = 2.0'
    fed = federation(rounds=4, min_clients=3, timeout=120.0, privacy=privacy)
    fed.start_server()
    fed.start_clients()
    _wait_for(lambda: 2 in _rounds(fed.run_dir), 240, "round 2 to complete\n" + fed.logs())
    # Execute: SIGKILL in round 3; the run folder is moved (archived, renamed), then the
    # server restarts with --resume on the same address.
    assert fed.server is not None
    fed.server.send_signal(signal.SIGKILL)
    fed.server.wait(timeout=10)
    first_name = fed.run_dir.name
    fed.run_dir.rename(fed.out / "tiny-moved")
    done_before = max(_rounds(fed.run_dir))
    fed.start_server("--resume", str(fed.run_dir))
    assert fed.server.wait(timeout=300) == 0, fed.logs()
    # Assert: every round once, in order, continuing from the last completed one.
    rounds = _rounds(fed.run_dir)
    assert rounds == [0, 1, 2, 3, 4], rounds
    assert done_before >= 2
    summary = json.loads((fed.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 4
    # the run began at the first start and was resumed once: both kept (partition.json)
    starts = json.loads((fed.run_dir / "partition.json").read_text())["starts"]
    assert len(starts) == 2 and starts[0] <= starts[1]
    assert summary["provenance"]["started_at"] == starts[0]
    assert summary["provenance"]["resumed_at"] == starts[1:]
    # a standalone server describes its enrolled sites, not the config's plan: the sizes
    # are what each site reported (1 under client-level DP), the held-out set its own
    assert summary["num_clients"] == 3 and summary["client_train_sizes"] is None
    assert summary["client_reported_examples"] == {f"client-{i}": 1 for i in range(3)}
    assert summary["evaluation"].startswith("the server's own evaluation set")
    for client in fed.clients:  # the clients reconnected by themselves and finished
        assert client.wait(timeout=60) == 0, fed.logs()
    # ... and the privacy ledger lost no round and counted none twice; it is still the
    # ledger of the run as it was first named
    with Ledger.read(fed.run_dir / "ledger.sqlite") as ledger:
        assert ledger.verify().ok
        assert ledger.run_id == first_name != fed.run_dir.name
        client_rounds = [e.round for e in ledger.entries() if e.kind == "client_level"]
    assert client_rounds == [1, 2, 3, 4], client_rounds
    expected = epsilon_for(
        accountant="pld", noise_multiplier=2.0, sample_rate=1.0, steps=4, delta=1e-5
    )
    assert summary["epsilon"] == pytest.approx(expected)


@pytest.mark.parametrize(("min_clients", "status"), [(2, "completed"), (3, "aborted")])
def test_kill_a_client_mid_round(federation, min_clients: int, status: str) -> None:
    # Prepare: enough rounds that the run cannot finish between seeing round 1 recorded and
    # the kill (with 3 rounds a fast machine once completed them all before the signal).
    rounds = 8
    fed = federation(rounds=rounds, min_clients=min_clients, timeout=15.0)
    fed.start_server()
    fed.start_clients()
    _wait_for(lambda: 1 in _rounds(fed.run_dir), 240, "round 1\n" + fed.logs())
    # Execute: client-2 dies during a round after round 1.
    fed.clients[2].send_signal(signal.SIGKILL)
    assert fed.server is not None
    code = fed.server.wait(timeout=300)
    # Assert
    summary = json.loads((fed.run_dir / "summary.json").read_text())
    assert summary["status"] == status, fed.logs()
    lines = (fed.run_dir / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "kind" not in r]  # completed rounds
    attempts = [r for r in map(json.loads, lines) if r.get("kind") == "aborted"]
    if status == "completed":
        assert code == 0
        assert [r["round"] for r in records] == list(range(rounds + 1))
        assert any("client-2" in r["dropped"] for r in records[2:])
        assert all(r["num_updates"] >= 2 for r in records[1:])
    else:
        assert code != 0
        assert "aborted" in summary["reason"]
        assert max(r["round"] for r in records) < rounds  # nothing half-applied was recorded
        assert [r["round"] for r in records] == list(range(len(records)))
        # the failed attempts are recorded as such, each naming its round and reason
        assert any(a["round"] == len(records) for a in attempts)
        assert all(a["reason"] for a in attempts)
        assert (fed.run_dir / "checkpoints" / "latest.json").exists()


def test_secure_aggregation_with_distributed_noise_in_processes(federation) -> None:
    # Prepare: a server and three client processes; SecAgg + client-level DP whose noise
    # each client adds in shares before masking
    section = (
        '[privacy]\nunit = "client"\nnoise_placement = "distributed"\nnoise_multiplier = 1.0\n'
        '[secure_aggregation]\nscheme = "secagg"\nclip_range = 8.0'
    )
    fed = federation(rounds=2, min_clients=3, timeout=120.0, privacy=section)
    # Execute
    fed.start_server()
    fed.start_clients()
    assert fed.server is not None
    assert fed.server.wait(timeout=300) == 0, fed.logs()
    # Assert: every round unmasked with all three in the sum; privacy accounted per round
    summary = json.loads((fed.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    sa = summary["secure_aggregation"]
    assert sa["scheme"] == "secagg" and sa["survivors_per_round"] == [3, 3]
    assert summary["noise_placement"] == "distributed"
    expected = epsilon_for(  # integer noise: its zCDP bound, no amplification
        accountant="pld", noise_multiplier=1.0, sample_rate=1.0, steps=2, delta=1e-5,
        noise="discrete_gaussian",
    )  # fmt: skip
    assert summary["epsilon"] == pytest.approx(expected)
    for client in fed.clients:
        assert client.wait(timeout=60) == 0, fed.logs()


def test_ckks_aggregation_with_local_noise_in_processes(federation) -> None:
    # Prepare: the clients' shared CKKS key made with the CLI; a standalone server holding only
    # the key-less context and three client processes; client-level DP with local noise
    section = (
        '[privacy]\nunit = "client"\nnoise_placement = "local"\nnoise_multiplier = 0.5\n'
        '[secure_aggregation]\nscheme = "ckks"'
    )
    fed = federation(rounds=2, min_clients=3, timeout=120.0, privacy=section)
    keys = _cli("certs", "ckks", "--out", str(fed.certs), log=fed.tmp / "certs.log")
    assert keys.wait(timeout=120) == 0, fed.logs()
    for i in range(3):  # in each site's folder, never in the server's
        secret = fed.certs / "sites" / f"client-{i}" / "ckks" / "clients.secret"
        assert secret.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in (fed.certs / "server" / "ckks").iterdir()) == ["server.public"]
    # Execute
    fed.start_server()
    fed.start_clients()
    assert fed.server is not None
    assert fed.server.wait(timeout=300) == 0, fed.logs()
    # Assert: both rounds decrypted with all three updates in the sum; privacy accounted
    summary = json.loads((fed.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    sa = summary["secure_aggregation"]
    assert sa["scheme"] == "ckks" and sa["survivors_per_round"] == [3, 3]
    records = [json.loads(ln) for ln in (fed.run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [r["secure_aggregation"] for r in records if "secure_aggregation" in r]
    assert [len(r["decryptors"]) for r in rounds] == [2, 2]
    expected = epsilon_for(  # integer noise: its zCDP bound, no amplification
        accountant="pld", noise_multiplier=0.5, sample_rate=1.0, steps=2, delta=1e-5,
        noise="discrete_gaussian",
    )  # fmt: skip
    assert summary["epsilon"] == pytest.approx(expected)
    for client in fed.clients:
        assert client.wait(timeout=60) == 0, fed.logs()


#: Client-level DP with distributed discrete-Gaussian noise under SecAgg (z = 0.5).
DISTRIBUTED_DP = (
    '[privacy]\nunit = "client"\nnoise_placement = "distributed"\nnoise_multiplier = 0.5\n'
    '[secure_aggregation]\nscheme = "secagg"'
)


def _run_private_secure(fed: Federation, algorithm: str) -> tuple[dict, dict]:
    """Run ``fed`` to its end; check both rounds summed the three masked, noised updates,
    epsilon is the zCDP bound of the integer noise (no amplification) and the global model
    is the backbone alone. Returns (summary, params)."""
    from fl_secure.checkpoints import CheckpointStore

    fed.start_server()
    fed.start_clients()
    assert fed.server is not None
    assert fed.server.wait(timeout=300) == 0, fed.logs()
    for client in fed.clients:
        assert client.wait(timeout=60) == 0, fed.logs()
    summary = json.loads((fed.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["algorithm"] == algorithm
    assert summary["secure_aggregation"]["survivors_per_round"] == [3, 3]
    expected = epsilon_for(  # integer noise: its zCDP bound, no amplification
        accountant="pld", noise_multiplier=0.5, sample_rate=1.0, steps=2, delta=1e-5,
        noise="discrete_gaussian",
    )  # fmt: skip
    assert summary["epsilon"] == pytest.approx(expected)
    checkpoint = CheckpointStore(fed.run_dir / "checkpoints").latest()
    assert checkpoint is not None
    params = checkpoint.parameters  # no head, no adapter: private state stays on the clients
    assert params and all(name.startswith("backbone.") for name in params)
    return summary, params


def test_adafedfr_with_client_level_dp_and_secure_aggregation_in_processes(federation) -> None:
    # Prepare: AdaFedFR (5 public identities, top-3 negatives) with client-level DP,
    # distributed discrete-Gaussian noise under SecAgg, three client processes over mTLS
    algorithm = 'name = "adafedfr"\nnum_negatives = 3\npublic_identities = 5\n'
    algorithm += "public_images_per_identity = 2"
    fed = federation(
        rounds=2, min_clients=3, timeout=120.0, privacy=DISTRIBUTED_DP, algorithm=algorithm
    )
    # Execute / Assert: completed under SecAgg with the zCDP epsilon, backbone-only model
    _, params = _run_private_secure(fed, "adafedfr")
    # ... every round sent R (5 public identities x 64 floats) with the backbone
    size = sum(v.nbytes for v in params.values())
    records = [json.loads(ln) for ln in (fed.run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["round"] >= 1]
    assert [r["round"] for r in trained] == [1, 2]
    for record in trained:
        assert record["bytes_per_client"] == {
            "broadcast": 5 * 64 * 4,
            "parameters_down": size,
            "parameters_up": size,
            "total": 5 * 64 * 4 + 2 * size,
        }


def test_fedfr_domain_federation_with_client_level_dp_in_processes(federation) -> None:
    # Prepare: FedFR (Zhuang et al., Algorithm 1) on the domain plan: client-0 holds labelled
    # source-domain identities, client-1 and client-2 shifted-domain ones, which they
    # pseudo-label with C-FINCH on the first model they receive; client-level DP with
    # distributed noise under SecAgg, three client processes over mTLS
    # d = 0.15: measured 9 and 8 clusters of the 20 and 16 images of 5 and 4 identities on
    # the untrained model (d = 0.1 leaves singletons, d = 0.3 one cluster)
    algorithm = 'name = "fedfr"\ndcl_lambda = 0.01\ncfinch_threshold = 0.15'
    fed = federation(
        rounds=2, min_clients=3, timeout=120.0, privacy=DISTRIBUTED_DP, algorithm=algorithm
    )
    text = fed.config.read_text()
    fed.config.write_text(text.replace("[partition]\n", '[partition]\nkind = "domain"\n', 1))
    # Execute / Assert: completed under SecAgg with the zCDP epsilon; FedPav: backbone only
    summary, _ = _run_private_secure(fed, "fedfr")
    assert summary["partition"] == "domain"
    # ... each target client saved a private head with one row per C-FINCH cluster, the
    # source client one row per identity it holds (9 of the 18 training identities)
    from safetensors.numpy import load_file

    rows = [
        load_file(str(_private_state(fed.tmp / f"state-{i}")))["head.classifier.weight"].shape[0]
        for i in range(3)
    ]
    from fl_secure.algorithms.cfinch import c_finch
    from fl_secure.config import load_config
    from fl_secure.data.plan import plan_federation
    from fl_secure.training import build_model, embed

    config = load_config(fed.config)
    plan = plan_federation(config)
    received = build_model(config.model, 1, 32, config.run.seed).backbone  # round 1's model
    clusters = [
        int(c_finch(embed(received, share.train.images), 0.15).max()) + 1
        for share in plan.clients[1:]
    ]
    assert rows == [9, *clusters]
    sizes = [len(share.train) for share in plan.clients[1:]]
    assert all(1 < c < n for c, n in zip(clusters, sizes, strict=True))


def _private_state(state_dir: Path) -> Path:
    """The one run's private layers a client kept in ``state_dir``."""
    (path,) = state_dir.glob("private-*.safetensors")
    return path
