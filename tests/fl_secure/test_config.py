"""Config loading: typed, validated, errors that name the key and the allowed values."""

import dataclasses
import math
import typing
from pathlib import Path

import pytest

from fl_secure.algorithms.registry import check_config
from fl_secure.config import (
    Config,
    config_fingerprint,
    config_from_dict,
    config_to_toml,
    load_config,
)
from fl_secure.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_examples_load() -> None:
    for path in sorted((ROOT / "examples").glob("*.toml")):
        assert isinstance(load_config(path), Config)


def test_unknown_key_names_key_and_allowed() -> None:
    with pytest.raises(ConfigError, match=r"unknown key roundz in \[train\]; allowed: .*rounds"):
        config_from_dict({"train": {"roundz": 3}})


def test_bad_literal_lists_allowed_values() -> None:
    with pytest.raises(ConfigError, match=r"algorithm.name = 'fedsgd' is not allowed.*'fedpe'"):
        config_from_dict({"algorithm": {"name": "fedsgd"}})


def test_bad_type_and_range() -> None:
    with pytest.raises(ConfigError, match="train.rounds = 'ten': expected an integer"):
        config_from_dict({"train": {"rounds": "ten"}})
    with pytest.raises(ConfigError, match="train.lr"):
        config_from_dict({"train": {"lr": -1.0}})
    with pytest.raises(ConfigError, match="min_clients"):
        config_from_dict({"partition": {"num_clients": 2}, "server": {"min_clients": 3}})


def _float_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for name, hint in typing.get_type_hints(cls).items():
        key = f"{prefix}.{name}" if prefix else name
        if hint is float:
            keys.append(key)
        elif dataclasses.is_dataclass(hint):
            keys.extend(_float_keys(hint, key))
    return keys


def test_every_float_key_refuses_nan_and_inf_by_name() -> None:
    keys = _float_keys(Config)
    assert len(keys) >= 30 and "train.lr" in keys and "privacy.delta" in keys
    for key in keys:
        section, name = key.split(".")
        for bad in (math.nan, math.inf, -math.inf):
            if key == "algorithm.cfinch_threshold" and math.isinf(bad):
                continue
            with pytest.raises(ConfigError, match=rf"{key} = .*expected a finite number"):
                config_from_dict({section: {name: bad}})
    # the same through --set, where TOML spells them inf and nan
    with pytest.raises(ConfigError, match="train.lr = inf: expected a finite number"):
        config_from_dict({}, ["train.lr=inf"])
    # C-FINCH's threshold alone takes inf: it means FINCH without a threshold
    cfg = config_from_dict({}, ["algorithm.cfinch_threshold=inf"])
    assert cfg.algorithm.cfinch_threshold == math.inf
    with pytest.raises(ConfigError, match=r"cfinch_threshold: invalid value; allowed: a num"):
        config_from_dict({"algorithm": {"cfinch_threshold": -math.inf}})


def test_overrides_and_toml_round_trip() -> None:
    cfg = config_from_dict({}, ["train.rounds=3", "model.head=arcface", "run.name=x y"])
    assert cfg.train.rounds == 3 and cfg.model.head == "arcface" and cfg.run.name == "x y"
    import tomllib

    assert config_from_dict(tomllib.loads(config_to_toml(cfg))) == cfg
    with pytest.raises(ConfigError, match="expected section.key=value"):
        config_from_dict({}, ["train.rounds"])


def test_fingerprint_survives_the_run_directory_round_trip_and_sees_every_value(
    tmp_path: Path,
) -> None:
    # every example, with paths, written as a run directory's config.toml and read back
    for example in sorted((ROOT / "examples").glob("*.toml")):
        cfg = load_config(example)
        written = tmp_path / f"{example.stem}.toml"
        written.write_text(config_to_toml(cfg))
        assert config_fingerprint(load_config(written)) == config_fingerprint(cfg), example.name
    # a comment or reformatting changes nothing; one value does
    base = tmp_path / "quickstart.toml"
    text = base.read_text()
    (tmp_path / "commented.toml").write_text("# a note\n" + text.replace(" = ", "="))
    same = config_fingerprint(load_config(tmp_path / "commented.toml"))
    assert same == config_fingerprint(load_config(base))
    edited = config_from_dict({}, ["train.lr=0.0101"])
    assert config_fingerprint(edited) != config_fingerprint(config_from_dict({}))


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nrounds = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_secagg_plus_needs_an_even_neighbour_count() -> None:
    # an odd k has no graph on an odd cohort (Poisson cohorts vary in size) and its chords
    # let dropouts cut the survivors into groups: refused when the config is read
    with pytest.raises(ConfigError, match="neighbours = 3: SecAgg\\+ needs an even k.*use 4"):
        config_from_dict({"secure_aggregation": {"scheme": "secagg+", "neighbours": 3}})
    even = config_from_dict({"secure_aggregation": {"scheme": "secagg+", "neighbours": 4}})
    assert even.secure_aggregation.neighbours == 4


