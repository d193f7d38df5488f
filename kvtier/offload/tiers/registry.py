"""Tier type -> class, imported only when a config names it.

Built-in tiers are "module:Class" strings so that choosing one tier never imports another's
dependencies. An out-of-tree tier is loaded with `module_path`: the module is imported and
`type` names the `SecondaryTier` subclass in it. A tier class may declare `options_cls`, a frozen
dataclass its options are parsed into (unknown keys are an error); without one it gets the dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.common.options import parse_options
from kvtier.common.plugins import PluginRegistry
from kvtier.offload.tiers.base import SecondaryTier, TierContext


class TierLookupError(ValueError):
    """A tier type, module or class could not be resolved."""


_REGISTRY = PluginRegistry("tier", SecondaryTier, TierLookupError, {
    "memory": "kvtier.offload.tiers.memory:MemoryTier",
    "fs": "kvtier.offload.tiers.fs:FsTier",
    "disk": "kvtier.offload.tiers.disk:DiskTier",
})


def get_tier_class(tier_type: str, module_path: str | None) -> type[SecondaryTier]:
    if module_path is not None:
        module_name, class_name = module_path, tier_type
    elif (target := _REGISTRY.target(tier_type)) is not None:
        module_name, class_name = target
    else:
        raise TierLookupError(f"unknown secondary tier type {tier_type!r}; built-in types are "
                              f"{_REGISTRY.names()} (or set module_path to load a tier "
                              f"class named {tier_type!r} from your own module)")
    return _REGISTRY.import_class(module_name, class_name)


def parse_tier_options(tier_type: str, module_path: str | None, raw: Mapping[str, Any],
                       where: str) -> Any:
    options_cls = getattr(get_tier_class(tier_type, module_path), "options_cls", None)
    if options_cls is None:
        return dict(raw)
    return parse_options(options_cls, raw, where)


def create_tier(tier_type: str, module_path: str | None, options: Any,
                context: TierContext) -> SecondaryTier:
    return get_tier_class(tier_type, module_path)(options, context)
