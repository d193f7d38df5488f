"""Errors the scheduler raises to its caller."""


class SchedulerQueueFullError(RuntimeError):
    """The waiting queue holds `max_waiting_requests` already; the caller should shed load
    (a server answers 503)."""
