"""Runs `kvtier serve` in a subprocess on a free port, and stops it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

# Loading torch and the model under a shared, busy CPU can take a while.
START_DEADLINE_S = 120.0
STOP_DEADLINE_S = 30.0
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# A free port can be taken between the check and the server's bind (another test's server or
# a listener the servers open themselves): the start is tried again on a new port.
_PORT_ATTEMPTS = 3


class ServerProcess:
    def __init__(self, model_dir: str, *extra_args: str, sigint_ignored: bool = False) -> None:
        """`sigint_ignored`: started as a shell starts a background job, SIGINT ignored."""
        self._sigint_ignored = sigint_ignored
        for attempt in range(_PORT_ATTEMPTS):
            self._start(model_dir, extra_args)
            try:
                self._wait_healthy()
                return
            except RuntimeError:
                if attempt + 1 == _PORT_ATTEMPTS or "address already in use" not in self.log():
                    raise
                self._log.close()

    def _start(self, model_dir: str, extra_args: tuple[str, ...]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kvtier.entrypoints.cli", "serve", model_dir,
                   "--port", str(self.port), "--dtype", "float32",
                   "--uvicorn-log-level", "warning", *extra_args]
        self.log_path = os.path.join(model_dir, f"server-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=self._log,
                                        stderr=subprocess.STDOUT,
                                        preexec_fn=_ignore_sigint if self._sigint_ignored
                                        else None)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}: {self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy within {START_DEADLINE_S} s: {self.log()}")

    def post(self, path: str, body: dict, timeout: float = 60.0) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=timeout)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def terminate(self) -> int:
        """SIGTERM, then wait for the exit code (killing it past the deadline)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(STOP_DEADLINE_S)

    def stop(self) -> None:
        self.terminate()
        self._log.close()


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
