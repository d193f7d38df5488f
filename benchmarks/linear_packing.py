"""All of SmolLM2-135M's projections over a batch of rows: F.linear on plain bf16 weights against
the same products on weights packed once for oneDNN (kvtier.models.packed_linear).

The shapes come from the packaged GGUF's config (30 layers of qkv, o, gate_up and down, and the
49152-row logits head); the weights are random (speed does not depend on them) and one set per
layer, so a pass streams ~220 MB of weights as a forward does. Each repeat times the plain and the
packed pass back to back, so both see the same machine load; the report is the best and the median
of the repeats and the median ratio.

    PYTHONPATH=. python benchmarks/linear_packing.py                 # rows 1, 16, 64, 528, 1100
    PYTHONPATH=. python benchmarks/linear_packing.py --rows 16 --repeats 20 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kvtier.models.gguf_file import GGUFModelFile
from kvtier.models.loader import default_model_path
from kvtier.models.packed_linear import PackedLinear, can_pack


def projection_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's projections, in forward order."""
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    return [(q_rows + 2 * kv_rows, config.hidden_size), (config.hidden_size, q_rows),
            (2 * config.intermediate_size, config.hidden_size),
            (config.hidden_size, config.intermediate_size)]


def time_pass(fn, inputs) -> float:
    start = time.perf_counter()
    for weight, x in inputs:
        fn(weight, x)
    return time.perf_counter() - start


def bench_rows(layers, head, rows: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(rows)

    def row_batch(width: int) -> torch.Tensor:
        return torch.randn(rows, width, generator=generator).bfloat16()

    plain = [(w, row_batch(w.shape[1])) for layer in layers for w in layer] + [
        (head, row_batch(head.shape[1]))]
    packed = [(PackedLinear(w, None), x) for w, x in plain]
    times = {"plain": [], "packed": []}
    for _ in range(repeats + 1):  # the first round warms caches and oneDNN's primitives
        times["plain"].append(time_pass(lambda w, x: F.linear(x, w), plain))
        times["packed"].append(time_pass(lambda module, x: module(x), packed))
    plain_s, packed_s = times["plain"][1:], times["packed"][1:]
    return {"rows": rows,
            "plain_ms": {"best": min(plain_s) * 1e3, "median": statistics.median(plain_s) * 1e3},
            "packed_ms": {"best": min(packed_s) * 1e3,
                          "median": statistics.median(packed_s) * 1e3},
            "median_ratio": statistics.median(p / q for p, q in zip(packed_s, plain_s))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,528,1100",
                        help="comma-separated batch sizes (tokens in a step)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not can_pack(torch.empty(1, dtype=torch.bfloat16)):
        print("linear_packing: this CPU/torch build has no oneDNN bf16 kernels; nothing to compare",
              file=sys.stderr)
        return 2
    config = GGUFModelFile(default_model_path()).model_config("smollm2")
    generator = torch.Generator().manual_seed(0)
    layers = [[torch.randn(shape, generator=generator).bfloat16()
               for shape in projection_shapes(config)] for _ in range(config.num_layers)]
    head = torch.randn(config.vocab_size, config.hidden_size, generator=generator).bfloat16()
    results = [bench_rows(layers, head, int(rows), args.repeats)
               for rows in args.rows.split(",")]
    report = {"model": "SmolLM2-135M-Instruct shapes", "num_layers": config.num_layers,
              "threads": torch.get_num_threads(), "repeats": args.repeats, "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{config.num_layers} layers x 4 projections + logits head, bf16, "
          f"{torch.get_num_threads()} threads, {args.repeats} paired repeats")
    print("| rows | F.linear ms (best / median) | packed ms (best / median) | packed / plain |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']} | {r['plain_ms']['best']:.1f} / {r['plain_ms']['median']:.1f} | "
              f"{r['packed_ms']['best']:.1f} / {r['packed_ms']['median']:.1f} | "
              f"{r['median_ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
