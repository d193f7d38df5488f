"""The state both halves of one OffloadingConnector share inside one process.

The host area is the meeting point of the design: the scheduler half (through the tiering
manager) decides which chunk lives in which slot, the worker half copies device blocks in and
out of those slots, and the secondary tiers read and write them. The halves find each other by
the session id carried in every step's metadata, and the worker hands back store completions
through `completions`, which the scheduler half drains each step.
"""

from __future__ import annotations

import queue
import threading
import uuid
from dataclasses import dataclass, field

from kvtier.offload.layout import ChunkLayout
from kvtier.offload.manager import TieringManager


@dataclass(frozen=True)
class BatchDone:
    """The worker finished one batch of copies in `direction` ("device_to_host" or
    "host_to_device"). `job_ids` are the store jobs it completes (loads are reported per request
    through finished_recving instead); `ok` False means none of them holds valid data."""

    direction: str
    job_ids: tuple[int, ...]
    ok: bool
    num_bytes: int
    seconds: float
    # time.monotonic() when the batch ended (busy-time metrics)
    ended: float


@dataclass
class OffloadSession:
    manager: TieringManager
    # One layout per KV cache group, in group order.
    layouts: tuple[ChunkLayout, ...]
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    completions: queue.SimpleQueue[BatchDone] = field(default_factory=queue.SimpleQueue)


class SessionNotFoundError(LookupError):
    """Metadata named a session that is not open in this process."""


_sessions: dict[str, OffloadSession] = {}
_lock = threading.Lock()


def open_session(manager: TieringManager, layouts: tuple[ChunkLayout, ...]) -> OffloadSession:
    session = OffloadSession(manager, layouts)
    with _lock:
        _sessions[session.session_id] = session
    return session


def find_session(session_id: str) -> OffloadSession:
    with _lock:
        session = _sessions.get(session_id)
    if session is None:
        raise SessionNotFoundError(
            f"offloading session {session_id!r} is not open in this process; both halves of "
            f"OffloadingConnector must run in the same process (the host area is shared memory)")
    return session


def close_session(session_id: str) -> None:
    with _lock:
        _sessions.pop(session_id, None)
