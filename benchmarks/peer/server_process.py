"""A benchmark server as a child process: start it, wait until it answers, stop its whole group.

Used for both engines of a comparison (kvtier serve and the peer vLLM server), so both are
started, probed and stopped the same way.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy before its deadline."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def threads_env(num_threads: int) -> dict[str, str]:
    """This process's environment with torch's CPU threads of a child server set to
    `num_threads` (several servers sharing the cores must not each take them all)."""
    return dict(os.environ, OMP_NUM_THREADS=str(num_threads), MKL_NUM_THREADS=str(num_threads))


class ServerProcess:
    """Context manager around one server process; `url` is its base URL, `startup_s` its start."""

    def __init__(self, command: list[str], env: dict[str, str], port: int, log_path: Path,
                 startup_timeout_s: float) -> None:
        self.command = command
        self.url = f"http://127.0.0.1:{port}"
        self.startup_s: float | None = None
        self._env = env
        self._log_path = log_path
        self._startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        started = time.monotonic()
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "w") as log:
            # Its own session, so that stop() reaches the workers the server forks.
            self._process = subprocess.Popen(self.command, env=self._env, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy(started + self._startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ServerStartError(f"{self.command[0]} exited with "
                                       f"{self._process.returncode}; see {self._log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet (vLLM compiles for about a minute first)
            time.sleep(1.0)
        raise ServerStartError(f"{self.url} not healthy after {self._startup_timeout_s} s; "
                               f"see {self._log_path}")

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it if still there after 30 s."""
        if self._process is None or self._process.poll() is not None:
            return
        os.killpg(self._process.pid, signal.SIGTERM)
        try:
            self._process.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(timeout=30.0)
