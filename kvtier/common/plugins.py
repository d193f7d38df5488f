"""Plugin classes named by the user: a built-in name, or a class in the user's own module.

Built-ins are "package.module:Class" strings, imported on first use, so choosing one plugin never
imports another one's dependencies (torch, zmq, store clients).
"""

from __future__ import annotations

import importlib
import inspect
from typing import TypeVar

PluginT = TypeVar("PluginT")
# Packages built-in plugins import that a plain install lacks -> the extra that brings them.
_EXTRAS = {"boto3": "stores", "botocore": "stores", "redis": "stores",
           "mooncake": "mooncake"}


class PluginRegistry:
    """Names of one kind of plugin (`what`: "connector", "tier", ...) -> their classes."""

    def __init__(self, what: str, base: type, error_cls: type[ValueError],
                 builtins: dict[str, str]) -> None:
        self.what = what
        self.base = base
        self.error_cls = error_cls
        self._targets = dict(builtins)

    def register(self, name: str, target: str) -> None:
        """Make `name` resolve to `target` ("package.module:ClassName"), imported on first use."""
        if ":" not in target:
            raise ValueError(f"{self.what} target must look like 'package.module:ClassName', "
                             f"got {target!r}")
        if name in self._targets:
            raise ValueError(f"{self.what} {name!r} is already registered "
                             f"as {self._targets[name]!r}")
        self._targets[name] = target

    def names(self) -> list[str]:
        return sorted(self._targets)

    def target(self, name: str) -> tuple[str, str] | None:
        """(module, class name) of a registered name, or None."""
        target = self._targets.get(name)
        return None if target is None else tuple(target.split(":"))  # type: ignore[return-value]

    def import_class(self, module_name: str, class_name: str) -> type:
        """`class_name` from `module_name`; `error_cls` naming the problem when the module does
        not import or the class is missing or not a subclass of `base`."""
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            missing = (getattr(exc, "name", None) or "").split(".")[0]
            if missing in _EXTRAS:
                raise self.error_cls(f"{self.what} module {module_name!r} needs the package "
                                     f"{missing!r}, which is not installed: pip install "
                                     f"'kvtier[{_EXTRAS[missing]}]'") from exc
            raise self.error_cls(f"cannot import {self.what} module {module_name!r}: {exc} "
                                 f"(is it on PYTHONPATH?)") from exc
        if not hasattr(module, class_name):
            found = sorted(name for name, obj in vars(module).items()
                           if inspect.isclass(obj) and issubclass(obj, self.base)
                           and obj is not self.base)
            raise self.error_cls(f"module {module_name!r} has no class {class_name!r}; "
                                 f"{self.what} classes in it: {found}")
        cls = getattr(module, class_name)
        if not (inspect.isclass(cls) and issubclass(cls, self.base)):
            raise self.error_cls(f"{module_name}.{class_name} is not a subclass of "
                                 f"{self.base.__module__}.{self.base.__qualname__}")
        return cls
