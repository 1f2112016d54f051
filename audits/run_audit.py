"""``fl-secure audit``: attack a run's views, write ``RUN/audit/results.json``, say what it found.

For a run directory :func:`audit_run`

1. builds each party's view (:mod:`audits.observations`),
2. picks ``N`` target identities among the training identities of the clients other than the
   curious one, and trains the judge's evaluator on the targets' own training images (the
   attacker never sees them; :mod:`audits.targets`, :mod:`audits.judge`),
3. **inversion**: reconstructs each target from the view's class embedding of it, or from
   surrogates where the view holds none (:mod:`audits.attacks.inversion`),
4. **templates**: identifies the exposed head rows against embeddings of the targets' images
   (:mod:`audits.attacks.templates`),
5. **leakage**: recovers the inputs of the backbone's fully connected embedding layer from a
   rebuilt single-client update (no secure aggregation) and from the secure sum
   (:mod:`audits.attacks.leakage`),
6. **canary**: the empirical epsilon of the run's client-level mechanism, beside the
   accountant's epsilon (:mod:`audits.attacks.canary`),

and writes the results with the audit's :func:`findings` (what a reader must not miss) into
``RUN/audit/results.json``; :func:`summary_lines` is what the command prints of them.

Only the inversion attack uses public faces: an audit without it loads none, and so runs on
a run without held-out identities.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from audits.attacks.canary import canary_attack
from audits.attacks.inversion import (
    attacker_prior,
    cached_evaluator,
    inversion_attack,
    public_faces,
)
from audits.attacks.leakage import leakage_attack
from audits.attacks.templates import templates_attack
from audits.canary import clopper_pearson_interval
from audits.inversion import InversionConfig, fit_face_prior
from audits.judge import EvaluatorConfig
from audits.observations import (
    RunContext,
    check_auditable,
    choose_targets,
    load_run,
    observations,
    threat_model,
)
from audits.results import chance_text, ci_text, table_rows
from audits.targets import target_data
from fl_secure.config import load_config
from fl_secure.errors import CheckpointError, ConfigError
from fl_secure.runs import RunDir, atomic_write_json

ATTACKS = ("inversion", "templates", "leakage", "canary")


@dataclass(frozen=True)
class AuditSettings:
    """What to run and how hard."""

    attacks: tuple[str, ...] = ATTACKS
    targets: int = 10
    steps: int = 200  # Adam steps of each inversion
    restarts: int = 4
    prior_components: int = 64
    evaluator_epochs: int = 30
    include_images: bool = False  # grids of real (non-synthetic) faces
    public_dir: Path | None = None  # identity folders of public faces (default: held-out)
    public_center_crop: int = 0  # centre crop of the public faces before resizing (LFW: 150)
    canaries: int | None = None  # None: sized to test the run's claim (mechanism_audit.audit_size)
    trials: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        """Reject unknown attacks and sizes that cannot run."""
        allowed = ", ".join(ATTACKS)
        if not self.attacks:
            raise ConfigError(f"--attack names no attack; allowed: {allowed}")
        unknown = sorted(set(self.attacks) - set(ATTACKS))
        if unknown:
            raise ConfigError(f"unknown attack {', '.join(unknown)}; allowed: {allowed}")
        for name, value, low in (
            ("--targets", self.targets, 2),
            ("--steps", self.steps, 1),
            ("restarts", self.restarts, 1),
            ("--canary-trials (canaries)", self.canaries, 1),
            ("--canary-trials", self.trials, 2),
            ("--seed", self.seed, 0),
        ):
            if value is not None and value < low:
                raise ConfigError(f"{name} = {value}: need {name} >= {low}")


def audit_run(
    run_dir: Path,
    settings: AuditSettings | None = None,
    *,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Attack every view of the run; write ``audit/results.json`` (and grids); return it.

    The audit holds the run (:meth:`RunDir.held`) from loading it to writing its results: a
    server still training it would move the checkpoint under the attack, and two audits
    would write one ``audit/`` folder.

    Raises:
        CheckpointError: another process (a training server, another audit) holds the run.
    """
    started = time.perf_counter()
    run_dir = Path(run_dir)
    # The refusals that need no lock come first: no lock file in a folder that is no run
    if not (run_dir / "config.toml").is_file():
        raise CheckpointError(f"{run_dir} is not a run directory (no config.toml)")
    check_auditable(load_config(run_dir / "config.toml").algorithm.name)
    with RunDir(run_dir).held():
        return _audit_held(load_run(run_dir), settings or AuditSettings(), started, progress, log)


