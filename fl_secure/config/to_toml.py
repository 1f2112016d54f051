"""A resolved configuration written back as TOML, and its fingerprint."""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from typing import Any

from fl_secure.config.run import Config


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
            lines.append(f"{f.name} = {_toml_value(getattr(sub, f.name))}")
        lines.append("")
    return "\n".join(lines)


def config_fingerprint(config: Config) -> str:
    """SHA-256 of the resolved config (its :func:`config_to_toml` text).

    Comments, key order and formatting of a config file do not change it; any value does.
    Checkpoints record it, so a resume can tell that config.toml was edited in between.
    """
    return hashlib.sha256(config_to_toml(config).encode()).hexdigest()
