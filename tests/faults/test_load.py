"""Load with a no-leak check, and a soak run with flat memory and KV usage.

The load test (in the fault suite) drives a real `kvtier serve` with host and disk tiers with
32 concurrent mixed clients, then checks that nothing was lost or leaked: no 5xx, every request
answered, nothing running or waiting, every KV block back. The soak test (`-m soak`, about 20
minutes) runs the same load for KVTIER_SOAK_S seconds (default 1200) and checks that the
server's memory and KV usage stay flat.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from ..entrypoints.server_process import ServerProcess
from ..tiny_models import make_hf_model
from .load import gauges, run_load, settled

SOAK_S = float(os.environ.get("KVTIER_SOAK_S", "1200"))
# RSS may grow this much from the end of the first round to the end of the run (allocator
# caches, prefix and host caches filling); a leak of a few KiB per request grows far more.
SOAK_RSS_GROWTH = 0.10


@pytest.fixture
def server(tmp_path):
    make_hf_model("llama", str(tmp_path / "model"), tokenizer="bytes")
    process = ServerProcess(
        str(tmp_path / "model"), "--max-num-seqs", "16", "--num-device-blocks", "256",
        "--kv-offload", f"host=16MiB,disk={tmp_path / 'disk'}:64MiB")
    yield process
    process.stop()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _check_round(url: str, result) -> None:
    assert not [s for s in result.statuses if s >= 500], result.statuses
    assert result.statuses.get(200, 0) > 0 and result.statuses.get(400, 0) > 0
    assert asyncio.run(settled(url)) == {"vllm:num_requests_running": 0,
                                         "vllm:num_requests_waiting": 0,
                                         "vllm:kv_cache_usage_perc": 0}


def test_mixed_load_loses_and_leaks_nothing(server):
    result = asyncio.run(run_load(server.url, num_clients=32, requests_per_client=6, seed=1))
    assert result.num_disconnects > 0
    _check_round(server.url, result)


@pytest.mark.soak
@pytest.mark.timeout(SOAK_S + 600)
def test_soak_keeps_memory_and_kv_usage_flat(server):
    pid, rounds, rss = server.process.pid, 0, []
    deadline = time.monotonic() + SOAK_S
    while time.monotonic() < deadline:
        result = asyncio.run(run_load(server.url, num_clients=16, requests_per_client=10,
                                      seed=rounds))
        _check_round(server.url, result)
        rss.append(_rss_bytes(pid))
        rounds += 1
        print(f"soak round {rounds}: RSS {rss[-1] >> 20} MiB, statuses {result.statuses}",
              flush=True)
    assert rounds >= 2, "KVTIER_SOAK_S too short for two rounds"
    print(f"soak: {rounds} rounds, RSS {rss[0] >> 20} -> {rss[-1] >> 20} MiB, "
          f"max {max(rss) >> 20} MiB; gauges {gauges(server.url)}")
    assert rss[-1] <= rss[0] * (1 + SOAK_RSS_GROWTH)
