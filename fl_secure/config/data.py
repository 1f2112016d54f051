"""The ``[data]`` and ``[partition]`` sections: where the faces come from, how they are split."""

from __future__ import annotations

from dataclasses import dataclass

from fl_secure.config.values import DataSource, PartitionKind, check
from fl_secure.errors import ConfigError

#: data.image_size's allowed sides; 150 is dlib's face chip (the dlib-resnet backbone's input)
IMAGE_SIZES = (32, 64, 112, 150)


@dataclass(frozen=True)
class DataConfig:
    """Where the faces come from and how they are split."""

    source: DataSource = "synthetic"
    path: str = ""  # identity folders (source = "folders"), e.g. ../shared/data/orl, or the
    # flat image folder of source = "celeba" (img_align_celeba)
    attributes_file: str = ""  # celeba: list_attr_celeba.txt (identity-level majority attributes)
    identities_file: str = ""  # celeba: identity_CelebA.txt ("filename identity" lines)
    # square side in pixels: 32, 64 (default), 112, or 150 (dlib's face chips, for the
    # dlib-resnet backbone: `fl-secure data align` writes them at 150)
    image_size: int = 64
    num_identities: int = 120  # synthetic: identities generated
    images_per_identity: int = 20  # synthetic: images per identity
    max_identities: int = 0  # folders: 0 = all
    min_images_per_identity: int = 2  # folders: identities with fewer images are skipped
    max_images_per_identity: int = 0  # folders: 0 = all
    center_crop: int = 0  # folders: centre-crop to this many pixels before resizing (0 = off)
    held_out_identities: int = 40  # identities held out from all clients (server evaluation)
    test_fraction: float = 0.3  # per-identity fraction of each client's images kept for testing
    # synthetic: multiplier of the expression deformations (1.0 = the default images bit for
    # bit; up to 2.5 makes the 5 expressions learnable, for fedaffect)
    expression_strength: float = 1.0
    # the target domain's degradation of every image the run uses, at every site and at the
    # server's evaluation (fl_secure.data.degrade's grammar: "lowres:24+greyblur:1.5+
    # occlusion:0.2"); "" or "none": the images as loaded
    degrade: str = ""

    def __post_init__(self) -> None:
        """Check ranges."""
        check(self.image_size in IMAGE_SIZES, "data.image_size", _one_of(IMAGE_SIZES))
        check(self.num_identities > 1, "data.num_identities", "an integer > 1")
        check(self.images_per_identity > 1, "data.images_per_identity", "an integer > 1")
        check(self.held_out_identities >= 0, "data.held_out_identities", "an integer >= 0")
        check(self.max_identities >= 0, "data.max_identities", "an integer >= 0 (0 = all)")
        check(self.min_images_per_identity >= 1, "data.min_images_per_identity", "an integer >= 1")
        check(
            self.max_images_per_identity == 0
            or self.max_images_per_identity >= self.min_images_per_identity,
            "data.max_images_per_identity",
            f"0 (all) or an integer >= data.min_images_per_identity "
            f"({self.min_images_per_identity})",
        )
        check(self.center_crop >= 0, "data.center_crop", "an integer >= 0 (0 = off)")
        check(0.0 < self.test_fraction < 1.0, "data.test_fraction", "a number in (0, 1)")
        check(
            0.0 <= self.expression_strength <= 2.5,
            "data.expression_strength",
            "a number in [0, 2.5]",
        )
        check(self.source == "synthetic" or bool(self.path), "data.path", "a folder path")
        if self.source == "celeba":
            check(bool(self.attributes_file), "data.attributes_file", "list_attr_celeba.txt")
            check(bool(self.identities_file), "data.identities_file", "identity_CelebA.txt")
        _check_degradation(self.degrade, self.image_size)


def _one_of(values: tuple[int, ...]) -> str:
    return "one of " + ", ".join(map(str, values))


