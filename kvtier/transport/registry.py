"""Builds the transfer engine a `TransportConfig` names, importing only that backend's package."""

from __future__ import annotations

import importlib

from kvtier.transport.base import TransferEngine
from kvtier.transport.config import TransportConfig

# backend -> (module, class); every name in config.BACKENDS has an entry.
_ENGINES = {
    "zmq": ("kvtier.transport.zmq_engine", "ZmqTransferEngine"),
    "mooncake": ("kvtier.transport.mooncake_engine", "MooncakeTransferEngine"),
}


def make_transfer_engine(config: TransportConfig, engine_id: str | None = None) -> TransferEngine:
    """A started engine of `config.backend`; BackendUnavailableError when its package is not
    installed."""
    module, name = _ENGINES[config.backend]
    return getattr(importlib.import_module(module), name)(config, engine_id)