def _audit_held(
    run: RunContext,
    cfg: AuditSettings,
    started: float,
    progress: bool,
    log: Callable[[str], None] | None,
) -> dict[str, Any]:
    """:func:`audit_run` once this process holds the run directory."""
    out = run.path / "audit"
    out.mkdir(parents=True, exist_ok=True)
    # a prior fitted on --public faces (identity folders: real faces) shapes every
    # reconstruction, so its grids are real-face material even for a synthetic run
    real_prior = cfg.public_dir is not None
    synthetic = run.config.data.source == "synthetic" and not real_prior
    grids = synthetic or cfg.include_images
    identities = choose_targets(run, cfg.targets)
    tg = target_data(run, identities)
    views = observations(run, identities)
    wants = set(cfg.attacks)
    stages = (
        (["evaluator"] if wants & {"inversion"} else [])
        + [
            f"{a}:{v.party}"
            for a in ("inversion", "templates", "leakage")
            if a in wants
            for v in views
        ]
        + (["canary"] if "canary" in wants else [])
    )
    bar = tqdm(total=len(stages), desc="audit", disable=not progress, unit="stage")
    attacks: dict[str, Any] = {}
    # only inversion uses public faces (its prior and surrogate): the other attacks run on a
    # run without held-out identities and without --public
    prior_text: dict[str, Any] = {
        "public_faces": None,
        "from_real_faces": False,
        "prior": "none: only the inversion attack uses public faces, and it was not run",
    }
    prior_components = None
    if "inversion" in wants:
        public, public_text = public_faces(run, cfg.public_dir, cfg.public_center_crop)
        prior = fit_face_prior(public, components=cfg.prior_components)
        prior_components = prior.basis.shape[0]
        prior_text = attacker_prior(public_text, prior_components, real_prior, run.model.backbone)
        bar.set_postfix_str("training the judge's evaluator")
        evaluator = cached_evaluator(
            tg.private.images, tg.private.labels, EvaluatorConfig(epochs=cfg.evaluator_epochs)
        )
        bar.update()
        inversion = InversionConfig(
            steps=cfg.steps, restarts=cfg.restarts, prior="subspace", seed=cfg.seed
        )
        done: dict[str, dict[str, Any]] = {}
        attacks["inversion"] = {}
        for view in views:
            bar.set_postfix_str(f"inversion, {view.party}")
            if view.inversion_key not in done:
                done[view.inversion_key] = inversion_attack(
                    run, view, tg, evaluator, prior, public, inversion, out, grids,
                    on_step=bar.set_postfix_str,
                )  # fmt: skip
                result = done[view.inversion_key]
            else:
                result = {**done[view.inversion_key], "same_as_view_of": "server"}
            attacks["inversion"][view.party] = {**result, "attacked_view": view.holder}
            bar.update()
    if "templates" in wants:
        attacks["templates"] = {}
        for view in views:
            attacks["templates"][view.party] = templates_attack(run, view, tg)
            bar.update()
    if "leakage" in wants:
        attacks["leakage"] = {}
        for view in views:
            bar.set_postfix_str(f"leakage, {view.party}")
            attacks["leakage"][view.party] = leakage_attack(run, view, seed=cfg.seed)
            bar.update()
    if "canary" in wants:
        bar.set_postfix_str("canary audit")
        attacks["canary"] = canary_attack(
            run, canaries=cfg.canaries, trials=cfg.trials, seed=cfg.seed
        )
        bar.update()
    bar.close()
    results: dict[str, Any] = {
        "run": str(run.path),
        "algorithm": run.strategy.name,
        "exposure": run.exposure,
        "data_source": run.config.data.source,
        "checkpoint_round": run.checkpoint.round,
        "secure_aggregation": run.secure_aggregation,
        "privacy_unit": run.privacy_unit,
        "epsilon": run.summary.get("epsilon"),
        "delta": run.summary.get("delta"),
        "threat_model": threat_model(run),
        "views": [v.to_dict() for v in views],
        "targets": {
            "count": len(identities),
            "requested": cfg.targets,  # fewer when fewer identities are outside client 0
            "identities": identities,
            "chosen": "training identities of the clients other than the curious client, "
            "round-robin over the clients",
            "private_images": len(tg.private),
            "gallery_images": len(tg.gallery),
        },
        "attacker_prior": prior_text,
        "judge": {
            "evaluator": "cnn-small + CosFace (images averaged down to at most "
            f"{EvaluatorConfig().max_image_size} px), trained only on the targets' own training "
            f"images ({len(tg.private)}), which the attacker never sees; chance = 1 / targets for "
            "top-1 (95% Clopper-Pearson interval beside it); for KNN distance, SSIM and PSNR, "
            "chance = the same measure against every other target's nearest private image",
        },
        "settings": {
            "steps": cfg.steps,
            "restarts": cfg.restarts,
            "prior_components": prior_components,  # null: no inversion, no prior
            "evaluator_epochs": cfg.evaluator_epochs,
            "seed": cfg.seed,
        },
        "attacks": attacks,
        "images": "grids written" if grids else "no grids: real faces (use --include-images)",
        "duration_s": round(time.perf_counter() - started, 1),
    }
    # what the audit concluded, as it concluded it (a reader of results.json alone sees it;
    # the report recomputes them from the numbers and says so if they differ)
    results["findings"] = findings(results)
    atomic_write_json(out / "results.json", results)
    if log is not None:
        log(f"wrote {out / 'results.json'}")
    # Grids of an earlier audit that this one did not write (another --attack subset or
    # --targets) would sit beside results that do not describe them: remove them.
    written = {entry["grid"] for entry in _inversion_entries(results) if "grid" in entry}
    for stale in sorted(out.glob("inversion-*.png")):
        if stale.name not in written:
            stale.unlink()
            if log is not None:
                log(f"removed {stale} (an earlier audit's grid)")
    return results


