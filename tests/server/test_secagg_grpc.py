"""Secure aggregation over gRPC + mTLS: the server learns only the sum, dropouts recovered."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from client.app import FlClient
from client.transport import Connection
from fl_secure.config import (
    Config,
    PartitionConfig,
    PrivacyConfig,
    SecureAggregationConfig,
    ServerConfig,
    config_to_toml,
)
from fl_secure.errors import PrivacyError
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.runs import RunDir
from fl_secure.tls import init_certificates
from fl_secure.tls.identity import load_signing_registry
from privacy.ckks.keys import distribute_ckks_keys, load_public_context
from privacy.ledger.site_ledger import SiteLedger
from server.app import load_enrollment, start_server
from server.coordinator import Coordinator
from server.settings import CoordinatorSettings
from tests.server.secagg_processes import run_client_processes


class ShiftTrainer:
    """Sends ``shift`` everywhere as its update; ``fail`` makes it die while training."""

    def __init__(self, shift: float, fail: bool = False) -> None:
        self.shift, self.fail, self.num_examples = shift, fail, 5

    def train(self, shared: Tensors, training: LocalTraining):
        if self.fail:
            raise RuntimeError("site crashed while training")
        update = OrderedDict((k, np.full_like(v, self.shift)) for k, v in shared.items())
        return update, self.num_examples, {"train_loss": 1.0, "local_steps": 3.0}

    def evaluate(self, shared: Tensors):
        return self.num_examples, {}


class _Killed(BaseException):
    """Ends a client thread like a kill -9 would end its process (no goodbye)."""


def _die_after_masked_input(monkeypatch, dying: set[str]) -> None:
    """Clients in ``dying`` vanish right after uploading their masked input."""
    import privacy.secagg.client_round as session
    from privacy.secagg.stages import MASKED

    real = session.client_secure_update

    def wrapped(setup, client_id, identity, registry, exchange, compute, upload):
        def exchange_or_die(stage: int, payload: bytes) -> bytes:
            if client_id in dying and stage == MASKED:
                raise _Killed(client_id)
            return exchange(stage, payload)

        return real(setup, client_id, identity, registry, exchange_or_die, compute, upload)

    monkeypatch.setattr(session, "client_secure_update", wrapped)


def _serve(
    tmp_path: Path,
    n: int,
    *,
    min_clients: int,
    round_timeout: float,
    stage_timeout: float,
    neighbours: int = 0,
    scheme: str = "secagg",
    privacy=None,
    initial: Tensors | None = None,
    ckks_layers: tuple[str, ...] = (),
    clock=None,
    max_retries: int = 0,
):
    """Certificates for n clients, a one-round coordinator and its gRPC server on port 0.

    ``clock`` replaces the coordinator's monotonic clock: a frozen one means no deadline ever
    passes, so a round can only end because every client answered or was seen to go.
    """
    certs = tmp_path / "certs"
    init_certificates(certs, clients=n)
    if initial is None:
        initial = OrderedDict(
            [("w", np.zeros((50, 40), np.float32)), ("b", np.zeros(7, np.float32))]
        )
    ckks_public = b""
    if scheme == "ckks":
        distribute_ckks_keys(certs)
        ckks_public = load_public_context(certs)
    secure = SecureAggregationConfig(
        scheme=scheme,  # type: ignore[arg-type]
        neighbours=neighbours,
        clip_range=4.0,
        stage_timeout=stage_timeout,
        ckks_layers=ckks_layers,
    )
    settings = CoordinatorSettings(
        rounds=1,
        min_clients=min_clients,
        round_timeout=round_timeout,
        max_retries=max_retries,
        poll_wait=0.5,
        final_evaluation=False,
        run_id="secagg-test",
        secure_aggregation=secure,
        ckks_public_context=ckks_public,
        # what build_server sends at join: each client holds every round's setup to it
        run_config_toml=_run_config(n, min_clients, secure, privacy),
    )
    coord = Coordinator(
        settings,
        initial,
        enrolled=set(load_enrollment(certs).fingerprints),
        run_dir=RunDir(tmp_path / "run"),
        server_step=lambda p, u, r: OrderedDict((k, p[k] + u[k]) for k in p),
        signing_registry=load_signing_registry(certs / "server"),
        privacy=privacy,
        **({"clock": clock} if clock is not None else {}),
    )
    server, port = start_server(coord, "127.0.0.1:0", cert_dir=certs)
    return coord, server, port, certs


def _run(
    tmp_path: Path,
    shifts: list[float],
    failing: set[int],
    *,
    min_clients: int | None = None,
    sites: dict[int, SiteLedger] | None = None,
    **kw,
) -> Coordinator:
    coord, server, port, certs = _serve(
        tmp_path,
        len(shifts),
        min_clients=min_clients or len(shifts) - len(failing),
        round_timeout=60.0,
        stage_timeout=10,
        # No deadline passes: a client that dies is noticed when its open call closes.
        clock=_frozen,
        **kw,
    )
    driver = threading.Thread(target=coord.run, daemon=True)
    driver.start()
    threads = []
    for i, shift in enumerate(shifts):
        trainer = ShiftTrainer(shift, fail=i in failing)
        client = FlClient(
            Connection(f"localhost:{port}", f"client-{i}", cert_dir=certs),
            lambda reply, t=trainer: t,  # type: ignore[misc]
            max_wait=20.0,
            site=(sites or {}).get(i),
        )
        th = threading.Thread(target=lambda c=client: _quiet(c.run), daemon=True)
        th.start()
        threads.append(th)
    driver.join(timeout=120)
    server.stop(grace=None)
    return coord


def _run_config(n: int, min_clients: int, secure: SecureAggregationConfig, privacy) -> str:
    """The run config a server built from these settings would send its clients."""
    p = PrivacyConfig()
    if privacy is not None and privacy.plan is not None:
        plan = privacy.plan
        p = PrivacyConfig(
            unit="client",
            noise_placement=plan.placement,
            noise_multiplier=plan.noise_multiplier,
            clip_norm=plan.clip_norm,
        )
    config = Config(
        partition=PartitionConfig(num_clients=n),
        server=ServerConfig(min_clients=min_clients),
        privacy=p,
        secure_aggregation=secure,
    )
    return config_to_toml(config)


def _distributed_dp(tmp_path: Path, *, population: int, min_survivors: int, z: float = 0.05):
    """Client-level DP with distributed noise for a one-round run: any ``min_survivors``
    clients' discrete Gaussian shares carry ``z C``."""
    from privacy.server_round import open_server_privacy

    cfg = PrivacyConfig(unit="client", noise_placement="distributed", noise_multiplier=z)
    return open_server_privacy(
        cfg, tmp_path / "ledger.sqlite", "secagg-test", rounds=1, population=population,
        clients_per_round=0, sample_rate=0.0, min_survivors=min_survivors,
    )  # fmt: skip


