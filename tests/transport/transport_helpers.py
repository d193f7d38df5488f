"""Shared pieces of the transport tests: backends to run every contract test against, engines
that are shut down after each test, and waiting for results with a deadline."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable

from kvtier.transport import TransferEngine, TransferResult, TransportConfig, make_transfer_engine

NAMESPACE = hashlib.sha256(b"kvtier transport tests").digest()
OTHER_NAMESPACE = hashlib.sha256(b"another model").digest()
SECRET = b"0123456789abcdef-test-secret"


def _engine_of(backend: str) -> Callable[[TransportConfig], TransferEngine]:
    return lambda config: make_transfer_engine(dataclasses.replace(config, backend=backend))


# name -> (config -> engine). A new backend adds itself here and runs every contract test.
BACKENDS: dict[str, Callable[[TransportConfig], TransferEngine]] = {
    "zmq": _engine_of("zmq"),
    "mooncake": _engine_of("mooncake"),
}


def _unavailable() -> dict[str, str]:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return {"mooncake": f"Mooncake's transfer engine cannot be imported here ({exc}); "
                            f"pip install 'kvtier[mooncake]' (and apt-get install libibverbs1)"}
    return {}


# Backends whose package cannot be imported here, and why their tests are skipped.
UNAVAILABLE: dict[str, str] = _unavailable()


def wait_results(engine: TransferEngine, count: int, timeout_s: float) -> list[TransferResult]:
    """At least `count` results of `engine` (all it had), in completion order; fails past
    `timeout_s`."""
    results: list[TransferResult] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < count:
        assert time.monotonic() < deadline, f"only {len(results)} of {count} results: {results}"
        results += engine.get_finished()
        time.sleep(0.002)
    return results


def wait_until(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)
