"""CPU cost of writing chunks to the disk tier and to the fs tier, side by side.

Each tier stores `--chunks` chunks into an empty budget of that many chunks (the fresh pass),
then as many new ones again (the steady pass: every store replaces the least recently used
chunk, as a full tier does). Per pass it reports, per chunk: the process's CPU time (user and
system, getrusage) and the whole machine's (/proc/stat), both including a final `sync`, and the
wall time. The tiers' own threads do the work, as in the server.

    PYTHONPATH=. python benchmarks/tier_write_cost.py --chunks 2000 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

import numpy as np

from kvtier.offload.chunk_format import file_size
from kvtier.offload.keys import make_chunk_key
from kvtier.offload.tiers.base import TierContext, TransferJob
from kvtier.offload.tiers.disk import DiskTier, DiskTierOptions
from kvtier.offload.tiers.fs import FsTier, FsTierOptions

NAMESPACE = bytes(32)
# One block of SmolLM2-135M in bf16 with 16 tokens per block: the sweep's chunk.
CHUNK_BYTES = 2 * 16 * 3 * 64 * 2 * 30
DEADLINE_S = 600.0


def machine_busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def process_seconds() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def make_tier(kind: str, root: str, num_chunks: int):
    if kind == "disk":
        stride = 4096 + -(-CHUNK_BYTES // 4096) * 4096
        return DiskTier(DiskTierOptions(root_dir=root, max_bytes=4096 + num_chunks * stride),
                        TierContext("disk", NAMESPACE, max_chunk_bytes=CHUNK_BYTES))
    # The fs tier evicts down to 90% when over budget; this budget keeps it at num_chunks files.
    budget = num_chunks * file_size(make_chunk_key(NAMESPACE, 0, bytes(32)), CHUNK_BYTES)
    return FsTier(FsTierOptions(root_dir=root, max_bytes=budget),
                  TierContext("fs", NAMESPACE, max_chunk_bytes=CHUNK_BYTES))


def store_pass(tier, first: int, count: int, payload: memoryview) -> dict[str, float]:
    os.sync()
    user0, sys0 = process_seconds()
    busy0, wall0 = machine_busy_seconds(), time.monotonic()
    for n in range(first, first + count):
        key = make_chunk_key(NAMESPACE, 0, n.to_bytes(32, "big"))
        tier.submit_store(TransferJob(n, key, payload, time.monotonic() + DEADLINE_S))
    done, failed, deadline = 0, 0, time.monotonic() + DEADLINE_S
    while done < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count - done} stores still running after {DEADLINE_S} s")
        for result in tier.get_finished_jobs():
            done += 1
            failed += not result.ok
        time.sleep(0.001)
    os.sync()
    user1, sys1 = process_seconds()
    busy1, wall1 = machine_busy_seconds(), time.monotonic()
    ms = 1000.0 / count
    return {"failed": failed, "user_ms": (user1 - user0) * ms, "system_ms": (sys1 - sys0) * ms,
            "machine_ms": (busy1 - busy0) * ms, "wall_ms": (wall1 - wall0) * ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the tiers write (default: a temp dir)")
    args = p.parse_args()
    payload = memoryview(np.random.default_rng(0).integers(0, 256, CHUNK_BYTES, dtype=np.uint8))
    print(f"{args.chunks} chunks of {CHUNK_BYTES} bytes per pass; ms per chunk")
    print("| round | tier | pass | process user | process system | machine | wall | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for round_index in range(args.rounds):
        for kind in ("disk", "fs"):  # same round, same machine state: compare ratios
            with tempfile.TemporaryDirectory(prefix=f"kvtier-{kind}-cost-", dir=args.dir) as root:
                tier = make_tier(kind, root, args.chunks)
                try:
                    for name, first in (("fresh", 0), ("steady", args.chunks)):
                        r = store_pass(tier, first, args.chunks, payload)
                        print(f"| {round_index} | {kind} | {name} | {r['user_ms']:.3f} | "
                              f"{r['system_ms']:.3f} | {r['machine_ms']:.3f} | "
                              f"{r['wall_ms']:.3f} | {r['failed']} |", flush=True)
                finally:
                    tier.shutdown()


if __name__ == "__main__":
    main()
