"""Finished requests whose blocks a KV transfer still uses.

A request that finishes while its load is in flight ("recving"), or whose connector keeps its
blocks for a send ("sending"), is held here: its blocks are freed once every transfer it waits
on has ended. The engine keeps stepping until then, for at most the deadline; the blocks of a
transfer never reported stay held, never handed to another request while a copy may touch them.
"""

from __future__ import annotations

from collections.abc import Callable


class DelayedFrees:
    def __init__(self, clock: Callable[[], float], timeout_s: float,
                 release: Callable[[str], None]) -> None:
        self._clock = clock
        self._timeout_s = timeout_s
        self._release = release
        # request id -> (transfer kinds still running, deadline)
        self._held: dict[str, tuple[set[str], float]] = {}

    def hold(self, req_id: str, pending: set[str]) -> None:
        """Free the request's blocks once each transfer in `pending` ended; now if none."""
        if pending:
            self._held[req_id] = (pending, self._clock() + self._timeout_s)
        else:
            self._release(req_id)

    def transfer_ended(self, req_id: str, kind: str) -> bool:
        """A transfer of a held request ended; True if that transfer was awaited."""
        pending = self._held.get(req_id, (set(), 0.0))[0]
        if kind not in pending:
            return False
        pending.discard(kind)
        if not pending:
            del self._held[req_id]
            self._release(req_id)
        return True

    def has_pending(self) -> bool:
        """Some held request is still within its deadline."""
        now = self._clock()
        return any(now <= deadline for _, deadline in self._held.values())