def _frozen() -> float:
    return 0.0


def _quiet(fn) -> None:
    try:
        fn()
    except (Exception, _Killed):  # noqa: BLE001, S110 - a failing client's thread just dies
        pass


def test_secure_sum_equals_the_plain_mean(tmp_path: Path) -> None:
    # Prepare: 4 clients, SecAgg (every pair masks), updates 0.5, 1.0, -0.25, 2.0
    shifts = [0.5, 1.0, -0.25, 2.0]
    # Execute
    coord = _run(tmp_path, shifts, failing=set())
    # Assert: the unmasked mean equals the plaintext mean within the fixed-point resolution
    assert coord.status == "completed", coord.stop_reason
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts), atol=4 * 2.0**-20)
    record = RunDir(tmp_path / "run").read_metrics()[-1]
    sa = record["secure_aggregation"]
    assert (
        sa["scheme"] == "secagg"
        and sa["threshold"] == 2
        and sa["survivors"] == [f"client-{i}" for i in range(4)]
    )
    # beside a masked upload, a client states its schedule, not its training loss
    assert {c: sorted(m) for c, m in record["clients"].items()} == {
        f"client-{i}": ["local_seconds", "local_steps"] for i in range(4)
    }


def first_setup_fails(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first secure-aggregation setup of the run fails; the attempts asked are listed."""
    import privacy.secagg.round_setup as session
    import server.secure_relay as relay

    real, calls = session.make_setup, []

    def first_fails(*args, **kwargs):
        calls.append(kwargs["attempt"])
        if len(calls) == 1:
            raise PrivacyError("threshold = 3 exceeds the 2 neighbours (a test's cohort)")
        return real(*args, **kwargs)

    monkeypatch.setattr(session, "make_setup", first_fails)  # the clients'
    monkeypatch.setattr(relay, "make_setup", first_fails)  # the server's
    return calls


def test_a_cohort_secure_aggregation_cannot_start_with_is_redrawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the first attempt's setup fails as a cohort size no threshold or graph fits
    # would (a Poisson cohort smaller than the largest one the start-up check saw)
    calls = first_setup_fails(monkeypatch)
    shifts = [0.5, -0.25, 1.0]
    # Execute
    coord = _run(tmp_path, shifts, failing=set(), max_retries=1)
    # Assert: the round was not lost: attempt 1 drew a cohort again and summed it
    assert coord.status == "completed", coord.stop_reason
    assert calls[:2] == [0, 1]  # the server's two attempts (clients rebuild the setup too)
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts), atol=4 * 2.0**-20)


def test_a_client_dropping_after_sharing_keys_is_recovered(tmp_path: Path) -> None:
    # Prepare: client-3 shares its keys, then dies while training (before its masked input)
    shifts = [0.5, 1.0, -0.25, 2.0]
    # Execute
    coord = _run(tmp_path, shifts, failing={3})
    # Assert: its pairwise masks were removed with the survivors' shares; exact mean of three.
    # The clock never moves, so the round went on because client-3 withdrew, not at a deadline
    assert coord.status == "completed", coord.stop_reason
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts[:3]), atol=4 * 2.0**-20)
    sa = RunDir(tmp_path / "run").read_metrics()[-1]["secure_aggregation"]
    assert sa["survivors"] == ["client-0", "client-1", "client-2"]
    failed = coord.events[-1]["failed"]
    assert failed == {
        "client-3": "secure aggregation: withdrew at masked input (local training failed)"
    }


def test_a_client_whose_update_is_not_finite_withdraws_and_says_why(tmp_path: Path) -> None:
    # Prepare: client-3's training diverged: its update is NaN everywhere
    shifts = [0.5, 1.0, -0.25, float("nan")]
    # Execute
    coord = _run(tmp_path, shifts, failing=set(), min_clients=3)
    # Assert: its encoder refused the update, it withdrew with that category (and nothing
    # else: the error's text stays on the client), and the round is the mean of the three
    assert coord.status == "completed", coord.stop_reason
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts[:3]), atol=4 * 2.0**-20)
    assert coord.events[-1]["failed"] == {
        "client-3": "secure aggregation: withdrew at masked input "
        "(its update was not finite or had the wrong size)"
    }


def test_ten_clients_two_killed_after_their_masked_input(tmp_path: Path, monkeypatch) -> None:
    # Prepare: SecAgg+ with 6 neighbours each (t = 4, so any client keeps >= t surviving
    # neighbours); client-3 and client-7 vanish after uploading their masked input, before
    # revealing any share
    shifts = [0.1 * (i + 1) for i in range(10)]
    _die_after_masked_input(monkeypatch, {"client-3", "client-7"})
    # Execute
    coord = _run(tmp_path, shifts, failing=set(), min_clients=8, neighbours=6, scheme="secagg+")
    # Assert: their inputs are in the sum (their self masks rebuilt from the others' shares),
    # so the mean is exact over all ten
    assert coord.status == "completed", coord.stop_reason
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts), atol=10 * 2.0**-20)
    sa = RunDir(tmp_path / "run").read_metrics()[-1]["secure_aggregation"]
    assert (sa["scheme"], sa["neighbours"], sa["threshold"]) == ("secagg+", 6, 4), sa
    assert len(sa["survivors"]) == 10
    # no deadline passed (frozen clock): the two were seen to go and the unmasking ended
    assert sorted(sa["dropped"]) == ["client-3", "client-7"], sa


def test_too_few_survivors_abort_without_a_result(tmp_path: Path, monkeypatch) -> None:
    # Prepare: 4 clients (t = 2 of 3), three vanish after their masked input: one survivor
    # cannot reveal t shares of anybody
    _die_after_masked_input(monkeypatch, {"client-1", "client-2", "client-3"})
    # Execute
    coord = _run(tmp_path, [0.5, 1.0, -0.25, 2.0], failing=set(), min_clients=2)
    # Assert: the round aborted cleanly: no model update, nothing recorded as trained
    assert coord.status == "aborted"
    assert coord.completed_round == 0
    np.testing.assert_array_equal(coord.params["w"], np.zeros((50, 40), np.float32))
    event = coord.events[-1]["secure_aggregation"]
    assert "aborted" in event["aborted"] and event["survivors"] == []
    assert "too few" in coord.stop_reason


def test_an_abort_names_the_clients_that_withdrew(tmp_path: Path) -> None:
    # Prepare: three of four clients fail while training (a diverged model, say) and
    # withdraw; one masked input cannot be unmasked alone
    coord = _run(tmp_path, [0.5, 1.0, -0.25, 2.0], failing={1, 2, 3}, min_clients=2)
    # Assert: the abort says both what the protocol lacked and why: the withdrawals
    assert coord.status == "aborted"
    assert "secure aggregation aborted" in coord.stop_reason
    assert coord.stop_reason.endswith(
        "; in the last attempt client-1, client-2, client-3: "
        "secure aggregation: withdrew at masked input (local training failed)"
    ), coord.stop_reason


def test_a_site_that_declines_a_round_withdraws_before_the_key_stages(tmp_path: Path) -> None:
    import tomllib

    from fl_secure.config import config_from_dict
    from privacy.server_round import open_server_privacy

    # Prepare: local client-level noise; client-3's site ledger (kept across a restart)
    # already holds three updates for round 1 of this run, as many as the run config's
    # max_retries = 2 allows. (A
    # budget is held the same way in later rounds; one the first round would pass is
    # refused at join.) The clock is frozen: no deadline can end the round, only a withdrawal
    privacy = open_server_privacy(
        PrivacyConfig(unit="client", noise_placement="local", noise_multiplier=0.05),
        tmp_path / "ledger.sqlite", "secagg-test", rounds=1, population=4,
        clients_per_round=0, sample_rate=0.0, min_survivors=3,
    )  # fmt: skip
    secure = SecureAggregationConfig(clip_range=4.0)
    config = config_from_dict(tomllib.loads(_run_config(4, 3, secure, privacy)))
    site = SiteLedger(tmp_path / "site-3")
    for nonce in (b"x", b"y", b"z"):
        site.record(config, "secagg-test", 1, nonce * 16)
    # Execute
    coord = _run(tmp_path, [0.5, 1.0, -0.25, 2.0], set(), min_clients=3, privacy=privacy,
                 sites={3: site})  # fmt: skip
    # Assert: the round went on with the other three; client-3 sent nothing more and said why
    assert coord.status == "completed", coord.stop_reason
    assert coord.events[-1]["failed"] == {
        "client-3": "secure aggregation: withdrew at advertise keys "
        "(the site's own policy declined the round, such as its privacy budget)"
    }
    assert len(SiteLedger(tmp_path / "site-3").releases) == 3


def test_distributed_discrete_gaussian_noise_on_the_secure_sum(tmp_path: Path) -> None:
    # Prepare: client-level DP, distributed placement: every client clips to C = 1 and adds
    # discrete Gaussian noise to its integer vector; any t = 3 shares carry z C
    from privacy.dp.discrete_gaussian import ddg_client_sigma, integer_l2_bound

    z, d = 0.05, 50 * 40 + 7
    privacy = _distributed_dp(tmp_path, population=4, min_survivors=3, z=z)
    shifts = [0.5, 1.0, -0.25, 2.0]
    # Execute
    coord = _run(tmp_path, shifts, failing=set(), min_clients=3, privacy=privacy)
    # Assert: released = (sum of clipped updates + integer noise) / W, W = 4
    assert coord.status == "completed", coord.stop_reason
    clipped = sum(np.sign(s) / np.sqrt(d) for s in shifts)  # each update: norm C = 1
    released = np.concatenate([coord.params["w"].ravel(), coord.params["b"].ravel()])
    noise = released.astype(np.float64) - clipped / 4
    sigma = ddg_client_sigma(z, integer_l2_bound(1.0, 2.0**-20, d), 3) * 2.0**-20
    assert noise.std() == pytest.approx(np.sqrt(4) * sigma / 4, rel=0.1)
    assert abs(noise.mean()) < 5 * noise.std() / np.sqrt(d)
    entry = privacy.ledger.last("client_level") if privacy else None
    assert entry is not None and entry.payload["noise_distribution"] == "discrete_gaussian"


def test_a_sum_with_too_few_noise_shares_is_never_unmasked(tmp_path: Path) -> None:
    # Prepare: distributed discrete Gaussian over 6 clients, noise split so that any 5
    # shares carry z C; two clients fail while training, so 4 masked inputs arrive: enough
    # for the protocol (t = 3, t + 1 = 4), too few noise shares for the accounting
    privacy = _distributed_dp(tmp_path, population=6, min_survivors=5)
    # Execute
    coord = _run(tmp_path, [0.5] * 6, failing={4, 5}, min_clients=5, privacy=privacy)
    # Assert: the attempt aborted when the masked inputs closed, before any share was asked
    # for: the server never held the under-noised sum, and nothing entered the ledger
    assert coord.status == "aborted"
    assert "only 4 clients sent masked inputs; the round needs at least 5" in coord.stop_reason
    assert "before any share is revealed" in coord.stop_reason
    assert privacy is not None and privacy.ledger.last("client_level") is None


@pytest.mark.parametrize("distributed", [False, True], ids=["fixed_point", "ddg"])
def test_a_masked_input_that_is_not_an_encoding_aborts_the_attempt(
    tmp_path: Path, monkeypatch, distributed: bool
) -> None:
    # Prepare: client-2 uploads random words instead of its masked input: well-formed, so
    # the protocol unmasks it, but the sum is no sum of clipped (noised) inputs
    import privacy.secagg.client_round as session

    real = session.client_secure_update

    def garbage(setup, client_id, identity, registry, exchange, compute, upload):
        def upload_garbage(vector: np.ndarray) -> None:
            words = np.frombuffer(os.urandom(vector.nbytes), dtype=vector.dtype)
            upload(words & np.asarray((1 << setup.modulus_bits) - 1, dtype=vector.dtype))

        bad = upload_garbage if client_id == "client-2" else upload
        return real(setup, client_id, identity, registry, exchange, compute, bad)

    monkeypatch.setattr(session, "client_secure_update", garbage)
    privacy = None
    if distributed:
        privacy = _distributed_dp(tmp_path, population=4, min_survivors=3)
    # Execute
    coord = _run(
        tmp_path, [0.5, 1.0, -0.25, 2.0], failing=set(), min_clients=3, privacy=privacy,
        max_retries=2,
    )  # fmt: skip
    # Assert: the round aborts instead of the error escaping the server's round loop, and
    # is not retried although retries are allowed: the server had unmasked that sum, and
    # one faulty client could force release after release
    assert coord.status == "aborted", coord.status
    assert "the sum is corrupted" in coord.stop_reason
    assert "not retried" in coord.stop_reason
    assert [e["attempt"] for e in coord.events if e.get("round") == 1] == [0]
    assert coord.completed_round == 0
    np.testing.assert_array_equal(coord.params["w"], np.zeros((50, 40), np.float32))
    if privacy is not None:  # the sum the server saw counts like a round; no round done
        entries = privacy.ledger.entries()
        assert [(e.kind, e.round) for e in entries] == [("discarded_sum", 1), ("note", 1)]
        assert entries[0].payload["updates"] == 4 and entries[0].payload["cohort_size"] == 4
        assert privacy.epsilon == entries[0].payload["epsilon"] > 0
        assert "counted in epsilon like a round" in entries[1].payload["message"]


@pytest.mark.slow
def test_ten_client_processes_two_killed_9_after_their_masked_input(tmp_path: Path) -> None:
    # Prepare: a real server over mTLS and ten client *processes* (SecAgg+, 6 neighbours,
    # t = 4); client-3 and client-7 hang right after uploading their masked input and are
    # then killed with SIGKILL, before they reveal any share
    shifts = [0.1 * (i + 1) for i in range(10)]
    # the coordinator's clock never moves: only the closed connections can end the unmasking
    coord, server, port, certs = _serve(
        tmp_path, 10, min_clients=10, round_timeout=120.0, stage_timeout=20,
        neighbours=6, scheme="secagg+", clock=_frozen,
    )  # fmt: skip
    # Execute: kill -9 each dying client once its masked input is on the server
    dying = {3: (["--die"], "masked"), 7: (["--die"], "masked")}
    codes, logs = run_client_processes(coord, server, port, certs, tmp_path, shifts, dying)
    # Assert: the round completed over all ten inputs (the killed clients' self masks rebuilt
    # from the survivors' shares): the mean is exact to the fixed-point resolution
    assert coord.status == "completed", (coord.stop_reason, logs)
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts), atol=10 * 2.0**-20)
    np.testing.assert_allclose(coord.params["b"], np.mean(shifts), atol=10 * 2.0**-20)
    sa = RunDir(tmp_path / "run").read_metrics()[-1]["secure_aggregation"]
    assert (sa["scheme"], sa["neighbours"], sa["threshold"]) == ("secagg+", 6, 4), sa
    assert len(sa["survivors"]) == 10
    assert sa["dropped"] == {"client-3": "consistency check", "client-7": "consistency check"}, sa
    assert sa["left"] == ["client-3", "client-7"], sa
    assert codes == [0] * 8, logs  # the eight others finished normally


def _ckks_initial() -> Tensors:
    # 9000 + 7 values: "w" spans three ciphertexts of 4096 slots (N = 8192)
    return OrderedDict([("w", np.zeros((90, 100), np.float32)), ("b", np.zeros(7, np.float32))])


def test_ckks_round_decrypts_the_mean_of_the_cohort(tmp_path: Path) -> None:
    # Prepare: 4 clients, CKKS; client-3 dies while training
    shifts = [0.5, 1.0, -0.25, 2.0]
    # Execute
    coord = _run(tmp_path, shifts, failing={3}, scheme="ckks", initial=_ckks_initial())
    # Assert: the decrypted mean of the three survivors, to CKKS precision (float32 rounding)
    assert coord.status == "completed", coord.stop_reason
    expected = np.mean(shifts[:3])
    for name in ("w", "b"):
        np.testing.assert_allclose(coord.params[name], expected, rtol=1e-6)
    sa = RunDir(tmp_path / "run").read_metrics()[-1]["secure_aggregation"]
    assert sa["scheme"] == "ckks" and sa["survivors"] == ["client-0", "client-1", "client-2"]
    failed = coord.events[-1]["failed"]  # seen at once: the clock never moves
    assert failed == {
        "client-3": "secure aggregation: withdrew at masked input (local training failed)"
    }
    assert sa["ciphertexts"] == 3 and sa["encrypted_layers"] == "all"
    assert len(sa["decryptors"]) == 2 and set(sa["decryptors"]) <= set(sa["survivors"])


def test_ckks_encrypts_the_configured_layers_only(tmp_path: Path) -> None:
    coord = _run(
        tmp_path, [0.5, 1.5], failing=set(), scheme="ckks", initial=_ckks_initial(),
        ckks_layers=("w",),
    )  # fmt: skip
    assert coord.status == "completed", coord.stop_reason
    np.testing.assert_allclose(coord.params["w"], 1.0, rtol=1e-6)
    np.testing.assert_array_equal(coord.params["b"], np.full(7, 1.0, np.float32))
    sa = RunDir(tmp_path / "run").read_metrics()[-1]["secure_aggregation"]
    assert sa["encrypted_layers"] == ["w"] and sa["ciphertexts"] == 3


def test_ckks_decryptors_that_disagree_abort_the_round(tmp_path: Path, monkeypatch) -> None:
    # Prepare: every client adds its own offset to the sum it decrypts (a lying decryptor)
    import privacy.ckks.client_round as cs

    real = cs.decrypt_sum

    def lying(total, secret, **kw):
        out = real(total, secret, **kw)
        return OrderedDict(
            (k, v + np.float32(np.random.default_rng().random())) for k, v in out.items()
        )

    monkeypatch.setattr(cs, "decrypt_sum", lying)
    # Execute
    coord = _run(tmp_path, [0.5, 1.0, 1.5], failing=set(), scheme="ckks", initial=_ckks_initial())
    # Assert: no model update; the reason names the disagreement
    assert coord.status == "aborted"
    np.testing.assert_array_equal(coord.params["w"], np.zeros((90, 100), np.float32))
    assert "different sums" in coord.events[-1]["secure_aggregation"]["aborted"]


def test_bad_attend_and_withdraw_messages_are_refused_and_a_withdrawal_is_honoured(
    tmp_path: Path,
) -> None:
    # Prepare: SecAgg over 4 clients (t = 2) on a clock that never moves; client-3 is a raw
    # gRPC stub that takes its task and never advertises keys
    import grpc

    from client.transport import open_channel
    from fl_secure import __version__
    from fl_secure.v1 import transport_pb2 as pb
    from fl_secure.v1 import transport_pb2_grpc as pb_grpc

    shifts = [0.5, 1.0, -0.25]
    coord, server, port, certs = _serve(
        tmp_path, 4, min_clients=3, round_timeout=60.0, stage_timeout=10, clock=_frozen
    )
    driver = threading.Thread(target=coord.run, daemon=True)
    driver.start()
    channel = open_channel(Connection(f"localhost:{port}", "client-3", cert_dir=certs))
    stub = pb_grpc.FlSecureStub(channel)
    stub.Join(pb.JoinRequest(software_version=__version__, num_examples=1), timeout=10)
    for i, shift in enumerate(shifts):
        trainer = ShiftTrainer(shift)
        client = FlClient(
            Connection(f"localhost:{port}", f"client-{i}", cert_dir=certs),
            lambda reply, t=trainer: t,  # type: ignore[misc]
            max_wait=20.0,
        )
        threading.Thread(target=lambda c=client: _quiet(c.run), daemon=True).start()
    task = stub.PollTask(pb.PollRequest(last_round=0), timeout=30)
    while task.kind != pb.TASK_KIND_TRAIN:
        task = stub.PollTask(pb.PollRequest(last_round=0), timeout=30)

    def message(stage: int, nonce: bytes = task.nonce, reason: int = 0) -> pb.SecAggMessage:
        return pb.SecAggMessage(round=task.round, nonce=nonce, stage=stage, withdraw_reason=reason)  # type: ignore[arg-type]

    try:
        # Execute: a withdrawal with another nonce, a second attendance call, stages 0 and
        # 9, then a withdrawal whose reason this server does not know (a newer client's)
        attend = stub.SecAggExchange.future(message(pb.SECAGG_STAGE_ATTEND), timeout=60)
        refused = []
        for request in (
            message(pb.SECAGG_STAGE_WITHDRAW, nonce=bytes(16)),
            message(pb.SECAGG_STAGE_ATTEND),
            message(pb.SECAGG_STAGE_UNSPECIFIED),
            message(9),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                stub.SecAggExchange(request, timeout=30)
            refused.append((caught.value.code(), caught.value.details()))
        stub.SecAggExchange(message(pb.SECAGG_STAGE_WITHDRAW, reason=99), timeout=30)
        driver.join(timeout=120)
        ended = attend.result(timeout=30)  # answered when the round ended
    finally:
        channel.close()
        server.stop(grace=None)
    # Assert: all four refused with the reason; the round finished without client-3 (its
    # withdrawal closed the advertise stage, no deadline could) over the three others' mean
    assert refused[0] == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"client client-3 holds no task of round {task.round}",
    )
    assert refused[1] == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"client client-3 already attends round {task.round}",
    )
    assert refused[2:] == [
        (grpc.StatusCode.INVALID_ARGUMENT, f"unknown secure-aggregation stage {stage}")
        for stage in (0, 9)
    ]
    assert ended.stage == pb.SECAGG_STAGE_ATTEND
    assert coord.status == "completed", coord.stop_reason
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts), atol=4 * 2.0**-20)
    sa = RunDir(tmp_path / "run").read_metrics()[-1]["secure_aggregation"]
    assert sa["survivors"] == ["client-0", "client-1", "client-2"]
    assert sa["dropped"] == {"client-3": "advertise keys"} and sa["left"] == ["client-3"]
    failed = coord.events[-1]["failed"]  # the unknown reason reads as none
    assert failed == {"client-3": "secure aggregation: withdrew at advertise keys"}


def test_withdraw_reasons_match_the_wire_enum_and_classify_local_failures() -> None:
    import grpc

    from client.secure_round import withdraw_reason
    from fl_secure.errors import PrivacyError, ProtocolError, RoundAborted, UpdateError
    from fl_secure.v1 import transport_pb2 as pb
    from privacy.secagg.stages import WITHDRAW_REASONS

    # the server's wording covers exactly the proto's numbers, and only "none" is empty
    assert sorted(WITHDRAW_REASONS) == sorted(pb.WithdrawReason.values())
    assert [n for n, text in WITHDRAW_REASONS.items() if not text] == [
        pb.WITHDRAW_REASON_UNSPECIFIED
    ]

    class _Rpc(grpc.RpcError):
        pass

    cases = [
        (UpdateError("NaN"), True, pb.WITHDRAW_REASON_UPDATE_REFUSED),  # raised in training
        (UpdateError("NaN"), False, pb.WITHDRAW_REASON_UPDATE_REFUSED),
        (RuntimeError("crash"), True, pb.WITHDRAW_REASON_LOCAL_TRAINING),
        (_Rpc(), False, pb.WITHDRAW_REASON_TRANSPORT),
        (RoundAborted("only 1 neighbours"), False, pb.WITHDRAW_REASON_TOO_FEW_SHARES),
        (ProtocolError("truncated list"), False, pb.WITHDRAW_REASON_MESSAGE_REFUSED),
        (PrivacyError("share failed authentication"), False, pb.WITHDRAW_REASON_MESSAGE_REFUSED),
        (KeyError("x"), False, pb.WITHDRAW_REASON_OTHER),
    ]
    assert [withdraw_reason(exc, t) for exc, t, _ in cases] == [want for *_, want in cases]
