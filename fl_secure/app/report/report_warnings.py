"""The report's warnings: what a reader of the statement must not miss, each with a code.

Each warning compares the report's sections with each other or with a rule: no differential
privacy or a weak epsilon, delta not below 1/N, no secure aggregation, plaintext transport,
noise from a seeded generator or added by the server, incomplete metrics, a ledger that is
missing, disagrees with ``summary.json`` or fails verification, a released model the ledger
does not name, a model no better than the initial one, the audit's findings, a cohort
redrawn after a failed attempt, a run that did not complete, and site ledgers that cannot be
read or record releases the run's ledger does not account.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from audits.run_audit import findings
from fl_secure.app.report.units import DPSGD_UNITS
from fl_secure.errors import PrivacyError
from privacy.ledger.site_ledger import SiteLedger

#: Whose data a too large delta could release outright, by privacy unit.
_WHOSE = {"example": "image", "identity": "person", "client": "client"}

#: A final model whose TAR@FAR=1e-2 is not above the initial one's by more than this is
#: warned about (``no-utility``): a difference this small is within the run-to-run spread of
#: the small evaluation sets.
NO_UTILITY_MARGIN = 0.02


def report_warnings(
    report: dict[str, Any], config: dict[str, Any], metrics: list[dict[str, Any]] | None = None
) -> list[dict[str, str]]:
    """The warnings of the report's sections (the sites' are :func:`site_warnings`)."""
    w: list[dict[str, str]] = []
    p = report["privacy"]
    if not p["differential_privacy"]:
        w.append(
            {
                "code": "dp-off",
                "message": "Differential privacy was off: the released "
                "models carry no (epsilon, delta) guarantee.",
            }
        )
    elif p["epsilon"] is not None and p["epsilon"] > 10:
        w.append(
            {
                "code": "epsilon-above-10",
                "message": f"epsilon = {p['epsilon']:.3g} is above "
                "10: the formal guarantee is weak.",
            }
        )
    if p["delta_below_one_over_population"] is False:
        w.append(
            {
                "code": "delta-not-below-1-over-n",
                "message": f"delta = {p['delta']:.3g} is not below 1/N for N = "
                f"{p['population']} {p.get('population_of', 'clients')}: a mechanism could "
                f"release one {_WHOSE.get(p['privacy_unit'], 'client')}'s data outright.",
            }
        )
    if p["privacy_unit"] in DPSGD_UNITS and not (config.get("privacy") or {}).get("sample_rate"):
        w.append(
            {
                "code": "example-count-public",
                "message": "privacy.sample_rate was not set: each client's DP-SGD sampling rate "
                "q = batch_size / N came from its image count N and was sent with its updates, "
                "so N is treated as public (Opacus' convention); the guarantee covers which "
                + ("people's images" if p["privacy_unit"] == "identity" else "images")
                + " a site holds given the number of images. Set privacy.sample_rate to keep N "
                "private.",
            }
        )
    if report["secure_aggregation"]["scheme"] == "none":
        w.append(
            {
                "code": "no-secure-aggregation",
                "message": "No secure aggregation: the "
                "server saw every client's individual update.",
            }
        )
    elif not p["differential_privacy"]:
        who = "every client" if report["secure_aggregation"]["scheme"] == "ckks" else "the server"
        w.append(
            {
                "code": "secure-sum-without-dp",
                "message": "Secure aggregation without differential privacy hides whose "
                f"update is whose, not who took part: the summed update ({who} sees it) can "
                "still show which identities trained (see the audit's secure_sum entries).",
            }
        )
    if "plaintext" in str(report["run"].get("transport", "")):
        w.append(
            {
                "code": "insecure-transport",
                "message": "Plaintext transport was used "
                "(--insecure): updates and models crossed the network unencrypted.",
            }
        )
    if p.get("noise_from_csprng") is False:
        w.append(
            {
                "code": "noise-not-cryptographic",
                "message": "DP noise came from a seeded "
                "generator (privacy.secure_rng = false), not a CSPRNG.",
            }
        )
    if p["differential_privacy"] and p["noise_placement"] == "central":
        w.append(
            {
                "code": "central-noise",
                "message": "Noise was added by the server "
                "(central placement): the guarantee holds only if the server is trusted.",
            }
        )
    done = report["run"].get("rounds_completed")
    recorded = {m.get("round") for m in metrics or []} - {0}  # round 0: the initial model
    if metrics is not None and isinstance(done, int) and not set(range(1, done + 1)) <= recorded:
        w.append(
            {
                "code": "metrics-incomplete",
                "message": f"metrics.jsonl records {len(recorded & set(range(1, done + 1)))} "
                f"of the {done} completed rounds "
                "(missing, truncated or edited): the per-round figures and the secure-aggregation "
                "table below are incomplete.",
            }
        )
    led = report["ledger"]
    if not led.get("present") and (led.get("recorded_entries") or 0) > 0:
        w.append(
            {
                "code": "ledger-missing",
                "message": f"ledger.sqlite is missing, but the run recorded "
                f"{led['recorded_entries']} ledger entries: the privacy statement cannot be "
                "checked against its record.",
            }
        )
    elif not led.get("present") and led.get("summary_states_spending"):
        w.append(
            {
                "code": "ledger-missing",
                "message": "ledger.sqlite is missing, but summary.json states privacy spent "
                "(epsilon or accounted rounds): the privacy statement cannot be checked "
                "against its record.",
            }
        )
    stated_delta, kept_delta = p.get("delta_in_summary"), led.get("delta")
    if isinstance(stated_delta, (int, float)) and isinstance(kept_delta, (int, float)):
        if not math.isclose(stated_delta, kept_delta, rel_tol=1e-9, abs_tol=0.0):
            w.append(
                {
                    "code": "ledger-summary-mismatch",
                    "message": f"summary.json states delta = {stated_delta:.6g} but the privacy "
                    f"ledger records {kept_delta:.6g}; this report states the ledger's.",
                }
            )
    stated, kept = p.get("epsilon_in_summary"), led.get("epsilon")
    if isinstance(stated, (int, float)) and isinstance(kept, (int, float)):
        if not math.isclose(stated, kept, rel_tol=1e-9, abs_tol=1e-12):
            w.append(
                {
                    "code": "ledger-summary-mismatch",
                    "message": f"summary.json states epsilon = {stated:.6g} but the privacy "
                    f"ledger records {kept:.6g}; this report states the ledger's.",
                }
            )
    if report["ledger"].get("present") and not report["ledger"].get("verified"):
        w.append(
            {
                "code": "ledger-tampered",
                "message": "The privacy ledger failed "
                "verification: " + "; ".join(report["ledger"]["problems"]),
            }
        )
    model = report.get("model") or {}
    if model.get("problem") and not model.get("checkpoint"):
        w.append({"code": "model-missing", "message": f"{model['problem']}."})
    elif model.get("problem"):
        w.append({"code": "model-not-the-released-one", "message": f"{model['problem']}."})
    elif led.get("present") and model.get("sha256") and model.get("ledger_sha256") is None:
        w.append(
            {
                "code": "model-not-in-ledger",
                "message": "The ledger does not name the model it released (a ledger written "
                "before ledgers recorded model_sha256): the privacy statement is not tied to "
                f"{model.get('checkpoint')} by the ledger.",
            }
        )
    u = report["utility"]
    final, untrained = u["final"].get("tar_at_far_1e-2"), u["untrained"].get("tar_at_far_1e-2")
    where = "held-out identities"
    if final is None:  # no held-out identities: the clients' own test images
        final = u["clients_spread"].get("tar_at_far_1e-2_mean")
        untrained = u.get("untrained_clients_spread", {}).get("tar_at_far_1e-2_mean")
        where = "the clients' own test images (mean over clients; the run held out no identity)"
    if final is not None and untrained is not None and final <= untrained + NO_UTILITY_MARGIN:
        w.append(
            {
                "code": "no-utility",
                "message": f"The final model is no better than the initial one, "
                f"{u['initial_model']}, on {where}: TAR@FAR=1e-2 {final:.3f} vs "
                f"{untrained:.3f} (within {NO_UTILITY_MARGIN} or below); the privacy noise or "
                "the training budget left it unusable.",
            }
        )
    audit = report["threat_model"].get("audit")
    if audit is not None:
        derived = findings(audit)
        stated = audit.get("findings")  # absent from results written before they were stored
        if stated is not None and stated != derived:
            w.append(
                {
                    "code": "audit-findings-differ",
                    "message": "audit/results.json states findings that its own numbers do "
                    "not give (the file was edited, or written by another version of "
                    f"fl-secure): it states {[f['code'] for f in stated]}, its numbers give "
                    f"{[f['code'] for f in derived]}; the warnings below are the latter.",
                }
            )
        w += derived
    redrawn = [m["round"] for m in metrics or [] if m.get("round") and m.get("attempt")]
    rate = p.get("sample_rate")
    # Poisson cohorts accounted without amplification (rate 1) are bounded whatever was
    # drawn; fixed-size cohorts (and ledgers of older versions) take amplification
    amplified = p.get("sampling") != "poisson" or (p.get("accounted_sample_rate") or 0.0) < 1
    if p["privacy_unit"] == "client" and rate is not None and rate < 1 and redrawn and amplified:
        w.append(
            {
                "code": "cohort-redrawn",
                "message": f"Rounds {redrawn} were released by a later attempt, after an "
                "attempt with too few updates: the released cohort is a draw conditioned on "
                "that failure, not exactly the sampling the accountant's amplification "
                f"assumes ({p['sampling']} at rate {rate}); the stated epsilon may be low.",
            }
        )
    if report["run"]["status"] != "completed":
        w.append(
            {
                "code": "run-not-completed",
                "message": f"The run ended with status "
                f"{report['run']['status']!r}: {report['run']['reason']}",
            }
        )
    return w


def site_warnings(report: dict[str, Any], run_dir: Path) -> list[dict[str, str]]:
    """Site ledgers that could not be read, and releases the run's ledger does not account.

    A site's release of a round counts against the server only under local or distributed
    noise (central noise trusts the server). Per round, the run accounts its completed round
    and each discarded sum; a round with a failed attempt on record is left out (an attempt
    that ended before its sum was unmasked released nothing to the server, and one that
    did not is a discarded sum already). More releases than that in a round with no failed
    attempt on record are unexplained: a server that died mid-round under a version that did
    not mark attempts in flight, or a ledger that does not belong to these sites.
    """
    w: list[dict[str, str]] = []
    sites = report["sites"]["sites"]
    damaged = [s["client"] for s in sites if s["problem"]]
    if damaged:
        w.append(
            {
                "code": "site-ledger-unreadable",
                "message": f"The site ledgers of {damaged} could not be read (see the sites "
                "table): those sites' own figures are missing from this report.",
            }
        )
    if report["privacy"]["privacy_unit"] != "client" or not report["ledger"].get("present"):
        return w
    accounted = Counter(r["round"] for r in report["ledger"].get("epsilon_by_round") or [])
    with_failures = {f["round"] for f in report["run"]["failed_attempts"]}
    unexplained: dict[str, list[int]] = {}
    for site in sites:
        if site["problem"]:
            continue
        try:
            releases = SiteLedger(run_dir / "clients" / site["client"]).releases
        except PrivacyError:  # pragma: no cover - read just above without a problem
            continue
        counted = Counter(
            r.round
            for r in releases
            if r.unit == "client" and r.placement in ("local", "distributed")
        )
        rounds = sorted(
            r for r, n in counted.items() if r not in with_failures and n > accounted[r]
        )
        if rounds:
            unexplained[site["client"]] = rounds
    if unexplained:
        w.append(
            {
                "code": "sites-released-more",
                "message": "Sites released more updates in some rounds than the run's ledger "
                f"accounts for them, with no failed attempt on record: {unexplained} (site: "
                "rounds). A server that died mid-round under a version that did not mark "
                "attempts in flight leaves such releases unaccounted; each site's own figure "
                "in the sites table counts them all.",
            }
        )
    return w