def test_privacy_section_is_validated_with_clear_errors() -> None:
    # A private run needs noise or a budget to calibrate it to
    with pytest.raises(ConfigError, match="needs privacy.noise_multiplier > 0 or"):
        config_from_dict({"privacy": {"unit": "client"}})
    # distributed noise without secure aggregation would leave an un-noised sum on the server
    distributed = {"unit": "client", "noise_placement": "distributed", "target_epsilon": 8}
    with pytest.raises(ConfigError, match="'distributed' needs secure aggregation"):
        config_from_dict({"privacy": distributed})
    both = config_from_dict(
        {"privacy": distributed, "secure_aggregation": {"scheme": "secagg", "clip_range": 8.0}}
    )
    assert both.privacy.noise_placement == "distributed"
    # its integer arithmetic is 62-bit: a larger modulus is refused here, not in round 1
    wide = {"scheme": "secagg", "modulus_bits": 63}
    with pytest.raises(ConfigError, match="modulus_bits = 63: .*'distributed'.*<= 62"):
        config_from_dict({"privacy": distributed, "secure_aggregation": wide})
    # DP-SGD noises on the client: a placement for client-level DP is not silently ignored
    example = {"unit": "example", "noise_multiplier": 1.0, "noise_placement": "central"}
    with pytest.raises(ConfigError, match="'central' with privacy.unit = 'example': DP-SGD"):
        config_from_dict({"privacy": example})
    # CKKS decryptors are clients: central noise, added after decryption, is refused
    central = {"unit": "client", "noise_placement": "central", "target_epsilon": 8}
    with pytest.raises(ConfigError, match="'central' with .*'ckks'.*un-noised sum"):
        config_from_dict({"privacy": central, "secure_aggregation": {"scheme": "ckks"}})
    local = {**central, "noise_placement": "local"}
    assert config_from_dict({"privacy": local, "secure_aggregation": {"scheme": "ckks"}})
    assert config_from_dict({"privacy": central, "secure_aggregation": {"scheme": "secagg"}})
    with pytest.raises(ConfigError, match="privacy.delta"):
        config_from_dict({"privacy": {"delta": 1.5}})
    with pytest.raises(ConfigError, match="privacy.unit = 'user' is not allowed"):
        config_from_dict({"privacy": {"unit": "user"}})
    # Defaults: no DP; accountant by unit (PLD client level, PRV example level)
    assert not config_from_dict({}).privacy.enabled
    client = config_from_dict({"privacy": {"unit": "client", "target_epsilon": 8}})
    example = config_from_dict({"privacy": {"unit": "example", "noise_multiplier": 1.0}})
    assert client.privacy.accountant_name() == "pld"
    assert example.privacy.accountant_name() == "prv"


@pytest.mark.parametrize("placement", ["distributed", "central"])
def test_identity_unit_is_dpsgd_with_local_noise_only(placement: str) -> None:
    # the identity unit is DP-SGD on each site: placements for client-level DP are refused
    identity = {"unit": "identity", "noise_multiplier": 1.0, "noise_placement": placement}
    with pytest.raises(
        ConfigError,
        match=f"privacy.noise_placement = '{placement}' with privacy.unit = 'identity': DP-SGD",
    ):
        config_from_dict({"privacy": identity})
    # it needs noise or a budget to calibrate to, as every unit does
    with pytest.raises(ConfigError, match="privacy.unit = 'identity' needs privacy.noise_mult"):
        config_from_dict({"privacy": {"unit": "identity"}})
    ok = config_from_dict({"privacy": {"unit": "identity", "target_epsilon": 4.0}}).privacy
    assert ok.enabled and ok.dpsgd and ok.noise_placement == "local"
    assert ok.accountant_name() == "prv"  # as example level
    assert not config_from_dict({"privacy": {"unit": "client", "target_epsilon": 8}}).privacy.dpsgd


def test_attribute_partition_needs_one_predicate_per_client() -> None:
    with pytest.raises(ConfigError, match="one predicate per client: partition.clients has 1"):
        config_from_dict({"partition": {"kind": "attribute", "num_clients": 2,
                                        "clients": ["hat=1"]}})  # fmt: skip
    cfg = config_from_dict(
        {"partition": {"kind": "attribute", "num_clients": 2, "clients": ["hat=1", "hat=0"]}}
    )
    assert list(cfg.partition.clients) == ["hat=1", "hat=0"]


def test_embedding_reg_is_refused_where_the_algorithm_would_ignore_it() -> None:
    with pytest.raises(ConfigError, match="embedding_reg = 1 .* fedavg would ignore it"):
        check_config(config_from_dict({"algorithm": {"name": "fedavg", "embedding_reg": 1.0}}))
    for name in ("hfmaml", "hfmaml-global"):
        reg = config_from_dict({"algorithm": {"name": name, "embedding_reg": 1.0}})
        check_config(reg)
        assert reg.algorithm.embedding_reg == 1.0


def test_run_name_cannot_leave_the_out_folder() -> None:
    assert config_from_dict({}, ["run.name=site-a 2026.1"]).run.name == "site-a 2026.1"
    for name in ("../escaped", "/abs", "a/b", "a\\b", ".hidden", "", "exp\nA", "a\x7fb"):
        with pytest.raises(ConfigError, match="run.name: invalid value; allowed: a plain folder"):
            config_from_dict({"run": {"name": name}})


