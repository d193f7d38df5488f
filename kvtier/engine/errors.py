"""Errors the engine raises to its callers (the offline API and the server)."""


class EngineQueueFullError(RuntimeError):
    """The waiting queue is full (`max_waiting_requests`); retry later (a server answers 503)."""
