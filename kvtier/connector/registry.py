"""Connector name -> class, imported only when asked for.

Built-in connectors are listed as "module:Class" strings so that choosing one connector never
imports another one's dependencies (torch, zmq, object-store clients). An out-of-tree connector
is loaded with `kv_connector_module_path`: the module is imported and `kv_connector` names the
`KVConnectorBase` subclass inside it.
"""

from __future__ import annotations

import inspect

from kvtier.common.plugins import PluginRegistry
from kvtier.connector.base import (
    ConnectorContext,
    KVConnectorBase,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from kvtier.connector.config import KVTransferConfig


class ConnectorLookupError(ValueError):
    """A connector name, module or class could not be resolved."""


_REGISTRY = PluginRegistry("connector", KVConnectorBase, ConnectorLookupError, {
    "ExampleConnector": "kvtier.connector.example:ExampleConnector",
    "MultiConnector": "kvtier.connector.multi:MultiConnector",
    "OffloadingConnector": "kvtier.connector.offloading:OffloadingConnector",
    "P2PConnector": "kvtier.connector.p2p:P2PConnector",
})


def register_connector(name: str, target: str) -> None:
    """Make `name` resolve to `target` ("package.module:ClassName"), imported on first use."""
    _REGISTRY.register(name, target)


def registered_connectors() -> list[str]:
    return _REGISTRY.names()


def get_connector_class(config: KVTransferConfig) -> type[KVConnectorBase]:
    """The `KVConnectorBase` subclass that `config` names."""
    if config.kv_connector_module_path is not None:
        module_name, class_name = config.kv_connector_module_path, config.kv_connector
    elif (target := _REGISTRY.target(config.kv_connector)) is not None:
        module_name, class_name = target
    else:
        raise ConnectorLookupError(
            f"unknown kv_connector {config.kv_connector!r}; registered connectors are "
            f"{registered_connectors()} (or set kv_connector_module_path to load one from "
            f"your own module)")
    return _check_halves(_REGISTRY.import_class(module_name, class_name))


def create_connector(config: KVTransferConfig, role: KVConnectorRole,
                     context: ConnectorContext) -> KVConnectorScheduler | KVConnectorWorker:
    """The `role` half of the connector `config` names."""
    return get_connector_class(config).create(role, config, context)


def _check_halves(cls: type[KVConnectorBase]) -> type[KVConnectorBase]:
    halves = (("scheduler_cls", KVConnectorScheduler), ("worker_cls", KVConnectorWorker))
    for attr, base in halves:
        half = getattr(cls, attr, None)
        if not (inspect.isclass(half) and issubclass(half, base)):
            raise ConnectorLookupError(f"{cls.__name__}.{attr} must be a subclass of "
                                       f"{base.__name__}, got {half!r}")
    return cls
