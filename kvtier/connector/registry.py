"""Connector name -> class, imported only when asked for.

Built-in connectors are listed as "module:Class" strings so that choosing one connector never
imports another one's dependencies (torch, zmq, object-store clients). An out-of-tree connector
is loaded with `kv_connector_module_path`: the module is imported and `kv_connector` names the
`KVConnectorBase` subclass inside it.
"""

from __future__ import annotations

import importlib
import inspect

from kvtier.connector.base import (ConnectorContext, KVConnectorBase, KVConnectorRole,
                                   KVConnectorScheduler, KVConnectorWorker)
from kvtier.connector.config import KVTransferConfig


class ConnectorLookupError(ValueError):
    """A connector name, module or class could not be resolved."""


_BUILTIN_CONNECTORS: dict[str, str] = {
    "ExampleConnector": "kvtier.connector.example:ExampleConnector",
    "MultiConnector": "kvtier.connector.multi:MultiConnector",
    "OffloadingConnector": "kvtier.connector.offloading:OffloadingConnector",
}


def register_connector(name: str, target: str) -> None:
    """Make `name` resolve to `target` ("package.module:ClassName"), imported on first use."""
    if ":" not in target:
        raise ValueError(f"connector target must look like 'package.module:ClassName', "
                         f"got {target!r}")
    if name in _BUILTIN_CONNECTORS:
        raise ValueError(f"connector {name!r} is already registered "
                         f"as {_BUILTIN_CONNECTORS[name]!r}")
    _BUILTIN_CONNECTORS[name] = target


def registered_connectors() -> list[str]:
    return sorted(_BUILTIN_CONNECTORS)


def get_connector_class(config: KVTransferConfig) -> type[KVConnectorBase]:
    """The `KVConnectorBase` subclass that `config` names."""
    if config.kv_connector_module_path is not None:
        module_name, class_name = config.kv_connector_module_path, config.kv_connector
    elif config.kv_connector in _BUILTIN_CONNECTORS:
        module_name, class_name = _BUILTIN_CONNECTORS[config.kv_connector].split(":")
    else:
        raise ConnectorLookupError(
            f"unknown kv_connector {config.kv_connector!r}; registered connectors are "
            f"{registered_connectors()} (or set kv_connector_module_path to load one from "
            f"your own module)")
    return _check_connector_class(_import_attr(module_name, class_name), module_name)


def create_connector(config: KVTransferConfig, role: KVConnectorRole,
                     context: ConnectorContext) -> KVConnectorScheduler | KVConnectorWorker:
    """The `role` half of the connector `config` names."""
    return get_connector_class(config).create(role, config, context)


def _import_attr(module_name: str, attr: str) -> object:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConnectorLookupError(
            f"cannot import connector module {module_name!r}: {exc} (is it on PYTHONPATH?)"
        ) from exc
    if not hasattr(module, attr):
        found = [name for name, obj in vars(module).items()
                 if inspect.isclass(obj) and issubclass(obj, KVConnectorBase)
                 and obj is not KVConnectorBase]
        raise ConnectorLookupError(f"module {module_name!r} has no class {attr!r}; "
                                   f"connector classes in it: {sorted(found)}")
    return getattr(module, attr)


def _check_connector_class(obj: object, module_name: str) -> type[KVConnectorBase]:
    if not (inspect.isclass(obj) and issubclass(obj, KVConnectorBase)):
        raise ConnectorLookupError(f"{module_name}.{getattr(obj, '__name__', obj)!s} is not a "
                                   f"subclass of kvtier.connector.KVConnectorBase")
    halves = (("scheduler_cls", KVConnectorScheduler), ("worker_cls", KVConnectorWorker))
    for attr, base in halves:
        half = getattr(obj, attr, None)
        if not (inspect.isclass(half) and issubclass(half, base)):
            raise ConnectorLookupError(f"{obj.__name__}.{attr} must be a subclass of "
                                       f"{base.__name__}, got {half!r}")
    return obj
