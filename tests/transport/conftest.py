from __future__ import annotations

import pytest

from kvtier.transport import TransportConfig
from tests.transport.transport_helpers import BACKENDS, NAMESPACE, UNAVAILABLE


@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.skipif(
    name in UNAVAILABLE, reason=UNAVAILABLE.get(name, ""))) for name in sorted(BACKENDS)])
def backend(request):
    return request.param


@pytest.fixture
def make_engine(backend):
    """Build engines of the test's backend; every one is shut down at the end of the test."""
    engines = []

    def make(namespace: bytes = NAMESPACE, secret: bytes | None = None):
        engine = BACKENDS[backend](TransportConfig(namespace=namespace, secret=secret))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown(timeout_s=2.0)
