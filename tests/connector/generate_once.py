"""Generate greedily in a fresh process, once per transfer config, one engine after the other;
print what the connector tests check, as one JSON list (one entry per config).

Usage, from the repository root:
    python -m tests.connector.generate_once MODEL_DIR TRANSFER_CONFIGS_JSON PROMPTS_JSON \
        MAX_TOKENS BLOCK_SIZE
"""

import json
import sys

from kvtier import LLM, SamplingParams


def generate(model_dir: str, transfer_config: dict, prompts: list[list[int]],
             max_tokens: int, block_size: int) -> dict:
    llm = LLM(model_dir, dtype="float32", block_size=block_size, num_device_blocks=64,
              kv_transfer_config=transfer_config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_invariants()
    llm.engine.shutdown()
    return {
        "token_ids": [out.outputs[0].token_ids for out in outputs],
        "finish_reasons": [out.outputs[0].finish_reason for out in outputs],
        "errors": [out.error for out in outputs],
        "num_cached_tokens": [out.num_cached_tokens for out in outputs],
        "metrics": llm.get_metrics(),
    }


def main() -> None:
    model_dir, configs, prompts, max_tokens, block_size = sys.argv[1:]
    results = [generate(model_dir, config, json.loads(prompts), int(max_tokens), int(block_size))
               for config in json.loads(configs)]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
