"""TTFT of a long prompt on a hybrid model (LFM2: short convolutions + attention): cold, with a
device prefix hit that resumes from a cached conv state, and with a host-tier hit.

The model is a random-weight LFM2 built here (about 100M parameters by default: 12 layers, 8 of
them short convolutions, as LFM2-350M mixes them) and saved in bf16 to a temporary directory;
weights do not change the cost of a forward. For each of `--repeats` fresh prompts:
  cold    first sight: the whole prefill is computed (and stored to host memory)
  device  again at once: a device prefix hit (attention KV and the conv state of the last full
          block before the last token)
  host    after reset_prefix_cache() drops the device copy: loaded from host memory
TTFT is arrival -> first token of a max_tokens=1 request; the median over the repeats is
reported, and each hit is checked (cached tokens, host hits).

    PYTHONPATH=. python benchmarks/hybrid_ttft.py                 # 2048 tokens, 3 repeats
    PYTHONPATH=. python benchmarks/hybrid_ttft.py --length 512 --repeats 1 --json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile

import torch
import transformers

from kvtier import LLM, SamplingParams

# LFM2-350M's layer mix (attention at 2, 5, 8, 10 of 16), cut to 12 layers.
_LAYER_TYPES = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv",
                "conv", "full_attention", "conv", "full_attention", "conv"]


def main() -> None:
    args = _parse_args()
    model_dir = tempfile.mkdtemp(prefix="kvtier-hybrid-ttft-")
    num_params = _save_model(model_dir, args)
    llm = LLM(model_dir, dtype="bfloat16", kv_offload=f"host={args.host}",
              max_num_batched_tokens=args.chunk, max_model_len=args.length + 16,
              kv_cache_memory_bytes=args.device_kv)
    rng = random.Random(args.seed)
    _timed(llm, _prompt(rng, 64))  # first-call costs (allocations, kernel builds) are not TTFT
    runs = [_three_ways(llm, _prompt(rng, args.length)) for _ in range(args.repeats)]
    llm.engine.shutdown()
    ttft = {way: statistics.median(run[way]["ttft_s"] for run in runs)
            for way in ("cold", "device", "host")}
    result = {"params": num_params, "length": args.length, "chunk": args.chunk,
              "repeats": args.repeats, "ttft_s": ttft, "runs": runs}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"LFM2 {num_params / 1e6:.0f}M params, {args.length}-token prompt, median of "
          f"{args.repeats}")
    for way, seconds in ttft.items():
        print(f"  {way:<7} {seconds:8.3f} s   {seconds / ttft['cold']:6.3f} of cold")


def _save_model(directory: str, args: argparse.Namespace) -> int:
    config = transformers.Lfm2Config(
        vocab_size=32768, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=len(_LAYER_TYPES), layer_types=_LAYER_TYPES, num_attention_heads=12,
        num_key_value_heads=4, max_position_embeddings=args.length + 16,
        block_multiple_of=256)
    torch.manual_seed(args.seed)
    model = transformers.Lfm2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 32768) for _ in range(length)]


def _three_ways(llm: LLM, prompt: list[int]) -> dict[str, dict]:
    cold = _timed(llm, prompt)
    device = _timed(llm, prompt)
    # Stores to host memory must have landed before the device copy goes.
    llm.engine.step()
    if not llm.engine.scheduler.connector.flush(timeout_s=120):
        raise TimeoutError("offloading did not go idle within 120 s")
    if not llm.reset_prefix_cache():
        raise RuntimeError("reset_prefix_cache refused: a request still holds blocks")
    host = _timed(llm, prompt)
    if device["cached_tokens"] == 0 or host["cached_tokens"] == 0 or host["host_hits"] == 0:
        raise RuntimeError(f"a hit did not happen: device {device}, host {host}")
    return {"cold": cold, "device": device, "host": host}


def _timed(llm: LLM, prompt: list[int]) -> dict:
    hits_key = 'kvtier:offload_tier_hits_total{tier="host"}'
    before = llm.get_metrics().get(hits_key, 0.0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    return {"ttft_s": output.metrics.first_token_time - output.metrics.arrival_time,
            "cached_tokens": output.num_cached_tokens,
            "host_hits": llm.get_metrics().get(hits_key, 0.0) - before}


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=3, help="fresh prompts (median)")
    parser.add_argument("--hidden", type=int, default=768, help="hidden size (768: ~100M)")
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--host", default="1GiB", help="host tier size")
    parser.add_argument("--device-kv", type=int, default=256 * 2**20,
                        help="device KV cache bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    return parser.parse_args()


if __name__ == "__main__":
    main()
