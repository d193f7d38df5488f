"""ExampleConnector with a chunk secret (a forged or unsigned block file is a counted load
error) and with a write hung in I/O (shutdown keeps its deadline and the process still exits)."""

import os
import stat
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
import xxhash

from kvtier.connector.example import BlockFiles
from kvtier.offload.chunk_format import HEADER_BYTES

from .connector_testing import CONTEXT, make_kv_caches, make_request, wait_finished_recving
from .test_example import save_prompt, start_load

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "a-secret-the-fleet-shares"


def _forge(path, other_path):
    """Put the payload of `other_path` into `path`, with a matching checksum; the MAC kept."""
    with open(path, "rb") as f:
        data = f.read()
    with open(other_path, "rb") as f:
        other = f.read()
    (payload_bytes,) = struct.unpack_from("<Q", data, 12)  # after magic, version, flags, key len
    payload = other[-payload_bytes:]
    with open(path, "wb") as f:
        f.write(data[:HEADER_BYTES - 16] + xxhash.xxh3_128(payload).digest()
                + data[HEADER_BYTES:-payload_bytes] + payload)


@pytest.mark.parametrize("how", [None, "forged", "unsigned"])
def test_with_a_secret_only_signed_block_files_load(tmp_path, monkeypatch, how):
    request = make_request("a", num_tokens=9)
    if how != "unsigned":
        monkeypatch.setenv("KVTIER_CHUNK_SECRET", SECRET)
    save_prompt(tmp_path, request, [1, 2, 3], make_kv_caches(seed=0))
    monkeypatch.setenv("KVTIER_CHUNK_SECRET", SECRET)
    files = BlockFiles(str(tmp_path), CONTEXT.namespace)
    path = files.path(request.block_hashes[0])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    if how == "forged":
        _forge(path, files.path(request.block_hashes[1]))
    worker, caches, _, matched = start_load(tmp_path, make_request("b", 9), [4, 5, 6])
    assert matched == (8, True)
    failed = wait_finished_recving(worker, "b")
    stats = worker.get_stats()
    worker.shutdown()
    if how is None:
        assert failed == set() and stats == {"example_connector_blocks_loaded": 2}
        return
    assert 4 in failed and stats["example_connector_load_errors"] == len(failed)
    assert all(torch.count_nonzero(cache[:, 4]) == 0 for cache in caches.values())


_HUNG_WRITE = textwrap.dedent("""
    import threading, time
    from kvtier.connector import KVConnectorRole, KVTransferConfig, create_connector
    from tests.connector.connector_testing import (CONTEXT, AllocatedBlocks, make_kv_caches,
                                                   make_request, prefill_output)
    config = KVTransferConfig("ExampleConnector", kv_connector_extra_config={{
        "shared_storage_path": {root!r}, "flush_timeout_s": 0.5}})
    scheduler = create_connector(config, KVConnectorRole.SCHEDULER, CONTEXT)
    worker = create_connector(config, KVConnectorRole.WORKER, CONTEXT)
    worker.register_kv_caches(make_kv_caches(seed=0))
    never = threading.Event()
    worker._write = lambda *args: never.wait()  # a write stuck in I/O on a hung file system
    request = make_request("a", num_tokens=9)
    scheduler.update_state_after_alloc(request, AllocatedBlocks([1, 2, 3]), 0)
    worker.bind_connector_metadata(scheduler.build_connector_meta(
        prefill_output(request, [1, 2, 3])))
    worker.wait_for_save()
    start = time.monotonic()
    worker.shutdown()
    print(round(time.monotonic() - start, 1))
""")


def test_a_hung_write_never_holds_the_process_at_exit(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _HUNG_WRITE.format(root=str(tmp_path))],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("the process did not exit: a hung write holds it") from None
    assert proc.returncode == 0, err[-2000:]
    assert 0.4 <= float(out.split()[-1]) < 5.0  # shutdown waited for its deadline, no longer