def test_relative_paths_from_the_file_and_from_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "configs"
    folder.mkdir()
    text = '[model]\npretrained = "w.safetensors"\n[data]\npath = "faces"\n'
    (folder / "c.toml").write_text(text)
    loaded = load_config(folder / "c.toml")  # written in the file: the file's folder
    assert loaded.model.pretrained == str(folder / "w.safetensors")
    assert loaded.data.path == str(folder / "faces")
    monkeypatch.chdir(tmp_path)  # typed with --set: where the user is
    loaded = load_config(folder / "c.toml", ["model.pretrained=runs/a/backbone.safetensors"])
    assert loaded.model.pretrained == str(tmp_path / "runs" / "a" / "backbone.safetensors")
    assert loaded.data.path == str(folder / "faces")
    assert load_config(folder / "c.toml", ["data.path=/abs/faces"]).data.path == "/abs/faces"


def test_any_string_value_survives_the_config_toml_round_trip() -> None:
    # control characters, DEL (which TOML bans raw), quotes, backslashes and non-ASCII
    import tomllib

    odd = 'faces\x07\tq"uo\\te\x7f\n\u00e9\u4e2d'
    config = config_from_dict({"data": {"source": "folders", "path": odd}})
    assert tomllib.loads(config_to_toml(config))["data"]["path"] == odd


def test_timeouts_are_bounded_by_a_week() -> None:
    for key in ("server.round_timeout", "server.upload_idle_timeout",
                "secure_aggregation.stage_timeout"):  # fmt: skip
        assert config_from_dict({}, [f"{key}=604800"])  # a week is allowed
        for bad in ("0", "1e10"):
            with pytest.raises(ConfigError, match=f"{key}: invalid value.*up to a week"):
                config_from_dict({}, [f"{key}={bad}"])
        for bad in ("inf", "nan"):
            with pytest.raises(ConfigError, match=f"{key} = {bad}: expected a finite number"):
                config_from_dict({}, [f"{key}={bad}"])


def test_a_config_that_is_not_utf8_text_is_a_config_error(tmp_path: Path) -> None:
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'[run]\nname = "\xff\xfe"\n')
    with pytest.raises(ConfigError, match="not a UTF-8 text file"):
        load_config(latin)


def test_list_items_are_checked_by_type() -> None:
    with pytest.raises(ConfigError, match=r"secure_aggregation.ckks_layers\[0\] = 1: expected a"):
        config_from_dict({"secure_aggregation": {"scheme": "ckks", "ckks_layers": [1, 2]}})
    layers = ["backbone.embedding"]
    found = config_from_dict({"secure_aggregation": {"scheme": "ckks", "ckks_layers": layers}})
    assert found.secure_aggregation.ckks_layers == ("backbone.embedding",)


def test_cohort_settings_that_no_round_could_meet_are_refused() -> None:
    with pytest.raises(ConfigError, match="clients_per_round = 2 is below server.min_clients = 3"):
        config_from_dict({"partition": {"num_clients": 4},
                          "server": {"min_clients": 3, "clients_per_round": 2}})  # fmt: skip
    with pytest.raises(ConfigError, match="sample_rate and server.clients_per_round both set"):
        config_from_dict({"partition": {"num_clients": 4},
                          "server": {"min_clients": 1, "clients_per_round": 2,
                                     "sample_rate": 0.5}})  # fmt: skip
    fixed = config_from_dict(
        {"partition": {"num_clients": 4}, "server": {"min_clients": 3, "clients_per_round": 3}}
    )
    assert fixed.server.clients_per_round == 3


def test_a_negative_run_seed_is_named() -> None:
    with pytest.raises(ConfigError, match=r"run.seed: invalid value; allowed: an integer in \[0"):
        config_from_dict({"run": {"seed": -1}})


def test_an_unset_scale_and_margin_are_the_heads_own_defaults() -> None:
    from fl_secure.models.heads import CombinedMargin
    from fl_secure.training import build_model

    # ArcFace as HF-MAML ran it (s 8, m 0.5), CosFace as AdaFedFR (s 30, m 0.4)
    arc = config_from_dict({"model": {"head": "arcface", "backbone": "cnn-small"}}).model
    cos = config_from_dict({"model": {"backbone": "cnn-small"}}).model
    assert (arc.scale, arc.margin) == (8.0, 0.5) and (cos.scale, cos.margin) == (30.0, 0.4)
    margin = build_model(arc, 3, 32, 0).head.margin
    assert isinstance(margin, CombinedMargin) and (margin.s, margin.m2) == (8.0, 0.5)
    # what a config sets is kept; the resolved config (and so its fingerprint) names values
    set_ = config_from_dict({"model": {"head": "arcface", "scale": 16.0}}).model
    assert (set_.scale, set_.margin) == (16.0, 0.5)
    assert "scale = 30.0" in config_to_toml(config_from_dict({}))
