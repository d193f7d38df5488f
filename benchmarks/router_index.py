"""Micro-benchmark of the router's KV index: event ingest rate and routing decision latency.

`--instances` instances each publish `--blocks-per-instance` stored blocks as real event batches
(msgpack payloads in the wire schema, decoded and applied exactly as the router's subscriber
does), a share of them removed again; blocks come in conversation chains, a share of which are
system prompts every instance holds. Then the kv-aware policy decides for prompts of
`--prompt-blocks` blocks (prefixes the index holds, on a random instance, and cold ones); each
decision is timed alone. Prompt hashing is timed apart: it depends on the prompt, not the index.

    python benchmarks/router_index.py                 # 16 instances x 1M blocks
    python benchmarks/router_index.py --json
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import time

from kvtier.events import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from kvtier.router.config import RouterConfig
from kvtier.router.index import KVIndex
from kvtier.router.instances import Instance
from kvtier.router.policy import Router
from kvtier.router.prompts import PromptHasher

BLOCK_SIZE = 16
BLOCKS_PER_EVENT = 16
EVENTS_PER_BATCH = 4
NUM_SYSTEM_PROMPTS = 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--blocks-per-instance", type=int, default=1_000_000)
    parser.add_argument("--index-max-blocks", type=int, default=1_000_000)
    parser.add_argument("--shared-share", type=float, default=0.25,
                        help="share of stored blocks that are system prompts all instances hold")
    parser.add_argument("--removed-share", type=float, default=0.2,
                        help="share of stored blocks removed again (evictions)")
    parser.add_argument("--prompt-blocks", type=int, default=128)
    parser.add_argument("--decisions", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


def instance_batches(rng: random.Random, system: list[list[int]], num_blocks: int,
                     args: argparse.Namespace) -> tuple[list[bytes], list[list[int]]]:
    """One instance's event payloads, and the chains it stored (for prompts later)."""
    payloads, chains, events = [], [], []
    stored = 0
    while stored < num_blocks:
        if rng.random() < args.shared_share:
            chain = rng.choice(system)
        else:
            chain = [rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)]
        chains.append(chain)
        events.append(BlockStored(chain, None, [], BLOCK_SIZE, None, "GPU"))
        if rng.random() < args.removed_share:
            events.append(BlockRemoved(chain[-4:], "GPU"))
        stored += len(chain)
        if len(events) >= EVENTS_PER_BATCH:
            payloads.append(encode_batch(EventBatch(0.0, events)))
            events = []
    if events:
        payloads.append(encode_batch(EventBatch(0.0, events)))
    return payloads, chains


def ingest(index: KVIndex, slot: int, payloads: list[bytes]) -> float:
    """Seconds to decode and apply the payloads, as the subscriber does."""
    start = time.perf_counter()
    for payload in payloads:
        for event in decode_batch(payload).events:
            if isinstance(event, BlockStored):
                index.store(slot, event.block_hashes, event.medium, event.locality)
            else:
                index.remove(slot, event.block_hashes, event.medium, event.locality)
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    args = parse_args()
    rng = random.Random(args.seed)
    system = [[rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)]
              for _ in range(NUM_SYSTEM_PROMPTS)]
    urls = tuple(f"http://instance-{i}:8000" for i in range(args.instances))
    config = RouterConfig(instances=urls, index_max_blocks=args.index_max_blocks)
    index = KVIndex(config.index_max_blocks, config.tier_weights)
    instances = [Instance(url, slot, healthy=True, indexed=True)
                 for slot, url in enumerate(urls, start=1)]
    ingest_s, num_events_blocks, recent = 0.0, 0, []
    for instance in instances:
        payloads, chains = instance_batches(rng, system, args.blocks_per_instance, args)
        ingest_s += ingest(index, instance.slot, payloads)
        num_events_blocks += sum(len(c) for c in chains)
        recent.append(chains[-2000:])  # still in the index: the LRU keeps the latest
    router = Router(config, instances, index)
    prompts = []
    for _ in range(args.decisions):
        warm = rng.random() < 0.8
        # A system prompt, then a conversation's chains (4 of one instance's latest).
        chains = rng.sample(rng.choice(recent), 4) if warm else []
        head = rng.choice(system) + [h for chain in chains for h in chain] if warm else []
        tail = [rng.getrandbits(64) for _ in range(args.prompt_blocks - len(head))]
        prompts.append((head + tail)[:args.prompt_blocks])
    # Wall time, and this thread's CPU time: on a shared machine the wall tail is mostly time
    # the process spent descheduled, which the CPU time leaves out.
    times, cpu_times = [], []
    for prompt in prompts:
        start, cpu_start = time.perf_counter(), time.thread_time()
        router.choose(prompt, BLOCK_SIZE)
        cpu_times.append(time.thread_time() - cpu_start)
        times.append(time.perf_counter() - start)
    hasher = PromptHasher(None, BLOCK_SIZE, "sha256_cbor")
    token_ids = [rng.randrange(32000) for _ in range(args.prompt_blocks * BLOCK_SIZE)]
    hash_times = []
    for _ in range(50):
        start = time.perf_counter()
        hasher.block_hashes_of(token_ids)
        hash_times.append(time.perf_counter() - start)
    report = {
        "instances": args.instances, "blocks_per_instance": args.blocks_per_instance,
        "blocks_ingested": num_events_blocks, "index_max_blocks": args.index_max_blocks,
        "index_blocks": len(index), "index_evicted_blocks": index.num_evicted,
        "ingest_seconds": round(ingest_s, 2),
        "ingest_blocks_per_second": round(num_events_blocks / ingest_s),
        "prompt_blocks": args.prompt_blocks, "decisions": args.decisions,
        "decision_p50_ms": round(statistics.median(times) * 1e3, 4),
        "decision_p99_ms": round(percentile(times, 0.99) * 1e3, 4),
        "decision_max_ms": round(max(times) * 1e3, 4),
        "decision_cpu_p50_ms": round(statistics.median(cpu_times) * 1e3, 4),
        "decision_cpu_p99_ms": round(percentile(cpu_times, 0.99) * 1e3, 4),
        "prompt_hash_p50_ms": round(statistics.median(hash_times) * 1e3, 3),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:28s} {value}")


if __name__ == "__main__":
    main()
