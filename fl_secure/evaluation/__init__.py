"""Face verification and identification metrics (pure numpy) and per-client summaries."""

from fl_secure.evaluation.identification import rank1, rank1_leave_one_out
from fl_secure.evaluation.summary import per_client_summary
from fl_secure.evaluation.verification import (
    VERIFICATION_FARS,
    DegenerateEmbeddings,
    all_pairs,
    best_accuracy,
    eer,
    kfold_accuracy,
    kfold_balanced_accuracy,
    normalise_rows,
    roc,
    roc_auc,
    tar_at_far,
    verification_metrics,
)

__all__ = [
    "VERIFICATION_FARS",
    "DegenerateEmbeddings",
    "all_pairs",
    "best_accuracy",
    "eer",
    "kfold_accuracy",
    "kfold_balanced_accuracy",
    "normalise_rows",
    "per_client_summary",
    "rank1",
    "rank1_leave_one_out",
    "roc",
    "roc_auc",
    "tar_at_far",
    "verification_metrics",
]
