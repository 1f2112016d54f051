"""The tiny synthetic federation the engine's tests run: one TOML shape, sized per test.

Every test here trains ``cnn-small`` (16-dimensional embeddings) on 32 px synthetic faces;
what differs is the population, the seed, the design, the local training and the server's
cohort rules, which the arguments set.
"""

from __future__ import annotations

from collections.abc import Mapping


def _toml_value(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


def _section(name: str, values: Mapping[str, object]) -> list[str]:
    return [f"[{name}]", *(f"{key} = {_toml_value(v)}" for key, v in values.items())]


def tiny_toml(
    *,
    name: str,
    seed: int,
    identities: int,
    clients: int,
    train: Mapping[str, object],
    server: Mapping[str, object] | None = None,
    images: int = 4,
    held_out: int = 6,
    algorithm: str = "fedavg",
    extra: str = "",
) -> str:
    """A run config of ``clients`` equal shares of ``identities`` synthetic identities."""
    data = {"source": "synthetic", "image_size": 32, "num_identities": identities,
            "images_per_identity": images, "held_out_identities": held_out}  # fmt: skip
    lines = [
        *_section("run", {"name": name, "seed": seed}),
        *_section("data", data),
        *_section("partition", {"kind": "equal", "num_clients": clients}),
        *_section("model", {"backbone": "cnn-small", "embedding_size": 16}),
        *_section("algorithm", {"name": algorithm}),
        *_section("train", train),
        *(_section("server", server) if server else []),
    ]
    return "\n".join(lines) + "\n" + extra
