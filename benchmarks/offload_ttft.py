"""TTFT of a device hit, a host hit, a disk hit and a full recompute, and tier throughput.

For each prompt length, one fresh prompt is served four ways:
  recompute  first sight: the whole prefill is computed (and offloaded to host and disk)
  device     again at once: a device prefix-cache hit
  host       after reset_prefix_cache() drops the device copy: loaded from host memory
  fs         in a second engine on the same disk directory (cold device and host): from disk
             (or from the network store named by --store: the column is named after its tier,
             obj or redis)
TTFT is arrival -> first token of a max_tokens=1 request. Each hit is checked in the metrics.

Throughput of the tiers is printed next to this machine's raw figures, measured in the same run
on the same bytes with the same number of threads: "component" is wall-clock throughput of the
real copy handler and fs tier on this model's chunks with nothing else running (the engine
idle); "in-engine" is bytes over busy seconds (wall-clock time with at least one transfer
running) from the kvtier:offload_* metrics during the TTFT runs, where copies share the CPU with
the forward passes. Raw device<->host is one contiguous torch copy (torch limited to one thread
on a CPU "device", as the copy thread is one thread) and one-thread memcpy; raw file write/read
moves the same number of files of the chunk file size with the fs tier's pool sizes (temp file +
rename, no fsync, like the tier), and one file of all the bytes for reference. With --store obj
or redis, the store tier's store and load jobs are measured the same way on the same chunks, and
next to them the tier's own client library PUTting and GETting the same objects from as many
threads (benchmarks/store_throughput.py).

    python benchmarks/offload_ttft.py                     # SmolLM2-135M, 1k / 4k / 8k (8191)
    python benchmarks/offload_ttft.py --lengths 1024 --json
    python benchmarks/offload_ttft.py --store obj=s3://kv-cache/bench   # AWS_* settings
    python benchmarks/offload_ttft.py --store redis=redis://127.0.0.1:6379/0
    python benchmarks/offload_ttft.py --store redis --lengths 2048 4096   # a throwaway Valkey
    python benchmarks/offload_ttft.py --store obj --lengths 2048 4096     # a throwaway SeaweedFS
A bare `--store redis` / `--store obj` starts its own server on 127.0.0.1 (the `stores` extra's
valkey-server or weed binary) for the run. Targets: at 4k tokens a disk, obj or redis hit's TTFT
<= 1/4 of recompute, a host hit's <= 1/8; tier throughput >= 70% of the raw figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from store_throughput import is_network_store, run_jobs, store_pair, store_throughput

from kvtier import LLM, SamplingParams
from kvtier.connector.offloading.metadata import ChunkTransfer
from kvtier.connector.offloading.transfer import ChunkCopier
from kvtier.offload.host_area import HostArea
from kvtier.offload.keys import make_chunk_key
from kvtier.offload.tiers.base import TierContext
from kvtier.offload.tiers.fs import FsTier, FsTierOptions

_RAW_BYTES = 256 * 2**20
_DIRECTIONS = ("device_to_host", "host_to_device", "host_to_fs", "fs_to_host")


def main() -> None:
    args = _parse_args()
    # A scratch directory of our own is removed after the run (its tier files take GiBs).
    with tempfile.TemporaryDirectory(prefix="kvtier-offload-ttft-") as scratch:
        disk_dir = args.disk_dir or scratch
        # The tier behind host memory: by default the fs tier (a file per chunk), or --store.
        with store_pair(args.store or f"fs={disk_dir}:{args.disk}") as store:
            results = _measure(args, disk_dir, store)
    _report(results, args.json)


def _measure(args: argparse.Namespace, disk_dir: str, store: str) -> dict:
    store_tier = store.partition("=")[0]
    offload = f"host={args.host},{store}"
    engine_args = dict(dtype=args.dtype, device=args.device, kv_offload=offload,
                       kv_cache_memory_bytes=args.device_kv, max_num_batched_tokens=args.chunk,
                       max_model_len=max(args.lengths) + 1)
    rng = random.Random(args.seed)
    results = {"store_tier": store_tier, "ttft_s": {}, "checks": {}}
    llm = LLM(args.model, **engine_args)
    vocab = llm.engine.model_config.vocab_size
    prompts = {n: [rng.randrange(100, vocab) for _ in range(n)] for n in args.lengths}
    _warm_up(llm, rng, vocab)
    for n, prompt in prompts.items():
        results["ttft_s"][n], results["checks"][n] = _first_engine(llm, prompt)
    _wait_idle(llm)  # the cascade to disk must not share the disk with the measurement
    results["tier_throughput_bytes_per_s"] = _tier_throughput(llm.get_metrics(), store_tier)
    results["component_bytes_per_s"], shape, store_raw = _component_throughput(llm, disk_dir,
                                                                                store)
    # Right after the components, on the same bytes, so that both see the same machine load.
    results["raw_bytes_per_s"] = {**_raw_bandwidth(disk_dir, args.device, shape), **store_raw}
    llm.engine.shutdown()  # drains the cascade to disk
    second = LLM(args.model, **engine_args)
    _warm_up(second, rng, vocab)
    for n, prompt in prompts.items():
        ttft, cached, hits = _timed(second, prompt, store_tier)
        results["ttft_s"][n][store_tier] = ttft
        results["checks"][n][store_tier] = {"cached_tokens": cached, f"{store_tier}_hits": hits}
    load = f"{store_tier}_to_host"
    results["tier_throughput_bytes_per_s"][load] = _tier_throughput(second.get_metrics(),
                                                                    store_tier)[load]
    second.engine.shutdown()
    return results


def _warm_up(llm: LLM, rng: random.Random, vocab: int) -> None:
    """One throwaway request: first-call costs (allocations, kernel selection) are not TTFT."""
    prompt = [rng.randrange(100, vocab) for _ in range(64)]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2))


def _first_engine(llm: LLM, prompt: list[int]) -> tuple[dict, dict]:
    ttft, checks = {}, {}
    ttft["recompute"], checks["recompute"], _ = _timed(llm, prompt, "host")
    ttft["device"], checks["device"], _ = _timed(llm, prompt, "host")
    _wait_idle(llm)
    llm.reset_prefix_cache()
    ttft["host"], cached, hits = _timed(llm, prompt, "host")
    checks["host"] = {"cached_tokens": cached, "host_hits": hits}
    return ttft, checks


def _timed(llm: LLM, prompt: list[int], tier: str) -> tuple[float, int, float]:
    """(TTFT seconds, prompt tokens served from cache, new hits of `tier`) for one request."""
    hits_key = f'kvtier:offload_tier_hits_total{{tier="{tier}"}}'
    before = llm.get_metrics().get(hits_key, 0.0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    ttft = output.metrics.first_token_time - output.metrics.arrival_time
    return ttft, output.num_cached_tokens, llm.get_metrics().get(hits_key, 0.0) - before


def _wait_idle(llm: LLM) -> None:
    """Let device->host stores finish so that the host copy exists before the device one goes."""
    llm.engine.step()  # empty: the worker half reports the last step's copies
    if not llm.engine.scheduler.connector.flush(timeout_s=120):
        raise TimeoutError("offloading did not go idle within 120 s")


def _tier_throughput(metrics: dict[str, float], tier: str) -> dict[str, float | None]:
    """In-engine bytes per busy second of each direction (None: nothing moved); `tier`'s
    directions besides the fs tier's, which the component figures compare with."""
    rates: dict[str, float | None] = {}
    for direction in dict.fromkeys((*_DIRECTIONS, f"host_to_{tier}", f"{tier}_to_host")):
        num_bytes = metrics.get(f'kvtier:offload_bytes_total{{direction="{direction}"}}', 0.0)
        seconds = metrics.get(f'kvtier:offload_busy_seconds_total{{direction="{direction}"}}',
                              0.0)
        rates[direction] = num_bytes / seconds if seconds > 0 else None
    return rates


