"""``train.trainable``: which backbone parameters train (and are shared), which stay frozen.

Private fine-tuning of a pretrained backbone trains a small part of it (De et al. 2022,
"Unlocking high-accuracy differentially private image classification through scale": the
DP noise grows with the number of trained parameters). The selector is a comma-separated
list; each item is an alias the backbone defines or a shell-style pattern over its
parameter names (``fnmatch``)::

    all                     every parameter (the default)
    embedding               the layer that outputs the embedding
    last-stage              the last residual stage and the embedding layer
    blocks.13.*,embedding.* patterns over state-dict names

A frozen parameter gets ``requires_grad = False``: no gradient, no optimizer step, no
clipping, no noise; it is not among the shared tensors (every party loads it from the same
pretrained file), so it is never masked, sent or accounted. Frozen batch-norm layers also
keep their running statistics (:func:`keep_frozen_norms_in_eval`).

When only the last layers train, a site may compute the frozen trunk's features once
(:func:`can_cache_trunk`): backbones that support it map a 2-D ``[N, D]`` input of
trunk features straight through their tail (``FaceCNN``, ``DlibResNet``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

from fl_secure.errors import ConfigError

ALL = "all"

#: Aliases for backbones that do not define ``TRAINABLE_ALIASES`` (torchvision ResNets).
_TORCHVISION_ALIASES: Mapping[str, tuple[str, ...]] = {
    "embedding": ("fc.*",),
    "last-stage": ("layer4.*", "fc.*"),
}


def trainable_aliases(backbone: nn.Module) -> Mapping[str, tuple[str, ...]]:
    """The backbone's named selectors: alias -> parameter-name patterns."""
    own = getattr(backbone, "TRAINABLE_ALIASES", None)
    if own is not None:
        return dict(own)
    names = {name for name, _ in backbone.named_children()}
    if {"fc", "layer4"} <= names:
        return dict(_TORCHVISION_ALIASES)
    return {}


def parse_trainable(spec: str) -> tuple[str, ...]:
    """The selector's items, stripped; ``("all",)`` for ``"all"``.

    Raises:
        ConfigError: an empty selector or an empty item (``"embedding,"``).
    """
    items = tuple(item.strip() for item in spec.split(","))
    if not spec.strip() or any(not item for item in items):
        raise ConfigError(
            f"train.trainable = {spec!r}: expected 'all' or a comma-separated list of "
            "aliases (embedding, last-stage) and parameter-name patterns (e.g. 'layer4.*')"
        )
    if ALL in items and len(items) > 1:
        raise ConfigError(f"train.trainable = {spec!r}: 'all' cannot be combined with others")
    return items


def select_trainable(backbone: nn.Module, spec: str, *, backbone_name: str = "") -> list[str]:
    """Names of the backbone parameters ``spec`` selects, in the module's order.

    Raises:
        ConfigError: naming any item that selects no parameter, with the backbone's aliases
            and top-level modules to choose from.
    """
    items = parse_trainable(spec)
    names = [name for name, _ in backbone.named_parameters()]
    if items == (ALL,):
        return names
    aliases = trainable_aliases(backbone)
    chosen: set[str] = set()
    for item in items:
        patterns = aliases.get(item, (item,))
        hits = {n for n in names for p in patterns if fnmatch.fnmatchcase(n, p)}
        if not hits:
            modules = ", ".join(name for name, _ in backbone.named_children())
            which = f"the {backbone_name} backbone" if backbone_name else "the backbone"
            raise ConfigError(
                f"train.trainable: {item!r} names no parameter of {which}; aliases: "
                f"{', '.join([ALL, *aliases]) or ALL}; top-level modules: {modules} "
                f"(patterns match parameter names such as {names[-1]!r})"
            )
        chosen |= hits
    return [n for n in names if n in chosen]


def apply_trainable(backbone: nn.Module, spec: str, *, backbone_name: str = "") -> list[str]:
    """Freeze every backbone parameter ``spec`` does not select; return the selected names."""
    selected = set(select_trainable(backbone, spec, backbone_name=backbone_name))
    for name, param in backbone.named_parameters():
        param.requires_grad_(name in selected)
    return [n for n, _ in backbone.named_parameters() if n in selected]


def is_partly_frozen(backbone: nn.Module) -> bool:
    """Whether some backbone parameter is frozen (``train.trainable`` other than ``all``)."""
    return any(not p.requires_grad for p in backbone.parameters())


def trained_state_names(backbone: nn.Module) -> list[str]:
    """State-dict names that training changes, in the module's order.

    The trainable parameters, and the buffers of the modules that own one (a trained
    batch-norm layer's running statistics).
    """
    names: list[str] = []
    for prefix, module in backbone.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not any(p.requires_grad for p in own.values()):
            continue
        dot = f"{prefix}." if prefix else ""
        names += [dot + n for n, p in own.items() if p.requires_grad]
        names += [dot + n for n, _ in module.named_buffers(recurse=False)]
    return names


def keep_frozen_norms_in_eval(module: nn.Module) -> None:
    """Put batch-norm layers whose parameters are all frozen into evaluation mode.

    In training mode a batch-norm layer updates its running statistics even when its
    weights are frozen; those statistics are not shared, so each site's would drift from
    the pretrained ones, and the server's evaluation would use others again.
    """
    for child in module.modules():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            params = list(child.parameters(recurse=False))
            if params and not any(p.requires_grad for p in params):
                child.eval()


def can_cache_trunk(backbone: nn.Module) -> bool:
    """Whether every trainable parameter lies in the tail, so the trunk's features can be cached.

    The backbone decides through its ``can_cache_trunk()`` (``FaceCNN``: only the embedding
    layer trains; ``DlibResNet``: any frozen stem and first blocks); one without it cannot.
    """
    own = getattr(backbone, "can_cache_trunk", None)
    return callable(own) and is_partly_frozen(backbone) and bool(own())
