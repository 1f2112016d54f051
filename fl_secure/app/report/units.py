"""What each ``privacy.unit`` protects, in the report's words: record, mechanism, population.

One place for the wording, so that the statement, the plain summary, the warnings and the
CLI name the protected record alike:

* ``client``: one institution (a whole site's data);
* ``example``: one face image of a site (DP-SGD on each site, local noise);
* ``identity``: one person, every image of one identity at a site (identity-level DP-SGD on
  each site, local noise; :mod:`privacy.dp.identity_dpsgd`).
"""

from __future__ import annotations

from typing import Any

#: The units whose guarantee each site's DP-SGD gives for its own records.
DPSGD_UNITS = ("example", "identity")

#: The protected record of each unit, short (a noun a sentence can use).
RECORD = {"client": "institution", "example": "face image", "identity": "person"}

#: The protected record of each unit, stated in full.
RECORD_IN_FULL = {
    "client": "one client (institution): all of its data",
    "example": "one training image of a site",
    "identity": "one person: every image of one identity at a site (the guarantee is per site)",
}


def mechanism(unit: str) -> str:
    """The mechanism of ``unit`` in one sentence."""
    if unit == "none":
        return "none: no differential privacy in this run"
    if unit == "client":
        return (
            "DP-FedAvg: each client's update of the shared parameters clipped to L2 norm C, "
            "Gaussian noise of std z C on the sum (discrete Gaussian under secure "
            "aggregation with distributed noise)"
        )
    if unit == "identity":
        return (
            "identity-level DP-SGD on each client: Poisson-sampled identities, each "
            "identity's gradient (summed over all its images in the step) clipped to L2 norm "
            "C, Gaussian noise of std z C; each client accounts its own epsilon, one person "
            "(all their images at the site) being the record"
        )
    return (
        "DP-SGD (Opacus) on each client: per-example clipping, Gaussian noise, Poisson-"
        "sampled batches; each client accounts its own epsilon"
    )


def dpsgd_population(unit: str, smallest_images: int | None) -> tuple[int | None, str]:
    """N of the delta < 1/N rule for a DP-SGD unit, and what it counts.

    ``smallest_images``: the training images of the smallest client, where the server knows
    them. At the identity level the records are identities, whose count stays on the sites.
    """
    if unit == "identity":
        return None, (
            "not released: at the identity level the records are a site's identities, whose "
            "number stays on the site (each client checks delta < 1/N for its own N)"
        )
    if smallest_images is None:
        return None, (
            "not released: at the example level a site's image count stays on the site "
            "(each client checks delta < 1/N for its own N)"
        )
    return smallest_images, (
        "training images of the smallest client: the unit is one image, and each "
        "client's guarantee covers its own images"
    )


def record_of(privacy: dict[str, Any]) -> str:
    """The short record name for a report's privacy section (``institution`` by default)."""
    return RECORD.get(str(privacy.get("privacy_unit")), "institution")
