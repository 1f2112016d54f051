"""The algorithm registry: one class per ``algorithm.name``, which answers for its design.

Prepare / Execute / Assert: the registry against the config schema, the classes' answers,
the refusals a config gets through :func:`check_config` (message for message as when
``Config`` made them), and a scan of the source tree for name comparisons outside
``fl_secure/algorithms``.
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path
from typing import Any

import pytest

from fl_secure.algorithms import ALGORITHMS, check_config, get_strategy, strategy_class
from fl_secure.algorithms.fedaffect import FedAffect
from fl_secure.algorithms.fedgc import FedGC
from fl_secure.algorithms.hfmaml import HFMAML
from fl_secure.config import (
    AlgorithmConfig,
    AlgorithmName,
    config_from_dict,
    config_to_toml,
    load_config,
)
from fl_secure.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fl_secure", "privacy", "server", "client", "audits")

#: Configs an algorithm refuses, with the message each gets (the texts Config raised before
#: the checks moved to the strategies).
REFUSED: list[tuple[dict[str, Any], str]] = [
    (
        {"algorithm": {"name": "fedavg", "embedding_reg": 1.0}},
        "algorithm.embedding_reg = 1 (HF-MAML Eq. 4) is implemented by hfmaml and "
        "hfmaml-global only; fedavg would ignore it",
    ),
    (
        {"algorithm": {"name": "fedgc"}, "secure_aggregation": {"scheme": "secagg"}},
        "algorithm.name = 'fedgc' cannot run with secure_aggregation.scheme = 'secagg': the "
        "server must see each client's class embeddings to apply the FedGC correction, which "
        "secure aggregation exists to hide; set secure_aggregation.scheme = 'none' or use fedpe",
    ),
    (
        {"algorithm": {"name": "fedcos"}, "privacy": {"unit": "client", "noise_multiplier": 1.0}},
        "algorithm.name = 'fedcos' cannot run with privacy.unit = 'client': the uploaded class "
        "embeddings would be an unclipped, un-noised per-client release outside the "
        "client-level guarantee; use privacy.unit = 'example' (DP-SGD covers the embeddings) "
        "or 'none', or fedpe",
    ),
    (
        {
            "algorithm": {"name": "fedaffect"},
            "privacy": {"unit": "example", "noise_multiplier": 1.0},
        },
        "algorithm.name = 'fedaffect' cannot run with privacy.unit = 'example': NT-Xent couples "
        "the images of a minibatch, so DP-SGD's per-example clipping would not bound one "
        "image's influence; use privacy.unit = 'client' (DP-FedAvg) or 'none'",
    ),
    (
        {
            "algorithm": {"name": "fedfr"},
            "partition": {"kind": "domain"},
            "privacy": {"unit": "example", "noise_multiplier": 1.0},
        },
        "algorithm.name = 'fedfr' cannot run with privacy.unit = 'example': a target client's "
        "pseudo labels come from clustering all its images (C-FINCH), so one image can change "
        "the labels of others and DP-SGD's per-example guarantee does not cover it; use "
        "privacy.unit = 'client' (DP-FedAvg) or 'none'",
    ),
    (
        {
            "algorithm": {"name": "fedaffect"},
            "privacy": {"unit": "identity", "noise_multiplier": 1.0},
        },
        "algorithm.name = 'fedaffect' cannot run with privacy.unit = 'identity': NT-Xent couples "
        "the images of a minibatch across people, so per-identity clipping would not bound one "
        "person's influence; use privacy.unit = 'client' (DP-FedAvg) or 'none'",
    ),
]


def test_every_name_of_the_config_schema_has_a_class() -> None:
    assert set(typing.get_args(AlgorithmName)) == set(ALGORITHMS)
    for name, cls in ALGORITHMS.items():
        assert strategy_class(name) is cls and cls.name == name
        assert type(get_strategy(name)) is cls
        assert type(get_strategy(name, AlgorithmConfig(name=name))) is cls  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown algorithm 'fedsgd'; allowed: adafedfr, "):
        strategy_class("fedsgd")


def test_the_classes_answer_for_their_designs() -> None:
    expressions = {name for name, cls in ALGORITHMS.items() if cls.evaluates_expressions}
    assert expressions == {"fedaffect"}
    assert {name for name, cls in ALGORITHMS.items() if cls.uses_embedding_reg} == {
        "hfmaml",
        "hfmaml-global",
    }
    assert {name for name, cls in ALGORITHMS.items() if cls.refuses_secure_aggregation} == {
        "fedgc",
        "fedcos",
    }
    refused = {name: set(cls.refused_privacy_units) for name, cls in ALGORITHMS.items()}
    assert {name: units for name, units in refused.items() if units} == {
        "fedgc": {"client"},
        "fedcos": {"client"},
        "fedaffect": {"example", "identity"},
        "fedfr": {"example", "identity"},
    }


def test_from_config_takes_the_run_settings() -> None:
    params = AlgorithmConfig(name="hfmaml", alpha=0.02, beta=0.3, delta=0.004, embedding_reg=2.0)
    hfmaml = HFMAML.from_config(params)
    assert (hfmaml.alpha, hfmaml.beta, hfmaml.delta, hfmaml.reg) == (0.02, 0.3, 0.004, 2.0)
    assert not FedGC.from_config(AlgorithmConfig(name="fedgc"), head="softmax").normalize
    assert FedGC.from_config(AlgorithmConfig(name="fedgc"), head="cosface").normalize
    labels = AlgorithmConfig(name="fedaffect", labels_per_class=7)
    assert FedAffect.from_config(labels).params.labels_per_class == 7


@pytest.mark.parametrize(("table", "message"), REFUSED)
def test_a_refused_config_loads_and_check_config_names_why(
    tmp_path: Path, table: dict[str, Any], message: str
) -> None:
    # Prepare: the config as a file (loading checks what holds for every algorithm)
    path = tmp_path / "run.toml"
    path.write_text(config_to_toml(config_from_dict(table)))
    config = load_config(path)
    # Execute / Assert: the algorithm's own refusal, word for word
    with pytest.raises(ConfigError) as refused:
        check_config(config)
    assert str(refused.value) == message


@pytest.mark.parametrize(("table", "message"), REFUSED)
def test_what_a_refused_config_would_run_as_is_accepted(
    table: dict[str, Any], message: str
) -> None:
    del message
    # Prepare: the same run without the refused setting
    fixed = {k: v for k, v in table.items() if k not in ("privacy", "secure_aggregation")}
    if "embedding_reg" in fixed["algorithm"]:
        fixed["algorithm"] = {"name": fixed["algorithm"]["name"]}
    # Execute / Assert
    check_config(config_from_dict(fixed))


def name_comparisons(source: str) -> list[int]:
    """Lines where ``<...>.algorithm.name`` or ``<...>.strategy.name`` meets a string literal."""

    def is_name(node: ast.expr) -> bool:
        if not (isinstance(node, ast.Attribute) and node.attr == "name"):
            return False
        owner = node.value
        last = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        return last in ("algorithm", "strategy")

    def is_literal(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(is_literal(e) for e in node.elts)
        return False

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(is_name(o) for o in operands) and any(is_literal(o) for o in operands):
                lines.append(node.lineno)
        elif isinstance(node, ast.Match) and is_name(node.subject):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_scan_finds_a_comparison_in_any_spelling() -> None:
    source = (
        'if config.algorithm.name == "fedaffect": pass\n'
        'x = "fedgc" != run.strategy.name\n'
        'y = self.strategy.name in ("fedgc", "fedcos")\n'
        "z = config.algorithm.name in ALGORITHMS\n"  # a lookup: not a comparison with a name
        "match cfg.algorithm.name:\n"
        '    case "fedfr": pass\n'
    )
    assert name_comparisons(source) == [1, 2, 3, 5]


def test_no_algorithm_name_is_compared_outside_the_algorithms_package() -> None:
    # Prepare: every source file of the packages, but the algorithms' own
    algorithms = ROOT / "fl_secure" / "algorithms"
    files = [
        path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if algorithms not in path.parents and "v1" not in path.relative_to(ROOT).parts
    ]
    assert len(files) > 50
    # Execute
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in files
        for line in name_comparisons(path.read_text(encoding="utf-8"))
    ]
    # Assert: callers ask the strategy class (fl_secure.algorithms.strategy_class) instead
    assert found == [], "compare no algorithm names outside fl_secure/algorithms: ask the class"
