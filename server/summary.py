"""``summary.json``: the final figures of a run."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from fl_secure import __version__
from fl_secure.evaluation import per_client_summary
from fl_secure.models.pretrained import pretrained_provenance
from fl_secure.training import HEADLINE
from server.run_files import starts_of

if TYPE_CHECKING:
    from pathlib import Path

    from fl_secure.algorithms import Strategy
    from fl_secure.config import Config
    from fl_secure.data.plan import FederatedData
    from server.coordinator import Coordinator


def build_summary(
    config: Config,
    coordinator: Coordinator,
    strategy: Strategy,
    plan: FederatedData,
    *,
    started: float,
    clients_hold_the_plan: bool = True,
) -> dict[str, Any]:
    """Held-out figures of the final model, per-client figures and their spread, run facts.

    ``clients_hold_the_plan``: the clients trained on the config's federation plan (embedded
    mode, where the server spawned them on it). A standalone server (``fl-secure server``)
    passes False: its sites hold their own data, so the plan's per-client sizes and
    identities describe nobody, and the held-out set is only the server's own [data].
    """
    # completed rounds only: a record with a "kind" is something else (a failed attempt)
    metrics = [m for m in coordinator.run_dir.read_metrics() if "kind" not in m]
    trained = [m for m in metrics if int(m.get("round", 0)) > 0]
    final = trained[-1].get("held_out", {}) if trained else {}
    round0 = [m for m in metrics if m.get("round") == 0]
    untrained: dict[str, float] = round0[0].get("held_out", {}) if round0 else {}
    untrained_clients = round0[0].get("clients", {}) if round0 else {}
    per_client = coordinator.final_client_metrics
    summary: dict[str, Any] = {
        "status": coordinator.status,
        "reason": coordinator.stop_reason,
        "rounds_completed": coordinator.completed_round,
        "rounds_planned": config.train.rounds,
        "algorithm": strategy.name,
        "exposure": strategy.exposure,
        "evaluation": _evaluation(config, strategy, clients_hold_the_plan),
        # the population: every enrolled client (the ledger's, and delta's 1/N, too)
        "num_clients": len(coordinator.enrolled),
        "partition": config.partition.kind,  # the config's; a standalone server's sites may
        # hold the plan's shares (client --config --plan-index) or their own data (--data)
        **(
            {
                "client_train_sizes": plan.client_sizes(),
                # which client id trained on which share of the plan (the audit's ground truth)
                "client_plan": plan.client_plan(),
                "client_identities": [int(len(c.train.identities())) for c in plan.clients],
            }
            if clients_hold_the_plan
            else {
                "client_train_sizes": None,
                "client_identities": None,
                # what each site said at join (1 under DP: the count stays home)
                "client_reported_examples": coordinator.reported_examples(),
            }
        ),
        "held_out_identities": int(len(plan.held_out.identities())),
        "held_out_images": len(plan.held_out),
        **{k: final[k] for k in HEADLINE if k in final},
        "held_out": final,
        "untrained": untrained,  # round 0: the initial model (pretrained if model.pretrained)
        "initial_model": f"pretrained (model.pretrained = {config.model.pretrained})"
        if config.model.pretrained
        else "untrained (random initialisation)",
        "untrained_clients_summary": (
            per_client_summary(untrained_clients) if untrained_clients else {}
        ),
        "clients": per_client,
        "clients_summary": per_client_summary(per_client) if per_client else {},
        # the server checks the rates are in [0, 1] and nothing else: a client could report
        # any figure of its own test images, so the headline figures are the held-out ones
        "clients_self_reported": True,
        **_privacy(coordinator),
        "secure_aggregation": _secure_aggregation(config, metrics, heads=strategy.uploads_head),
        "version": __version__,
        "duration_s": round(time.time() - started, 1),
        "provenance": {
            **provenance(started, _recorded_starts(coordinator.run_dir.path)),
            # the bytes the backbone started from (SHA-256), if model.pretrained
            "pretrained": pretrained_provenance(config.model.pretrained),
        },
    }
    return summary


def _evaluation(config: Config, strategy: Strategy, clients_hold_the_plan: bool) -> str:
    """What the held-out figures were measured on, in words."""
    what = (
        "expression accuracy of the relation scores against support prototypes"
        if strategy.evaluates_expressions
        else "all pairs"
    )
    if clients_hold_the_plan:
        return f"held-out identities (never seen by any client), {what}"
    return (
        f"the server's own evaluation set: held-out identities of its [data] config "
        f"(source {config.data.source!r}), {what}; the sites trained on their own data, which "
        "the server never sees, so it cannot check that they hold none of these identities"
    )


#: Packages whose versions a report states (provenance).
PACKAGES = ("torch", "torchvision", "numpy", "opacus", "dp-accounting", "tenseal",
            "cryptography", "grpcio", "protobuf", "safetensors")  # fmt: skip


def _recorded_starts(run_path: Path) -> list[str]:
    """The server's starts on this run as ``partition.json`` records them (first, resumes).

    None recorded when the record cannot be read: the summary is still written, with this
    start.
    """
    try:
        record = json.loads((run_path / "partition.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return starts_of(record) if isinstance(record, dict) else []


def provenance(started: float, starts: list[str] | None = None) -> dict[str, Any]:
    """Project version and commit, package versions, start and end times (UTC).

    ``starts``: the server's recorded starts on the run; the first is the run's start, the
    others its resumes (``resumed_at``). Without them, ``started`` is the start.
    """
    import subprocess
    from datetime import UTC, datetime
    from importlib import metadata
    from pathlib import Path

    def when(t: float) -> str:
        return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")

    commit = None
    root = Path(__file__).resolve().parents[1]
    if (root / ".git").exists():
        try:
            out = subprocess.run(  # noqa: S603 - fixed arguments, no shell
                ["git", "-C", str(root), "rev-parse", "HEAD"],  # noqa: S607
                capture_output=True, text=True, timeout=10, check=True,
            )  # fmt: skip
            commit = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    packages: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    return {
        "version": __version__,
        "commit": commit,
        "packages": packages,
        "started_at": starts[0] if starts else when(started),
        "resumed_at": starts[1:] if starts else [],
        "ended_at": when(time.time()),
    }


def _privacy(coordinator: Coordinator) -> dict[str, Any]:
    """The run's (epsilon, delta) statement, or an explicit "no DP"."""
    if coordinator.privacy is None:
        return {
            "epsilon": None,
            "delta": None,
            "accountant": None,
            "privacy_unit": "none",
            "noise_placement": None,
        }
    statement = coordinator.privacy.summary()
    return {
        **{
            k: statement[k]
            for k in ("epsilon", "delta", "accountant", "privacy_unit", "noise_placement")
        },
        "privacy": statement,
    }


