"""The view's head rows identified as the targets' templates (a shared head's class embeddings).

A class embedding of a cosine/margin head is a template of its identity: matched against
embeddings of the targets' test images (the view's own backbone), it names its identity
(:func:`audits.leakage.identify_head_templates`). A view that holds no row of a target's has
nothing to attack.
"""

from __future__ import annotations

from typing import Any

import torch

from audits.attacks.features import embed
from audits.canary import clopper_pearson_interval
from audits.leakage import identify_head_templates
from audits.observations import RunContext, View
from audits.targets import Targets


def templates_attack(run: RunContext, view: View, tg: Targets) -> dict[str, Any]:
    """Top-1/top-5 of the view's head rows against the targets' test images, beside chance."""
    if not view.head_rows:
        return {"applicable": False, "why": view.head_source}
    rows = torch.stack([view.head_rows[t] for t in tg.identities])
    gallery = embed(run.model.backbone, tg.gallery.images)
    found, top1 = identify_head_templates(rows, torch.arange(len(tg.identities)), gallery,
                                          tg.gallery.labels)  # fmt: skip
    n = len(tg.identities)
    return {
        "applicable": True,
        "gallery": f"{len(tg.gallery)} test images of the targets (view's backbone)",
        "top1": top1,
        "top1_ci95": list(clopper_pearson_interval(round(top1 * n), n)),
        "top5": found.accuracy(torch.arange(n), k=5),
        "chance": 1.0 / n,
    }