def _inversion_entries(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every per-direction entry of the inversion attack (each may name its grid)."""
    return [
        entry
        for view in results["attacks"].get("inversion", {}).values()
        for entry in view.values()
        if isinstance(entry, dict)
    ]


def findings(results: dict[str, Any]) -> list[dict[str, str]]:
    """What a reader of the audit must not miss, as report warnings (``code``, ``message``).

    An attack is flagged when the lower end of its 95% Clopper-Pearson interval lies above
    chance: the attacker identified faces from that view, and it is not luck at that
    confidence. An empirical epsilon above the accountant's upper bound is flagged too: one
    of them is wrong, so the stated guarantee cannot be relied on.
    """
    found: dict[str, list[str]] = {}
    attacks = results.get("attacks", {})

    def above_chance(ci: Sequence[float] | None, chance: float) -> bool:
        return ci is not None and ci[0] > chance

    for row in table_rows(results):
        if above_chance(row["top1_ci95"], row["chance"]):
            found.setdefault("audit-inversion-identifies", []).append(
                f"{row['party']} view ({row['direction']}): top-1 {row['top1']:.2f}"
                f"{ci_text(row['top1_ci95'])} vs chance {row['chance']:.2f}"
            )
    for party, res in sorted(attacks.get("templates", {}).items()):
        if res.get("applicable") and above_chance(res.get("top1_ci95"), res["chance"]):
            found.setdefault("audit-templates-identify", []).append(
                f"{party} view: top-1 {res['top1']:.2f}{ci_text(res['top1_ci95'])} vs chance "
                f"{res['chance']:.2f}"
            )
    for party, res in sorted(attacks.get("leakage", {}).items()):
        one = res.get("single_client_one_image") if res.get("applicable") else None
        if one and one.get("clients"):
            n = int(one["clients"])  # results written before the interval was recorded:
            ci = one.get("top1_ci95") or clopper_pearson_interval(round(one["top1"] * n), n)
            if above_chance(ci, one["chance"]):
                found.setdefault("audit-update-leaks", []).append(
                    f"{party} view: top-1 {one['top1']:.2f}{ci_text(ci)} vs chance "
                    f"{one['chance']:.3f}"
                )
    canary = attacks.get("canary") or {}
    if canary.get("exceeds_accountant"):
        found["audit-exceeds-accountant"] = [
            f"empirical epsilon >= {canary['epsilon_lower_bound']:.3f} against the "
            f"accountant's {canary['accountant_epsilon']:.3f}"
        ]
    if canary.get("can_test_accountant") is False:
        found["audit-cannot-test-accountant"] = [
            f"no outcome of this audit can show more than "
            f"{canary['largest_bound_this_audit_can_show']:.3f}, below the accountant's "
            f"{canary['accountant_epsilon']:.3f}; {_trials_that_test(canary)}"
        ]
    lead = {
        "audit-inversion-identifies": "Model inversion produced faces that the independent "
        "judge identified above chance (95% interval)",
        "audit-templates-identify": "The class embeddings in the shared head identify their "
        "identities above chance (95% interval)",
        "audit-update-leaks": "One client's update gave away the face features of its input, "
        "identified above chance (95% interval)",
        "audit-exceeds-accountant": "The empirical epsilon lower bound exceeds the "
        "accountant's upper bound: the accounting or the mechanism as implemented is wrong "
        "(or, at 5% odds, the audit erred), and the stated guarantee cannot be relied on",
        "audit-cannot-test-accountant": "The canary audit could not test the "
        "accountant's epsilon: even a mechanism with no noise would not have been flagged",
    }
    return [
        {"code": code, "message": f"{lead[code]}: " + "; ".join(items) + "."}
        for code, items in found.items()
    ]


def _trials_that_test(canary: dict[str, Any]) -> str:
    """How large a canary audit would test the accountant's epsilon, as the finding says it."""
    needed = canary.get("trials_to_test_accountant")
    if needed is not None:
        return f"--canary-trials {needed} can"
    if not math.isfinite(canary["accountant_epsilon"]):
        return "no audit can: an infinite epsilon bounds nothing"
    beyond = canary.get("trials_to_test_accountant_more_than")
    return f"no audit of up to {beyond:,} trials can" if beyond else "no practical audit can"


def summary_lines(results: dict[str, Any]) -> list[str]:
    """What ``fl-secure audit`` prints: each attack that ran, per party, beside chance."""
    attacks = results["attacks"]
    lines = []
    for row in table_rows(results):
        lines.append(
            f"{row['party']:>15}: inversion top-1 {row['top1']:.2f}{ci_text(row['top1_ci95'])} "
            f"(chance {row['chance']:.2f}, {row['direction']}), KNN distance "
            f"{row['knn_distance']:.3f}{chance_text(row['chance_knn_distance'])}, SSIM "
            f"{row['ssim']:.3f}{chance_text(row['chance_ssim'])}"
        )

    def servers_first(item: tuple[str, Any]) -> tuple[bool, str]:
        return item[0] != "server", item[0]

    for party, res in sorted(attacks.get("templates", {}).items(), key=servers_first):
        if res["applicable"]:
            lines.append(
                f"{party:>15}: head templates identified, top-1 {res['top1']:.2f}"
                f"{ci_text(res.get('top1_ci95'))} (chance {res['chance']:.2f})"
            )
        else:
            lines.append(f"{party:>15}: head templates: {res['why']}")
    for party, res in sorted(attacks.get("leakage", {}).items(), key=servers_first):
        if not res.get("applicable"):
            lines.append(f"{party:>15}: update leakage: {res.get('why', 'not applicable')}")
            continue
        one = res.get("single_client_one_image")
        if one:
            lines.append(
                f"{party:>15}: one client's update -> its input recovered (1 - cosine "
                f"{one['mean_one_minus_cosine_to_truth']:.1e}), identified top-1 "
                f"{one['top1']:.2f}{ci_text(one.get('top1_ci95'))} (chance {one['chance']:.3f})"
            )
        total = res["secure_sum_one_image_each"]
        lines.append(
            f"{party:>15}: sum of {total['clients']} one-image updates (rank {total['rank']}) -> "
            f"participants named {total['participant_precision']:.2f} (span "
            f"{total['by_attack']['span']:.2f}, row ratios {total['by_attack']['row_ratios']:.2f};"
            f" from the exact inputs {total['exact_inputs']:.2f}; chance {total['chance']:.2f})"
        )
    canary = attacks.get("canary")
    if canary:
        acc = canary["accountant_epsilon"]
        capped = (
            ", the most this audit's size can show: the attack never erred, so a larger audit "
            "could show more"
            if canary.get("at_audit_cap")
            else ""
        )
        lines.append(
            f"empirical epsilon >= {canary['epsilon_lower_bound']:.3f} (95% confidence{capped}; "
            "at most "
            f"{canary['one_run']['max_epsilon_lower_bound']:.2f} one-run, "
            f"{canary['clopper_pearson']['max_epsilon_lower_bound']:.2f} over trials); "
            f"accountant: {'no DP' if acc is None else f'{acc:.3f}'}"
        )
    lines += [f"finding [{f['code']}]: {f['message']}" for f in findings(results)]
    return lines
