"""A deadline for a connector's "cannot tell yet" (`get_num_new_matched_tokens` -> None).

A connector may answer None while it finds out (a chunk on its way up from a slower tier), and
the request waits for it. One that keeps answering None for `kv_load_timeout_s` no longer holds
the request: the scheduler admits it without the connector (no external tokens: it computes its
prompt itself) and counts a lookup timeout.
"""

from __future__ import annotations

from collections.abc import Callable


class ConnectorLookupDeadlines:
    def __init__(self, timeout_s: float, clock: Callable[[], float]) -> None:
        self._timeout_s = timeout_s
        self._clock = clock
        # req_id -> when the connector began answering None for it (since its last count).
        self._undecided_since: dict[str, float] = {}
        self.num_timeouts = 0

    def is_overdue(self, req_id: str, *, undecided: bool) -> bool:
        """The connector answered for `req_id`: None (`undecided`) or a count. True, counted as
        a timeout, once it has been answering None for longer than the deadline; a count
        ends the wait, so a later None starts a new deadline."""
        if not undecided:
            self._undecided_since.pop(req_id, None)
            return False
        now = self._clock()
        since = self._undecided_since.setdefault(req_id, now)
        if now - since <= self._timeout_s:
            return False
        del self._undecided_since[req_id]
        self.num_timeouts += 1
        return True

    def forget(self, req_id: str) -> None:
        """The request was admitted or finished: a later None starts a new deadline."""
        self._undecided_since.pop(req_id, None)