def _check_degradation(spec: str, image_size: int) -> None:
    """Refuse a ``data.degrade`` spec that parses badly or cannot apply at ``image_size``.

    Raises:
        ConfigError: naming ``data.degrade`` and the problem (parse_degradation's words).
    """
    if spec.strip().lower() in ("", "none"):
        return
    # deferred: fl_secure.data.degrade imports torch, which reading a config otherwise does not
    from fl_secure.data.degrade import LowResolution, parse_degradation

    try:
        degradation = parse_degradation(spec)
    except ConfigError as exc:
        raise ConfigError(f"data.degrade: {exc}") from None
    for step in degradation.steps:
        if isinstance(step, LowResolution) and step.side > image_size:
            raise ConfigError(
                f"data.degrade = {spec!r}: {step.spec} asks for {step.side} px, more than "
                f"data.image_size = {image_size}; allowed: a side in [1, {image_size}]"
            )


@dataclass(frozen=True)
class PartitionConfig:
    """How the training identities are spread over clients."""

    kind: PartitionKind = "equal"  # equal, lognormal (HF-MAML Eq. 5) or dirichlet
    num_clients: int = 4
    # lognormal: mu of S_i (HF-MAML: 3). Eq. 5 normalises the S_i, so mu cancels and only
    # sigma shapes the sizes; kept as the paper states it
    mu: float = 3.0
    sigma: float = 3.0  # lognormal: sigma of S_i (HF-MAML: 3)
    alpha: float = 0.5  # dirichlet: concentration (smaller: more skewed)
    clients: tuple[str, ...] = ()  # attribute: one predicate per client, "male=1 & hat=0"
    # clients that join only after training (HF-MAML Sec. IV-A: 15 train + 5 test clients):
    # partitioned with the others, identities disjoint from training, never in a round; with
    # kind = "attribute" the last held_out_clients predicates of `clients` are theirs
    held_out_clients: int = 0
    # domain (FedFR, synthetic data only): client 0 is the labelled source-domain client with
    # this fraction of the training identities; clients 1.. split the rest equally and hold
    # them in the generator's "shifted" domain, as do the held-out identities (the target)
    source_fraction: float = 0.5
    # seeds the data split: the synthetic faces, data.degrade's draws, the held-out
    # identities, the partition and each client's train/test split, apart from run.seed
    # (which still seeds model initialisation, batch order and noise), so runs of several
    # run.seed share one partition; -1: run.seed seeds these too
    seed: int = -1

    def __post_init__(self) -> None:
        """Check ranges."""
        check(
            -1 <= self.seed < 2**63,
            "partition.seed",
            "-1 (the split follows run.seed) or an integer in [0, 2**63)",
        )
        check(
            1 <= self.num_clients <= 100_000,  # simulated populations (fl_secure.app.sim)
            "partition.num_clients",
            "an integer in [1, 100000]",
        )
        check(0 < self.source_fraction < 1, "partition.source_fraction", "a number in (0, 1)")
        if self.kind == "domain":
            check(
                self.num_clients >= 2,
                "partition.num_clients",
                "an integer >= 2 with kind = 'domain' (one source client + target clients)",
            )
            check(
                self.held_out_clients == 0, "partition.held_out_clients", "0 with kind = 'domain'"
            )
        check(self.sigma > 0, "partition.sigma", "a number > 0")
        check(self.alpha > 0, "partition.alpha", "a number > 0")
        check(0 <= self.held_out_clients <= 1000, "partition.held_out_clients", "0..1000")
        if self.kind == "attribute":
            if not all(isinstance(c, str) and c.strip() for c in self.clients):
                raise ConfigError("partition.clients: expected a list of predicate strings")
            if len(self.clients) != self.num_clients + self.held_out_clients:
                raise ConfigError(
                    f"partition.kind = 'attribute' needs one predicate per client: "
                    f"partition.clients has {len(self.clients)}, num_clients + "
                    f"held_out_clients is {self.num_clients + self.held_out_clients}"
                )
