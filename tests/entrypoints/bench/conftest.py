"""The `fake_server` fixture: a started FakeOpenAIServer (fake_server.py), stopped after the
test."""

from collections.abc import Iterator

import pytest

from .fake_server import FakeOpenAIServer


@pytest.fixture
def fake_server() -> Iterator[FakeOpenAIServer]:
    server = FakeOpenAIServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
