"""What an fp8 KV cache (--kv-cache-dtype) costs in accuracy and gives in capacity, on the
default model (SmolLM2-135M-Instruct, bf16).

Text: this repository's own Markdown documents (real English and code, on disk: nothing is
downloaded), cut into passages of `--passage-tokens` tokens. For each KV format, and for the
model computing in fp32 (how far bf16 itself is from it, for scale):

  perplexity   exp of the mean negative log-likelihood of every passage token after the
               first, from the engine's prompt logprobs (the prefill attends K and V as stored)
  greedy       the first `--prefix-tokens` tokens of each passage continued greedily for
               `--output-tokens` tokens: how many continuations equal the bf16 cache's token for
               token, and the mean length of the common start
  capacity     tokens the device KV holds in `--kv-cache-memory-bytes`

    python benchmarks/kv_cache_dtype.py
    python benchmarks/kv_cache_dtype.py --passages 64 --output-json /tmp/kv_dtype.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier import LLM, SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# (model dtype, KV cache dtype); the first is the baseline.
RUNS = (("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "fp8_e4m3"),
        ("bfloat16", "fp8_e5m2"))


def passages(llm: LLM, count: int, length: int) -> list[list[int]]:
    """`count` passages of `length` tokens, in order, from README.md and docs/*.md."""
    tokens: list[int] = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        tokens += llm.get_tokenizer().encode(path.read_text())
    found = [tokens[i:i + length] for i in range(0, len(tokens) - length + 1, length)]
    if len(found) < count:
        raise SystemExit(f"kv_cache_dtype: the documents hold {len(found)} passages of {length} "
                         f"tokens; ask for at most that many (--passages)")
    return found[:count]


def measure(dtype: str, kv_cache_dtype: str, args: argparse.Namespace) -> dict:
    llm = LLM(dtype=dtype, kv_cache_dtype=kv_cache_dtype,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              max_model_len=args.passage_tokens + args.output_tokens)
    try:
        texts = passages(llm, args.passages, args.passage_tokens)
        scored = llm.generate([{"prompt_token_ids": t} for t in texts],
                              SamplingParams(max_tokens=1, prompt_logprobs=0))
        nll = [-entry[token].logprob for text, out in zip(texts, scored)
               for token, entry in zip(text[1:], out.prompt_logprobs[1:])]
        continued = llm.generate([{"prompt_token_ids": t[:args.prefix_tokens]} for t in texts],
                                 SamplingParams(temperature=0.0, max_tokens=args.output_tokens,
                                                ignore_eos=True))
        runtime = llm.engine.runtime
        return {"dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
                "stored_as": runtime.kv_identity.dtype,
                "perplexity": math.exp(sum(nll) / len(nll)), "scored_tokens": len(nll),
                "continuations": [o.outputs[0].token_ids for o in continued],
                "device_kv_tokens": (runtime.num_blocks - 1) * llm.engine.config.cache.block_size}
    finally:
        llm.engine.shutdown()


def common_start(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=48)
    parser.add_argument("--passage-tokens", type=int, default=512)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=512 << 20)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = [measure(dtype, kv_cache_dtype, args) for dtype, kv_cache_dtype in RUNS]
    baseline = results[0]["continuations"]
    print(f"{args.passages} passages of {args.passage_tokens} tokens; greedy continuations of "
          f"their first {args.prefix_tokens} tokens, {args.output_tokens} tokens each\n")
    print("| model / KV cache | perplexity | continuations equal to bf16's | mean common "
          "start | device KV tokens |\n|---|---|---|---|---|")
    for result in results:
        starts = [common_start(a, b) for a, b in zip(result.pop("continuations"), baseline)]
        result["equal_continuations"] = sum(s == args.output_tokens for s in starts)
        result["mean_common_start"] = sum(starts) / len(starts)
        print(f"| {result['stored_as']} | {result['perplexity']:.3f} | "
              f"{result['equal_continuations']} / {len(starts)} | "
              f"{result['mean_common_start']:.1f} | {result['device_kv_tokens']:,} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "results": results},
                                                     indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
