from __future__ import annotations

import pytest
import zmq

from kvtier.transport import TransportConfig
from tests.tiny_models import hf_greedy, make_block_prompts, make_hf_model
from tests.transport.p2p_helpers import MAX_TOKENS
from tests.transport.transport_helpers import BACKENDS, NAMESPACE, UNAVAILABLE


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(model dir, prompts, HF's greedy tokens for them) of a tiny random Llama."""
    model_dir = str(tmp_path_factory.mktemp("model"))
    prompts = make_block_prompts()
    return model_dir, prompts, hf_greedy(make_hf_model("llama", model_dir), prompts, MAX_TOKENS)


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


@pytest.fixture
def raw_peer():
    """A zmq socket that speaks the protocol by hand, as a test's stand-in peer."""
    ctx = zmq.Context()
    sockets = []

    def make(kind: int) -> zmq.Socket:
        sockets.append(ctx.socket(kind))
        sockets[-1].setsockopt(zmq.LINGER, 0)
        sockets[-1].setsockopt(zmq.RCVTIMEO, 5000)
        return sockets[-1]

    yield make
    for s in sockets:
        s.close()
    ctx.term()
