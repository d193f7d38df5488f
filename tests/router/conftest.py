"""Three `kvtier serve` instances of a tiny random-weight model, each publishing its KV events,
and a `kvtier router` process in front of them (real processes, sockets and ports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ..entrypoints.server_process import REPO_ROOT, START_DEADLINE_S, ServerProcess, free_port
from ..tiny_models import make_hf_model

NUM_INSTANCES = 3
# 24 blocks of 16 tokens: a few conversations fit, a few more evict them.
NUM_DEVICE_BLOCKS = 24
BLOCK_SIZE = 16


def events_config() -> str:
    return json.dumps({"enable_kv_cache_events": True,
                       "endpoint": f"tcp://127.0.0.1:{free_port()}",
                       "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"})


def instance_args() -> list[str]:
    return ["--num-device-blocks", str(NUM_DEVICE_BLOCKS), "--block-size", str(BLOCK_SIZE),
            "--kv-offload", "host=1MiB", "--enable-prompt-tokens-details",
            "--kv-events-config", events_config()]


def all_indexed(state: dict) -> bool:
    return all(i["indexed"] for i in state["instances"])


class RouterProcess:
    def __init__(self, log_dir: str, instances: list[str], *extra: str, ready=all_indexed) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kvtier.entrypoints.cli", "router", "--port",
                   str(self.port), "--health-interval", "0.2", "--uvicorn-log-level", "warning",
                   *[arg for url in instances for arg in ("--instance", url)], *extra]
        self.log_path = os.path.join(log_dir, f"router-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=self._log,
                                        stderr=subprocess.STDOUT)
        self.wait_until(ready)

    def state(self) -> dict:
        return httpx.get(f"{self.url}/router/instances", timeout=5.0).json()

    def wait_until(self, ready, deadline_s: float = START_DEADLINE_S) -> dict:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"router exited with {self.process.returncode}: {self.log()}")
            try:
                state = self.state()
                if ready(state):
                    return state
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"router state not reached within {deadline_s} s: {self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
        self._log.close()


@pytest.fixture(scope="module")
def router_model(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("router_llama"))
    make_hf_model("llama", directory, tokenizer="bytes")
    return directory


@pytest.fixture(scope="module")
def cluster(router_model):
    """(router, [instances]) for one test module; the instances start in parallel."""
    with ThreadPoolExecutor(NUM_INSTANCES) as pool:
        starts = [pool.submit(ServerProcess, router_model, *instance_args())
                  for _ in range(NUM_INSTANCES)]
        instances = [start.result() for start in starts]
    router = None
    try:
        router = RouterProcess(router_model, [i.url for i in instances])
        yield router, instances
    finally:
        if router is not None:
            router.stop()
        for instance in instances:
            instance.stop()