def _secure_aggregation(
    config: Config, metrics: list[dict[str, Any]], *, heads: bool = False
) -> dict[str, Any]:
    """Scheme and, per trained round, how many clients were in the unmasked sum."""
    sa = config.secure_aggregation
    if not sa.enabled:  # server-sees-heads designs (FedGC) are refused with secure aggregation
        sees = "every client's update and class embeddings" if heads else "every client's update"
        return {"scheme": "none", "server_sees": sees}
    rounds = [m["secure_aggregation"] for m in metrics if "secure_aggregation" in m]
    per_round = {
        "survivors_per_round": [len(r["survivors"]) for r in rounds],
        "threshold_per_round": [r["threshold"] for r in rounds],
    }
    if sa.scheme == "ckks":
        return {
            "scheme": "ckks",
            "server_sees": "CKKS ciphertexts of every update and the sum decrypted by clients "
            "(any one client colluding with the server can decrypt every update)"
            + (
                f"; the shared layers outside ckks_layers {list(sa.ckks_layers)} of every "
                "update in the clear"
                if sa.ckks_layers
                else ""
            ),
            "encrypted_layers": list(sa.ckks_layers) or "all",
            "decryptors": sa.ckks_decryptors,
            "flooding_bits": sa.ckks_flooding_bits,
            **per_round,
        }
    return {
        "scheme": sa.scheme,
        "server_sees": "only the sum of the surviving clients' masked updates",
        # what holds if the server deviates from the protocol (docs/secure-aggregation.md)
        "malicious_server": (
            "no one client's masked input can be unmasked, even by a server that deviates "
            "from the protocol, while at most corrupt_fraction "
            f"{sa.corrupt_fraction:g} of a cohort colludes with it: a client reveals shares "
            "only once more than (n + c) / 2 of the cohort signed the same survivor set "
            "(consistency check); it can still choose which clients are in the sum, abort "
            "rounds and return a wrong model"
        ),
        "modulus_bits": sa.modulus_bits,
        "clip_range": sa.clip_range,
        "scale_bits": sa.scale_bits,
        **per_round,
    }
