"""A transfer engine in its own process, for tests that kill a peer.

Run as `python -m tests.transport.peer_process`; everything comes from the environment
(KVT_BACKEND, KVT_ADDRESS, KVT_NAMESPACE, KVT_COUNT, KVT_SIZE), the secret too, never argv.
It connects to KVT_ADDRESS and sends KVT_COUNT transfers "t0", "t1", ... of KVT_SIZE bytes of
`payload(i, size)`, one after another, printing "sent i" as each completes.
"""

from __future__ import annotations

import os
import random
import sys

from kvtier.transport import Region, TransferId, TransportConfig, load_secret
from tests.transport.transport_helpers import BACKENDS, wait_results


def payload(index: int, size: int) -> bytes:
    return random.Random(index).randbytes(size)


def main() -> None:
    env = os.environ
    count, size = int(env["KVT_COUNT"]), int(env["KVT_SIZE"])
    config = TransportConfig(namespace=bytes.fromhex(env["KVT_NAMESPACE"]), secret=load_secret())
    engine = BACKENDS[env["KVT_BACKEND"]](config)
    data = bytearray(b"".join(payload(i, size) for i in range(count)))
    engine.register_buffer("src", memoryview(data))
    peer = engine.connect(env["KVT_ADDRESS"], timeout_s=10)
    print("connected", flush=True)
    for i in range(count):
        engine.send(peer, TransferId(f"t{i}"), [Region("src", i * size, size)], timeout_s=30)
        [result] = wait_results(engine, 1, timeout_s=30)
        print(f"sent {i} {result.error}", flush=True)
    engine.shutdown(timeout_s=5)


if __name__ == "__main__":
    sys.exit(main())
