"""A transfer engine in its own process, for tests that kill a peer.

Run as `python -m tests.transport.peer_process`; everything comes from the environment
(KVT_BACKEND, KVT_ROLE, KVT_ADDRESS, KVT_NAMESPACE, KVT_COUNT, KVT_SIZE), the secret too, never
argv. Transfers are "t0", "t1", ... of KVT_SIZE bytes of `payload(i, size)`.

* KVT_ROLE=send: connects to KVT_ADDRESS and sends KVT_COUNT transfers one after another,
  printing "connected", then "sent i ERROR" as each completes (ERROR is None on success).
* KVT_ROLE=recv: posts receives for the first 10 transfers, prints its address, and prints
  "received i OK" as each completes (OK: the bytes are right); the receives for the others are
  posted a second after the first result, so a test can kill it before they are.
"""

from __future__ import annotations

import os
import random
import sys
import time

from kvtier.transport import Region, TransferId, TransportConfig, load_secret
from tests.transport.transport_helpers import BACKENDS, wait_results


def payload(index: int, size: int) -> bytes:
    return random.Random(index).randbytes(size)


def main() -> None:
    env = os.environ
    count, size = int(env["KVT_COUNT"]), int(env["KVT_SIZE"])
    config = TransportConfig(namespace=bytes.fromhex(env["KVT_NAMESPACE"]), secret=load_secret())
    engine = BACKENDS[env["KVT_BACKEND"]](config)
    if env["KVT_ROLE"] == "recv":
        receive(engine, count, size)
    else:
        send(engine, env["KVT_ADDRESS"], count, size)
    engine.shutdown(timeout_s=5)


def receive(engine, count: int, size: int) -> None:
    data = bytearray(count * size)
    engine.register_buffer("dst", memoryview(data))
    first = min(count, 10)
    for i in range(first):
        engine.recv(TransferId(f"t{i}"), [Region("dst", i * size, size)], timeout_s=60)
    print(engine.address, flush=True)
    num_done = 0
    while num_done < count:
        for result in wait_results(engine, 1, timeout_s=60):  # printed as they come
            i = int(result.transfer_id[1:])
            intact = data[i * size:(i + 1) * size] == payload(i, size)
            print(f"received {i} {result.ok and intact}", flush=True)
            num_done += 1
        if first < count:
            time.sleep(1.0)
            for i in range(first, count):
                engine.recv(TransferId(f"t{i}"), [Region("dst", i * size, size)], timeout_s=60)
            first = count


def send(engine, address: str, count: int, size: int) -> None:
    data = bytearray(b"".join(payload(i, size) for i in range(count)))
    engine.register_buffer("src", memoryview(data))
    peer = engine.connect(address, timeout_s=10)
    print("connected", flush=True)
    for i in range(count):
        engine.send(peer, TransferId(f"t{i}"), [Region("src", i * size, size)], timeout_s=30)
        [result] = wait_results(engine, 1, timeout_s=30)
        print(f"sent {i} {result.error}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
