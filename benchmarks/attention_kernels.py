"""The paged attention kernels on SmolLM2-135M's shapes, against this machine's limits and torch.

Shapes: 9 query heads, 3 KV heads, head dim 64, 16-slot pages, bf16 (the default model), one
layer's cache with the pages of each sequence scattered over it. Three measurements:

  decode    one new token for each of B sequences of C cached tokens: the kernel streams every
            attended K and V byte once, so it is memory bound; reported as GB/s of KV read and as
            a fraction of this machine's streaming-read bandwidth (a torch sum over a buffer
            larger than the last-level cache, same threads)
  chunk     a conversation's later turn, or a prefix hit's last block: Q new tokens over C
            cached ones (one sequence)
  prefill   a cold prompt's chunks: Q new tokens at offset C (C = 0: a causal square)

`--kv-cache-dtype fp8` (or fp8_e5m2) stores the cache in that format, as the engine's
`--kv-cache-dtype` does: decode then reads one byte an element, chunks and prompts stage their
pages in bf16 first.

For chunk and prefill, the C++ kernel is compared with the torch path the engine falls back to
(gather the pages, one scaled_dot_product_attention call with a causal-offset mask), and both
are reported as GFLOP/s of useful work (masked products not counted) next to this machine's
bf16 matmul rate (a 2,048-square matmul). Every figure is the best of `--repeats` runs.

    python benchmarks/attention_kernels.py
    python benchmarks/attention_kernels.py --decode 16x1024,64x2048 --chunk 128x2048
    python benchmarks/attention_kernels.py --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.config import KV_CACHE_DTYPES  # noqa: E402
from kvtier.engine.runtime import resolve_kv_cache_dtype  # noqa: E402
from kvtier.models import attention, cpu_kernels  # noqa: E402
from kvtier.models.attention_metadata import build_attention_metadata  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM ** -0.5


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # first call: lazy kernel build, page faults
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth(repeats: int) -> float:
    """Bytes per second an fp32 torch sum streams out of memory (a buffer past the caches; a
    bf16 sum converts as it goes and measures the conversion, not the memory)."""
    buffer = torch.ones(256 * 2**20 // 4, dtype=torch.float32)
    return buffer.numel() * 4 / best_seconds(buffer.sum, repeats)


def matmul_flops(repeats: int) -> float:
    a, b = torch.randn(2048, 2048, dtype=DTYPE), torch.randn(2048, 2048, dtype=DTYPE)
    return 2 * 2048**3 / best_seconds(lambda: a @ b, repeats)


def paged_case(num_computed: list[int], query_lens: list[int], kv_dtype: torch.dtype):
    """(query, kv_cache, metadata) with each sequence's pages at random places in the cache."""
    gen = torch.Generator().manual_seed(0)
    counts = [-(-(c + q) // BLOCK) for c, q in zip(num_computed, query_lens)]
    order = (torch.randperm(sum(counts), generator=gen) + 1).tolist()  # block 0: the null block
    tables, used = [], 0
    for count in counts:
        tables.append(order[used:used + count])
        used += count
    kv_cache = torch.randn(2, sum(counts) + 1, BLOCK, KV_HEADS, HEAD_DIM,
                           generator=gen).to(kv_dtype)
    query = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    metadata = build_attention_metadata(num_computed, query_lens, [tables], BLOCK)
    return query, kv_cache, metadata


def run_paged(query, kv_cache, metadata, kernels: bool):
    """One layer's attention through the engine's planner, with or without the C++ kernels."""
    if kernels:
        return lambda: attention.paged_attention(query, kv_cache, metadata, 0, SCALE, None)
    original = attention._cpu_kernel

    def torch_only():
        attention._cpu_kernel = lambda kv_cache, name: None
        try:
            metadata.plans.clear()
            return attention.paged_attention(query, kv_cache, metadata, 0, SCALE, None)
        finally:
            attention._cpu_kernel = original
    return torch_only


def decode_row(batch: int, context: int, bandwidth: float, repeats: int,
               kv_dtype: torch.dtype) -> dict:
    query, kv_cache, metadata = paged_case([context - 1] * batch, [1] * batch, kv_dtype)
    seconds = best_seconds(run_paged(query, kv_cache, metadata, True), repeats)
    kv_bytes = batch * context * 2 * KV_HEADS * HEAD_DIM * kv_dtype.itemsize
    return {"sequences": batch, "context": context, "kernel_ms": seconds * 1e3,
            "kv_gb_per_s": kv_bytes / seconds / 1e9,
            "fraction_of_read_bandwidth": kv_bytes / seconds / bandwidth}


def attend_row(new: int, cached: int, flops_peak: float, repeats: int,
               kv_dtype: torch.dtype) -> dict:
    query, kv_cache, metadata = paged_case([cached], [new], kv_dtype)
    # Query i attends cached + i + 1 keys: QK and PV, 2 flops per multiply-add, every head.
    useful = 2 * 2 * HEADS * HEAD_DIM * (new * cached + new * (new + 1) // 2)
    kernel = best_seconds(run_paged(query, kv_cache, metadata, True), repeats)
    fallback = best_seconds(run_paged(query, kv_cache, metadata, False), repeats)
    return {"new_tokens": new, "cached_tokens": cached, "kernel_ms": kernel * 1e3,
            "torch_ms": fallback * 1e3, "speedup": fallback / kernel,
            "kernel_gflops": useful / kernel / 1e9,
            "fraction_of_matmul_rate": useful / kernel / flops_peak}


def pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode", type=pairs, default=pairs("16x1024,16x2048,64x1024,64x2048"),
                        help="SEQUENCESxCONTEXT,... (default 16x1024,16x2048,64x1024,64x2048)")
    parser.add_argument("--chunk", type=pairs,
                        default=pairs("16x2032,16x8176,128x1024,128x2048,256x2048"),
                        help="NEWxCACHED,... for one sequence (default 16x2032,16x8176,128x1024,"
                             "128x2048,256x2048: a prefix hit's last block at 2k and 8k, later "
                             "turns)")
    parser.add_argument("--prefill", type=pairs, default=pairs("2048x0,2048x6144"),
                        help="NEWxOFFSET,... cold prompt chunks (default 2048x0,2048x6144)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the cache's format (auto: bf16, the default model's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if cpu_kernels.ops() is None:
        print("attention_kernels: the C++ kernels are unavailable here; nothing to measure",
              file=sys.stderr)
        return 1
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, DTYPE)
    bandwidth, flops_peak = read_bandwidth(args.repeats), matmul_flops(args.repeats)
    print(f"machine: streaming read {bandwidth / 1e9:.1f} GB/s, bf16 matmul "
          f"{flops_peak / 1e9:.0f} GFLOP/s, {torch.get_num_threads()} threads, KV cache "
          f"{kv_dtype}")
    result = {"read_gb_per_s": bandwidth / 1e9, "matmul_gflops": flops_peak / 1e9,
              "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
              "threads": torch.get_num_threads(), "decode": [], "chunk": [], "prefill": []}
    for batch, context in args.decode:
        row = decode_row(batch, context, bandwidth, args.repeats, kv_dtype)
        result["decode"].append(row)
        print(f"decode {batch} x {context}: {row['kernel_ms']:.2f} ms, "
              f"{row['kv_gb_per_s']:.1f} GB/s = {row['fraction_of_read_bandwidth']:.2f} of read")
    for kind, shapes in (("chunk", args.chunk), ("prefill", args.prefill)):
        for new, cached in shapes:
            row = attend_row(new, cached, flops_peak, args.repeats, kv_dtype)
            result[kind].append(row)
            print(f"{kind} {new} over {cached}: kernel {row['kernel_ms']:.1f} ms "
                  f"({row['kernel_gflops']:.0f} GFLOP/s = {row['fraction_of_matmul_rate']:.2f} "
                  f"of matmul), torch {row['torch_ms']:.1f} ms: {row['speedup']:.2f}x")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
