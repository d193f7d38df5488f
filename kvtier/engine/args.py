"""Engine options shared by every CLI subcommand that runs an engine (generate, serve, bench)."""

from __future__ import annotations

import argparse

from kvtier.common.sizes import parse_size
from kvtier.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    EngineConfig,
    check_device,
    check_seed,
    kv_offload_transfer_config,
    parse_transfer_config,
)
from kvtier.spec_decode.config import SpeculativeConfig


def add_engine_args(parser: argparse.ArgumentParser, *, positional_model: bool = True) -> None:
    """`positional_model`: also accept the model as the first positional argument (serve);
    generate takes prompts there instead."""
    group = parser.add_argument_group("engine")
    if positional_model:
        group.add_argument("model_positional", nargs="?", metavar="MODEL", default=None,
                           help="HF model directory or .gguf file (default: SmolLM2-135M)")
    group.add_argument("--model", default=None,
                       help="HF model directory or .gguf file (default: SmolLM2-135M)")
    group.add_argument("--dtype", default="auto", choices=DTYPES + ("bf16", "fp32", "fp16"),
                       help="weights and KV cache dtype (auto: bfloat16)")
    group.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if any)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length cap (default: the model's, lowered to what "
                            "the device KV cache holds; a larger value is an error)")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="token budget of one step")
    group.add_argument("--max-num-seqs", type=int, default=128,
                       help="most requests in one step")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=True, help="cut long prompts into steps' token budgets (on by "
                                          "default; off: each prompt in one piece)")
    group.add_argument("--scheduling-policy", dest="policy", default="fcfs",
                       choices=("fcfs", "priority"))
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="queue limit; past it new requests are refused")
    _add_kv_cache_args(group)
    transfer = group.add_mutually_exclusive_group()
    transfer.add_argument("--kv-transfer-config", default=None,
                          help="KV connector config as JSON (vLLM's shape); per-tier "
                               "policies of the OffloadingConnector are set here "
                               "(docs/tiers.md)")
    transfer.add_argument("--kv-offload", default=None,
                          help="tiered offloading in one flag, e.g. host=4GiB,disk=/path:50GiB "
                               "(disk: this instance's preallocated file; fs=DIR[:SIZE]: a file "
                               "per chunk, shared between instances; obj=s3://BUCKET/PREFIX: "
                               "an object per chunk in an S3-compatible bucket; "
                               "redis=redis://HOST:PORT/DB or redis+cluster://HOST:PORT: "
                               "Valkey/Redis, password from $REDIS_PASSWORD; "
                               "p2p=HOST:PORT[;HOST:PORT]: other kvtier instances' host "
                               "memory, p2p_listen=HOST:PORT: serve ours to them); "
                               "optional policy=lru|arc, blocks_per_chunk=N, write=through|back "
                               "(when chunks go on to disk: at once, or when host memory needs "
                               "room and at shutdown)")
    group.add_argument("--speculative-config", default=None,
                       help='speculative decoding as JSON, vLLM\'s shape: {"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                            '"prompt_lookup_min": 2} (requests draft tokens from their own '
                            "earlier text; the model checks them in one step)")
    group.add_argument("--enable-kv-cache-events", action="store_true",
                       help="record KV cache block events")
    group.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
    _add_lora_args(parser)


def _add_kv_cache_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="how K and V are stored in every tier (auto: as --dtype; fp8 = "
                            "fp8_e4m3: one byte an element, twice the tokens in the same "
                            "memory; docs/tiers.md)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True, help="the prefix cache (on by default)")
    size = group.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-memory-bytes", default=None,
                      help="device KV cache budget, e.g. 512MiB or 2GiB")
    size.add_argument("--num-device-blocks", type=int, default=None,
                      help="device KV cache size in blocks")


def _add_lora_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA")
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (PEFT directories) beside the base model")
    group.add_argument("--max-loras", type=int, default=1,
                       help="most LoRA adapters in one step (default 1); requests of another "
                            "adapter wait for a seat")
    group.add_argument("--max-lora-rank", type=int, default=16,
                       help="largest LoRA rank accepted (default 16)")
    group.add_argument("--max-cpu-loras", type=int, default=None,
                       help="most LoRA adapters kept loaded (default: no limit); past it the "
                            "least recently used is dropped and loaded again when asked")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Raises ValueError naming the bad option. Imports no torch: call it before anything
    heavy, so that a bad value fails at once."""
    positional = getattr(args, "model_positional", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ValueError(f"model given twice: {positional!r} and --model {args.model!r}")
    # The config checks these too, naming its keys; here the errors name the flags.
    check_seed(args.seed, "--seed")
    if args.device is not None:
        check_device(args.device, "--device")
    memory = None
    if args.kv_cache_memory_bytes is not None:
        memory = parse_size(args.kv_cache_memory_bytes, "--kv-cache-memory-bytes")
    if args.kv_offload is not None:
        transfer = kv_offload_transfer_config(args.kv_offload, "--kv-offload")
    else:
        transfer = parse_transfer_config(args.kv_transfer_config, "--kv-transfer-config")
    return EngineConfig.create(
        model=positional or args.model, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, seed=args.seed, block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching, kv_cache_memory_bytes=memory,
        num_device_blocks=args.num_device_blocks,
        enable_kv_cache_events=args.enable_kv_cache_events,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        enable_chunked_prefill=args.enable_chunked_prefill, policy=args.policy,
        max_waiting_requests=args.max_waiting_requests,
        kv_transfer_config=transfer, enable_lora=args.enable_lora,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        speculative_config=SpeculativeConfig.parse(args.speculative_config,
                                                   "--speculative-config"))