@dataclass(frozen=True)
class _Shape:
    """What the component measurement moved, for raw figures on the same workload."""

    num_bytes: int
    file_bytes: int
    num_read_threads: int
    num_write_threads: int


def _component_throughput(llm: LLM, directory: str,
                          store: str) -> tuple[dict[str, float], _Shape, dict[str, float]]:
    """Wall-clock throughput of the real copy and fs components, and of `store`'s tier if it is
    a network store, on this model's chunks (the engine's chunk layout), with nothing else
    running; and the store's raw client figures on the same objects."""
    layout = llm.engine.scheduler.connector.layouts[0]
    caches = list(llm.engine.runner.kv_caches)
    per_chunk = layout.blocks_per_chunk
    num_chunks = min(256, (caches[0].shape[1] - 1) // per_chunk, _RAW_BYTES // layout.chunk_bytes)
    area = HostArea(num_chunks * layout.chunk_bytes, layout.chunk_bytes)
    copier = ChunkCopier(area.buffer, area.slot_bytes, [caches], [layout])
    # Blocks in pool order (1, 2, ...), as a fresh engine's block pool hands them out.
    transfers = [ChunkTransfer(i, "bench", 0, i, tuple(range(per_chunk)),
                               tuple(range(1 + i * per_chunk, 1 + (i + 1) * per_chunk)))
                 for i in range(num_chunks)]
    num_bytes = num_chunks * layout.chunk_bytes
    # Best of five, like the raw copies: the first pass also faults the fresh host pages in.
    rates = {"device_to_host": _bytes_per_s(lambda: copier.device_to_host(transfers), num_bytes),
             "host_to_device": _bytes_per_s(lambda: copier.host_to_device(transfers), num_bytes)}
    options = FsTierOptions(root_dir=os.path.join(directory, "component"))
    tier = FsTier(options, TierContext("fs", b"component-bench"))
    keys = [make_chunk_key(b"component-bench", 0, i.to_bytes(32, "big"))
            for i in range(num_chunks)]
    for direction, submit in (("host_to_fs", tier.submit_store), ("fs_to_host", tier.submit_load)):
        rates[direction] = num_bytes / _seconds(
            lambda submit=submit: run_jobs(tier, submit, keys, area))
    tier.shutdown()
    shutil.rmtree(os.path.join(directory, "component"))
    store_raw: dict[str, float] = {}
    if is_network_store(store):
        store_rates, store_raw = store_throughput(store, area, num_chunks)
        rates.update(store_rates)
    return rates, _Shape(num_bytes, layout.chunk_bytes, options.num_read_threads,
                         options.num_write_threads), store_raw


def _seconds(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _raw_bandwidth(directory: str, device: str | None, shape: _Shape) -> dict[str, float]:
    host = np.ones(shape.num_bytes, dtype=np.uint8)
    copy = np.empty_like(host)
    raw = {"memcpy": _bytes_per_s(lambda: np.copyto(copy, host), shape.num_bytes)}
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_device = torch.ones(shape.num_bytes, dtype=torch.uint8, device=dev)
    host_tensor = torch.from_numpy(copy)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # the tier's copies run on one thread
    raw["device_to_host"] = _bytes_per_s(lambda: _sync(host_tensor.copy_(on_device), dev),
                                         shape.num_bytes)
    raw["host_to_device"] = _bytes_per_s(lambda: _sync(on_device.copy_(host_tensor), dev),
                                         shape.num_bytes)
    torch.set_num_threads(threads)
    files = os.path.join(directory, "raw-files")
    os.makedirs(files)
    paths = [os.path.join(files, f"{i}.bin") for i in range(shape.num_bytes // shape.file_bytes)]
    pieces = [memoryview(host)[i * shape.file_bytes:(i + 1) * shape.file_bytes]
              for i in range(len(paths))]
    raw["file_write"] = _bytes_per_s(lambda: _on_threads(
        _write_file, paths, pieces, shape.num_write_threads), shape.num_bytes)
    raw["file_read"] = _bytes_per_s(lambda: _on_threads(
        _read_file, paths, pieces, shape.num_read_threads), shape.num_bytes)
    shutil.rmtree(files)
    path = os.path.join(directory, "raw-bandwidth.bin")
    raw["one_file_write"] = _bytes_per_s(lambda: _write_file(path, host), shape.num_bytes)
    raw["one_file_read"] = _bytes_per_s(lambda: _read_file(path, copy), shape.num_bytes)
    os.unlink(path)
    return raw


def _on_threads(action, paths: list[str], pieces: list[memoryview], num_threads: int) -> None:
    with ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(action, paths, pieces))


def _sync(_: object, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _write_file(path: str, data: np.ndarray | memoryview) -> None:
    # Temp file + rename, no fsync: what the fs tier does per chunk.
    with open(path + ".tmp", "wb") as f:
        f.write(memoryview(data))
    os.replace(path + ".tmp", path)


def _read_file(path: str, out: np.ndarray | memoryview) -> None:
    with open(path, "rb") as f:
        f.readinto(memoryview(out))


def _bytes_per_s(action, num_bytes: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def _report(results: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(results, indent=2))
        return
    _report_ttft(results)
    _report_throughput(results)


def _report_ttft(results: dict) -> None:
    store = results["store_tier"]
    print(f"{'tokens':>7} {'recompute':>10} {'device':>8} {'host':>8} {store:>8}   "
          f"host/recompute {store}/recompute")
    for n, ttft in results["ttft_s"].items():
        print(f"{n:>7} {ttft['recompute']:>10.4f} {ttft['device']:>8.4f} {ttft['host']:>8.4f} "
              f"{ttft[store]:>8.4f}   {ttft['host'] / ttft['recompute']:>14.3f} "
              f"{ttft[store] / ttft['recompute']:>{len(store) + 10}.3f}")
    print("checks:", json.dumps(results["checks"]))


def _report_throughput(results: dict) -> None:
    gib = 2**30
    raw = results["raw_bytes_per_s"]
    store = results["store_tier"]
    pairs = [("device_to_host", "device_to_host"), ("host_to_device", "host_to_device"),
             ("host_to_fs", "file_write"), ("fs_to_host", "file_read")]
    if f"{store}_put" in raw:  # a network store: its tier next to its raw client
        pairs += [(f"host_to_{store}", f"{store}_put"), (f"{store}_to_host", f"{store}_get")]
    print(f"{'':>15}  {'component':>10} {'in-engine':>10} {'raw':>10}  (GiB/s)")
    for tier_direction, raw_name in pairs:
        rate = results["tier_throughput_bytes_per_s"].get(tier_direction)
        in_engine = "n/a" if rate is None else f"{rate / gib:.2f}"
        component = results["component_bytes_per_s"][tier_direction] / gib
        memcpy = (f", {100 * component * gib / raw['memcpy']:.0f}% of memcpy"
                  if raw_name.startswith(("device", "host")) else "")
        print(f"{tier_direction:>15}: {component:>10.2f} {in_engine:>10} "
              f"{raw[raw_name] / gib:>10.2f}  ({raw_name}, "
              f"{100 * component * gib / raw[raw_name]:.0f}% of raw{memcpy})")
    for direction, rate in results["tier_throughput_bytes_per_s"].items():
        if direction not in dict(pairs):
            print(f"{direction:>15}: {'':>10} {'n/a' if rate is None else f'{rate / gib:.2f}':>10}")
    print(f"{'raw memcpy':>15}: {raw['memcpy'] / gib:.2f} GiB/s (one thread, same bytes); one "
          f"file of the same bytes: write {raw['one_file_write'] / gib:.2f}, read "
          f"{raw['one_file_read'] / gib:.2f} GiB/s")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M GGUF)")
    # 8191: SmolLM2's 8192 positions hold the prompt and the one generated token.
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8191])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--host", default="2GiB", help="host tier budget")
    parser.add_argument("--disk", default="4GiB", help="disk tier budget")
    parser.add_argument("--disk-dir", default=None,
                        help="disk tier directory (default: a temp dir)")
    parser.add_argument("--store", default=None,
                        help="the tier behind host memory that the second engine reads, as a "
                             "--kv-offload pair such as obj=s3://BUCKET/PREFIX or "
                             "redis=redis://HOST:PORT/0, or a bare obj / redis for a throwaway "
                             "local SeaweedFS / Valkey (default: fs=DISK_DIR:DISK)")
    parser.add_argument("--device-kv", default="1GiB", help="device KV cache budget")
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


if __name__ == "__main__":
    main()
