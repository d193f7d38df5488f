"""Tier type -> class, imported only when a config names it.

Built-in tiers are "module:Class" strings so that choosing one tier never imports another's
dependencies. An out-of-tree tier is loaded with `module_path`: the module is imported and
`type` names the `SecondaryTier` subclass in it. A tier class may declare `options_cls`, a frozen
dataclass its options are parsed into (unknown keys are an error); without one it gets the dict.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Mapping

from kvtier.offload.options import parse_options
from kvtier.offload.tiers.base import SecondaryTier, TierContext


class TierLookupError(ValueError):
    """A tier type, module or class could not be resolved."""


_BUILTIN_TIERS: dict[str, str] = {
    "memory": "kvtier.offload.tiers.memory:MemoryTier",
    "fs": "kvtier.offload.tiers.fs:FsTier",
    "disk": "kvtier.offload.tiers.disk:DiskTier",
}


def get_tier_class(tier_type: str, module_path: str | None) -> type[SecondaryTier]:
    if module_path is not None:
        module_name, class_name = module_path, tier_type
    elif tier_type in _BUILTIN_TIERS:
        module_name, class_name = _BUILTIN_TIERS[tier_type].split(":")
    else:
        raise TierLookupError(f"unknown secondary tier type {tier_type!r}; built-in types are "
                              f"{sorted(_BUILTIN_TIERS)} (or set module_path to load a tier "
                              f"class named {tier_type!r} from your own module)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TierLookupError(f"cannot import tier module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if not (inspect.isclass(cls) and issubclass(cls, SecondaryTier)):
        raise TierLookupError(f"{module_name}.{class_name} is not a subclass of "
                              f"kvtier.offload.tiers.base.SecondaryTier")
    return cls


def parse_tier_options(tier_type: str, module_path: str | None, raw: Mapping[str, Any],
                       where: str) -> Any:
    options_cls = getattr(get_tier_class(tier_type, module_path), "options_cls", None)
    if options_cls is None:
        return dict(raw)
    return parse_options(options_cls, raw, where)


def create_tier(tier_type: str, module_path: str | None, options: Any,
                context: TierContext) -> SecondaryTier:
    return get_tier_class(tier_type, module_path)(options, context)
