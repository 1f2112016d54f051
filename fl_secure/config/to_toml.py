"""A resolved configuration written back as TOML, and its fingerprint."""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from fl_secure.config.run import Config

if TYPE_CHECKING:
    from collections.abc import Mapping

#: What a client reads of the run config it is sent at join (client/trainer_factory.py,
#: client/app.py, and privacy's client side: its accounting, site ledger and secure-round
#: checks): these sections whole (None), and of the others only the keys named. Never the
#: server's data paths, its data set's shape or its listening address.
CLIENT_KEYS: dict[str, tuple[str, ...] | None] = {
    "run": ("seed",),
    "data": ("image_size", "center_crop", "min_images_per_identity", "degrade"),
    # num_clients: server.min_clients is checked against it; seed: a site's own data is
    # degraded and split under Config.data_seed, as the server's held-out set is
    "partition": ("num_clients", "seed"),
    "model": None,
    "algorithm": None,
    "train": None,
    "server": ("min_clients", "max_retries"),
    "privacy": None,
    "secure_aggregation": None,
}


#: Keys added after runs recorded their config's fingerprint: written only when set, so a
#: config that leaves them at their default keeps the text (and fingerprint) it had before.
OMITTED_AT_DEFAULT: dict[tuple[str, str], Any] = {("partition", "seed"): -1}


def _written(section: str, name: str, value: Any) -> bool:
    """Whether ``section.name = value`` goes into the TOML text (see OMITTED_AT_DEFAULT)."""
    key = (section, name)
    return key not in OMITTED_AT_DEFAULT or value != OMITTED_AT_DEFAULT[key]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # a TOML basic string: JSON's escapes, and DEL, which TOML bans
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def config_to_toml(config: Config) -> str:
    """Resolved configuration as TOML text (what a run directory's config.toml holds)."""
    lines: list[str] = []
    for section in fields(config):
        lines.append(f"[{section.name}]")
        sub = getattr(config, section.name)
        for f in fields(sub):
            if _written(section.name, f.name, getattr(sub, f.name)):
                lines.append(f"{f.name} = {_toml_value(getattr(sub, f.name))}")
        lines.append("")
    return "\n".join(lines)


def config_sections_to_toml(
    config: Config, keep: Mapping[str, tuple[str, ...] | None] = CLIENT_KEYS
) -> str:
    """Part of ``config`` as TOML: the sections of ``keep``, each whole (None) or some keys.

    What is left out reads as its default when the text is loaded again
    (:func:`~fl_secure.config.loading.config_from_dict`).
    """
    lines: list[str] = []
    for section, keys in keep.items():
        sub = getattr(config, section)
        lines.append(f"[{section}]")
        for f in fields(sub):
            if (keys is None or f.name in keys) and _written(section, f.name, getattr(sub, f.name)):
                lines.append(f"{f.name} = {_toml_value(getattr(sub, f.name))}")
        lines.append("")
    return "\n".join(lines)


def config_fingerprint(config: Config) -> str:
    """SHA-256 of the resolved config (its :func:`config_to_toml` text).

    Comments, key order and formatting of a config file do not change it; any value does.
    Checkpoints record it, so a resume can tell that config.toml was edited in between.
    """
    return hashlib.sha256(config_to_toml(config).encode()).hexdigest()
