"""The scheduler: request queues, continuous batching, and the per-step SchedulerOutput."""

from kvtier.sched.config import SchedulerConfig
from kvtier.sched.errors import SchedulerQueueFullError
from kvtier.sched.output import (
                                 CachedRequestData,
                                 EngineCoreOutput,
                                 ModelRunnerOutput,
                                 NewRequestData,
                                 SchedulerOutput,
)
from kvtier.sched.request_queue import (
                                 FCFSRequestQueue,
                                 PriorityRequestQueue,
                                 RequestQueue,
                                 create_request_queue,
)
from kvtier.sched.scheduler import Scheduler
from kvtier.sched.stats import SchedulerStats

__all__ = [
    "CachedRequestData", "EngineCoreOutput", "FCFSRequestQueue", "ModelRunnerOutput",
    "NewRequestData", "PriorityRequestQueue", "RequestQueue", "Scheduler", "SchedulerConfig",
    "SchedulerOutput", "SchedulerQueueFullError", "SchedulerStats", "create_request_queue",
]
