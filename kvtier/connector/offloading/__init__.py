"""OffloadingConnector: the tiered offloading of kvtier.offload, glued to the connector API.

The scheduler half plans loads and stores against the tiering manager; the worker half copies
chunk bytes between the paged KV cache and the host area, and reports the copies it finished
in its `OffloadingConnectorReport`. The engine makes the host area once (`create_shared`) and
gives it to both halves (see shared.py).
"""

from typing import Any

from kvtier.connector.base import ConnectorContext, KVConnectorBase
from kvtier.connector.offloading.scheduler import OffloadingConnectorScheduler
from kvtier.connector.offloading.shared import OffloadingShared, create_offloading_shared
from kvtier.connector.offloading.worker import OffloadingConnectorWorker


class OffloadingConnector(KVConnectorBase):
    scheduler_cls = OffloadingConnectorScheduler
    worker_cls = OffloadingConnectorWorker

    @classmethod
    def create_shared(cls, config: Any, context: ConnectorContext) -> OffloadingShared:
        return create_offloading_shared(config, context)


__all__ = ["OffloadingConnector", "OffloadingConnectorScheduler", "OffloadingConnectorWorker",
           "OffloadingShared"]
