"""All of SmolLM2-135M's projections over a batch of rows: F.linear on plain bf16 weights against
the same products on weights packed once (kvtier.models.packed_linear): for oneDNN, and, on a CPU
with AMX, for kvtier's AMX kernel.

The shapes come from the packaged GGUF's config (30 layers of qkv, o, gate_up and down, and the
49152-row logits head); the weights are random (speed does not depend on them) and one set per
layer, so a pass streams ~270 MB of weights as a forward does. `--evict-mb` reads that much of
another buffer before each layer, untimed, as a decode step's attention reads its KV between the
layers' projections (a CPU whose cache holds all the weights would otherwise serve them from
there). Each repeat times the variants back to back, so all see the same machine load; the report
is the best and the median of the repeats and each packed variant's median ratio to plain.

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
from kvtier.models.packed_linear import PackedLinear, amx_kernels, can_pack


def projection_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's projections, in forward order."""
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    return [(q_rows + 2 * kv_rows, config.hidden_size), (config.hidden_size, q_rows),
            (2 * config.intermediate_size, config.hidden_size),
            (config.hidden_size, config.intermediate_size)]


def time_pass(fn, layers, evict: torch.Tensor | None) -> float:
    """Seconds in `fn(weight, x)` over every layer's inputs; `evict` is read before each layer."""
    elapsed = 0.0
    for inputs in layers:
        if evict is not None:
            evict.sum()
        start = time.perf_counter()
        for weight, x in inputs:
            fn(weight, x)
        elapsed += time.perf_counter() - start
    return elapsed


def variants(layers, head, rows: int) -> dict[str, tuple]:
    """name -> (fn, per-layer inputs): plain, oneDNN-packed, and AMX where it runs."""
    generator = torch.Generator().manual_seed(rows)

    def row_batch(width: int) -> torch.Tensor:
        return torch.randn(rows, width, generator=generator).bfloat16()

    plain = [[(w, row_batch(w.shape[1])) for w in layer] for layer in layers]
    plain.append([(head, row_batch(head.shape[1]))])
    kernels = ["onednn"] + (["amx"] if amx_kernels() is not None else [])
    found = {"plain": (lambda w, x: F.linear(x, w), plain)}
    for kernel in kernels:
        packed = [[(PackedLinear(w, None, kernel), x) for w, x in layer] for layer in plain]
        found[kernel] = (lambda module, x: module(x), packed)
    return found


def bench_rows(layers, head, rows: int, repeats: int, evict: torch.Tensor | None) -> dict:
    runs = variants(layers, head, rows)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats + 1):  # the first round warms caches and oneDNN's primitives
        for name, (fn, inputs) in runs.items():
            times[name].append(time_pass(fn, inputs, evict))
    result = {"rows": rows}
    plain = times["plain"][1:]
    for name, seconds in times.items():
        seconds = seconds[1:]
        result[f"{name}_ms"] = {"best": min(seconds) * 1e3,
                                "median": statistics.median(seconds) * 1e3}
        if name != "plain":
            result[f"{name}_ratio"] = statistics.median(p / q for p, q in zip(seconds, plain))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,528,1100",
                        help="comma-separated batch sizes (tokens in a step)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--evict-mb", type=int, default=0,
                        help="MB read before each layer (a decode step's KV reads: ~30)")
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
    evict = torch.ones(args.evict_mb << 18) if args.evict_mb else None  # fp32: 4 bytes each
    results = [bench_rows(layers, head, int(rows), args.repeats, evict)
               for rows in args.rows.split(",")]
    report = {"model": "SmolLM2-135M-Instruct shapes", "num_layers": config.num_layers,
              "threads": torch.get_num_threads(), "repeats": args.repeats,
              "evict_mb": args.evict_mb, "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    names = [name for name in ("onednn", "amx") if f"{name}_ms" in results[0]]
    print(f"{config.num_layers} layers x 4 projections + logits head, bf16, "
          f"{torch.get_num_threads()} threads, {args.repeats} paired repeats, "
          f"{args.evict_mb} MB read before each layer")
    print("| rows | F.linear ms (best / median) | "
          + " | ".join(f"{name} ms (best / median) | {name} / plain" for name in names) + " |")
    print("|---|---|" + "---|---|" * len(names))
    for r in results:
        cells = [f"{r['plain_ms']['best']:.1f} / {r['plain_ms']['median']:.1f}"]
        for name in names:
            cells += [f"{r[name + '_ms']['best']:.1f} / {r[name + '_ms']['median']:.1f}",
                      f"{r[name + '_ratio']:.2f}"]
        print(f"| {r['rows']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
