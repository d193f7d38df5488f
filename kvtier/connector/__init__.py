"""KV connectors: move KV between this engine's paged cache and somewhere else.

Connector authors subclass `KVConnectorScheduler`, `KVConnectorWorker` and `KVConnectorBase`
(see docs/connectors.md). Importing this package never imports torch.
"""

from kvtier.connector.base import (
                                   ConnectorContext,
                                   KVConnectorBase,
                                   KVConnectorMetadata,
                                   KVConnectorOutput,
                                   KVConnectorReport,
                                   KVConnectorRole,
                                   KVConnectorScheduler,
                                   KVConnectorWorker,
)
from kvtier.connector.config import KVTransferConfig, parse_options
from kvtier.connector.registry import (
                                   ConnectorLookupError,
                                   create_connector,
                                   get_connector_class,
                                   register_connector,
)

__all__ = [
    "ConnectorContext",
    "ConnectorLookupError",
    "KVConnectorBase",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorReport",
    "KVConnectorRole",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "KVTransferConfig",
    "create_connector",
    "get_connector_class",
    "parse_options",
    "register_connector",
]
