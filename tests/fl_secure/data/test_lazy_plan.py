"""A population's plan without its images: the same shares, bit for bit, rendered on demand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fl_secure.data.synthetic as synthetic
from fl_secure.config import Config, load_config
from fl_secure.data.lazy_plan import LazyShares, lazy_supported, plan_population
from fl_secure.data.plan import plan_federation
from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces
from fl_secure.data.synthetic_subset import render_synthetic_subset
from fl_secure.data.types import FaceDataset
from fl_secure.errors import DataError

CONFIG = """
[run]
name = "lazy"
seed = 5
[data]
source = "synthetic"
image_size = 32
num_identities = {identities}
images_per_identity = {images}
held_out_identities = 4
{extra}
[partition]
kind = "{kind}"
num_clients = {clients}
"""


def count_renders(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the chunks the synthetic generator renders from now on (one per call)."""
    rendered: list[int] = []
    original = synthetic._render

    def counted(tr: dict[str, np.ndarray], im: dict[str, np.ndarray], *rest: object) -> object:
        rendered.append(len(im["rot"]))
        return original(tr, im, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(synthetic, "_render", counted)
    return rendered


def _config(tmp_path: Path, kind: str, clients: int, identities: int, images: int = 3,
            extra: str = "") -> Config:  # fmt: skip
    path = tmp_path / f"{kind}-{clients}.toml"
    path.write_text(CONFIG.format(kind=kind, clients=clients, identities=identities,
                                  images=images, extra=extra))  # fmt: skip
    return load_config(path)


def _same(a: FaceDataset, b: FaceDataset) -> None:
    """Bit-identical images, labels, attributes, names and source."""
    assert a.images.shape == b.images.shape
    assert a.images.numpy().tobytes() == b.images.numpy().tobytes()
    assert a.labels.numpy().tobytes() == b.labels.numpy().tobytes()
    assert a.identity_names == b.identity_names and a.source == b.source
    assert set(a.attributes) == set(b.attributes)
    for key, value in a.attributes.items():
        assert value.dtype == b.attributes[key].dtype, key
        assert np.array_equal(value, b.attributes[key]), key


def test_any_subset_renders_as_the_whole_population_does() -> None:
    # Prepare: two populations (source domain; shifted, from identity 7) rendered whole
    for cfg in (
        SyntheticFaceConfig(num_identities=6, images_per_identity=4, image_size=24, seed=3),
        SyntheticFaceConfig(num_identities=5, images_per_identity=3, image_size=20, seed=9,
                            domain="shifted", first_identity=7, expression_strength=2.0),
    ):  # fmt: skip
        whole = generate_synthetic_faces(cfg)
        # Execute: unsorted positions across identities, one image, none, in small chunks
        for positions in ([13, 2, 7, 0, len(whole) - 1, 5], [4], []):
            part = render_synthetic_subset(cfg, np.array(positions), chunk=2)
            # Assert: exactly the whole set's images at those positions
            _same(part, whole.subset(positions))


def test_a_position_outside_the_population_is_refused() -> None:
    cfg = SyntheticFaceConfig(num_identities=2, images_per_identity=2, image_size=16)
    with pytest.raises(DataError, match=r"positions must be in \[0, 4\)"):
        render_synthetic_subset(cfg, np.array([4]))


@pytest.mark.parametrize(
    ("kind", "clients", "identities"),
    [("equal", 5, 24), ("person", 20, 24), ("lognormal", 6, 30), ("dirichlet", 4, 20)],
)
def test_the_lazy_plan_equals_the_eager_plan_bit_for_bit(
    tmp_path: Path, kind: str, clients: int, identities: int
) -> None:
    # Prepare: a config the lazy planner takes
    config = _config(tmp_path, kind, clients, identities)
    assert lazy_supported(config)
    # Execute: both plans
    eager, lazy = plan_federation(config), plan_population(config)
    # Assert: label space, held-out set, sizes and every share identical; nothing rendered
    # for a client until its share is read
    assert isinstance(lazy.clients, LazyShares) and lazy.clients.rendered == 0
    assert np.array_equal(lazy.train_identities, eager.train_identities)
    _same(lazy.held_out, eager.held_out)
    assert lazy.client_sizes() == eager.client_sizes()
    assert lazy.client_plan() == eager.client_plan()
    assert lazy.clients.rendered == 0
    assert len(lazy.clients) == len(eager.clients) == clients
    for k in range(clients):
        share = lazy.clients[k]
        _same(share.train, eager.clients[k].train)
        _same(share.test, eager.clients[k].test)
    assert lazy.clients.rendered == clients
    assert np.array_equal(lazy.unassigned_identities(), eager.unassigned_identities())
    assert lazy.manifest() == eager.manifest()


def test_configs_the_lazy_planner_cannot_take_get_the_eager_plan(tmp_path: Path) -> None:
    # Prepare: degraded images, and an attribute partition (both need rendered images)
    degraded = _config(tmp_path, "equal", 3, 12, extra='degrade = "lowres:16"')
    # Execute / Assert: the eager plan, identical to plan_federation's
    assert not lazy_supported(degraded)
    plan = plan_population(degraded)
    assert isinstance(plan.clients, list)
    _same(plan.clients[1].train, plan_federation(degraded).clients[1].train)


def test_planning_ten_thousand_clients_renders_only_the_held_out_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: 10,000 one-identity clients, every image the generator renders counted
    rendered = count_renders(monkeypatch)
    config = _config(tmp_path, "person", 10_000, 10_004, images=2)
    # Execute: the plan, then one client's share
    plan = plan_population(config)
    planned = sum(rendered)
    share = plan.clients[1234]
    # Assert: the 4 held-out identities' 8 images, then that client's 2, not 20,008
    assert planned == 4 * 2 == len(plan.held_out)
    assert sum(rendered) - planned == len(share.train) + len(share.test) == 2
    assert len(plan.clients) == 10_000 and sum(plan.client_sizes()) == 10_000
    assert share.train.identities().tolist() == share.test.identities().tolist()
