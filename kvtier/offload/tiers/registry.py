"""Tier type -> class, imported only when a config names it.

Built-in tiers are "module:Class" strings so that choosing one tier never imports another's
dependencies. An out-of-tree tier is loaded with `module_path`: the module is imported and
`type` names the `SecondaryTier` subclass in it. A tier class may declare `options_cls`, a frozen
dataclass its options are parsed into (unknown keys are an error); without one it gets the dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
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
    "obj": "kvtier.offload.tiers.obj:ObjTier",
    "redis": "kvtier.offload.tiers.redis_tier:RedisTier",
    "p2p": "kvtier.offload.tiers.p2p:P2PTier",
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
                       where: str, common_keys: Sequence[str] = ()) -> Any:
    """The tier's own keys `raw` as its `options_cls`. `common_keys` (type, name, policies:
    already taken out of `raw`) are listed with the tier's own in an unknown-key error."""
    options_cls = getattr(get_tier_class(tier_type, module_path), "options_cls", None)
    if options_cls is None:
        return dict(raw)
    valid = {f.name for f in dataclasses.fields(options_cls)}
    unknown = sorted(set(raw) - valid)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; valid keys are "
                         f"{sorted(valid.union(common_keys))}")
    return parse_options(options_cls, raw, where)


def create_tier(tier_type: str, module_path: str | None, options: Any,
                context: TierContext) -> SecondaryTier:
    return get_tier_class(tier_type, module_path)(options, context)


def create_tiers(specs: Sequence[Any], make_context: Callable[[Any], TierContext],
                 ) -> list[SecondaryTier]:
    """One tier per spec (type, module_path, options), in order. When one cannot start, the
    ones already started are shut down (their threads, connections and file locks released)
    before the error goes on."""
    tiers: list[SecondaryTier] = []
    try:
        for spec in specs:
            tiers.append(create_tier(spec.type, spec.module_path, spec.options,
                                     make_context(spec)))
    except BaseException:
        for tier in tiers:
            tier.shutdown()
        raise
    return tiers
