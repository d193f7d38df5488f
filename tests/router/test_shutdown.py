"""`kvtier router` ends within --shutdown-timeout of a SIGTERM, whatever its clients do."""

import argparse
import signal
import socket
import time

import pytest

from kvtier.router.cli import add_arguments, config_from_args

from .conftest import RouterProcess


def _stall_mid_body(url: str) -> socket.socket:
    """A client that sends a request's headers and half its body, then stalls: the router's
    handler waits for the rest."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5.0)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    return sock


def test_a_client_stalled_mid_request_does_not_hold_the_exit(tmp_path):
    # An instance that is down: the stalled request never gets as far as choosing one.
    router = RouterProcess(str(tmp_path), ["http://127.0.0.1:9"], "--model", str(tmp_path),
                           "--shutdown-timeout", "1", ready=lambda state: True)
    try:
        with _stall_mid_body(router.url):
            time.sleep(0.5)  # the request is in the router's hands
            started = time.monotonic()
            router.process.send_signal(signal.SIGTERM)
            router.process.wait(20)
            assert time.monotonic() - started < 10
    finally:
        router.stop()


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_shutdown_timeout_must_be_positive(value):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--instance", "http://127.0.0.1:9", "--shutdown-timeout", value])
    with pytest.raises(ValueError, match="--shutdown-timeout must be a finite number"):
        config_from_args(args)
