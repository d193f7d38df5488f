"""OffloadingConnector: the tiered offloading of kvtier.offload, glued to the connector API.

The scheduler half plans loads and stores against the tiering manager; the worker half copies
chunk bytes between the paged KV cache and the host area. Both halves share the host area, so
they must live in one process (see session.py).
"""

from kvtier.connector.base import KVConnectorBase
from kvtier.connector.offloading.scheduler import OffloadingConnectorScheduler
from kvtier.connector.offloading.worker import OffloadingConnectorWorker


class OffloadingConnector(KVConnectorBase):
    scheduler_cls = OffloadingConnectorScheduler
    worker_cls = OffloadingConnectorWorker


__all__ = ["OffloadingConnector", "OffloadingConnectorScheduler", "OffloadingConnectorWorker"]
